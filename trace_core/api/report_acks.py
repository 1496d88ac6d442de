"""Acknowledging a reported attempt's stream message right after the commit.

With a stream transport (:class:`~trace_core.ports.StreamTransport`, Redis
Streams), a completion or a failure report that the database committed
acknowledges the stream message that delivered the attempt at once: its
stream and message id are on the attempt's record
(:meth:`TaskControl.record_transport
<trace_core.dispatcher.control.TaskControl.record_transport>`). A report
that dead-lettered the job copies the message to the dead-letter stream and
acknowledges it in one ``MULTI`` (:meth:`StreamTransport.dead_letter
<trace_core.ports.StreamTransport.dead_letter>`); a duplicate report only
acknowledges (the first one made the copy).

The ack always follows the commit, so the contract's rule ("acked only after
the final state, the requeue or the dead-letter committed") holds whatever
dies when. An ack that fails (the transport unreachable) is logged and left
to the claims' sweep (:mod:`trace_core.api.streams`), which settles pending
messages by what the database shows; it never fails the worker's report.

A test may arm a fault point between the commit and the ack: a transport
with a ``between_commit_and_ack`` hook (:class:`CommitAckFaultPoint`) calls
it with the message before acknowledging; a hook that kills the process
leaves the message pending exactly as a crash there would.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Protocol, runtime_checkable

from trace_core.dispatcher.service import Dispatcher
from trace_core.model import NotClaimedReason
from trace_core.ports import StreamMessage, StreamTransport
from trace_core.storage.ports.attempts import AttemptRecord
from trace_core.storage.scopes import per_statement_reads

__all__ = ["CommitAckFaultPoint", "CommitAckHook", "ack_reported", "stream_transport"]

log = logging.getLogger(__name__)

CommitAckHook = Callable[[StreamMessage], Awaitable[None]]
"""Called with the message between a report's commit and its ack (tests only)."""


@runtime_checkable
class CommitAckFaultPoint(Protocol):
    """A transport that carries a fault point between a report's commit and its ack."""

    between_commit_and_ack: CommitAckHook | None


def stream_transport(dispatcher: Dispatcher) -> StreamTransport | None:
    """The Dispatcher's wake-up queue when it is a stream transport."""
    wakeups = dispatcher.wakeups
    return wakeups if isinstance(wakeups, StreamTransport) else None


async def ack_reported(
    dispatcher: Dispatcher,
    job_id: uuid.UUID,
    attempt: int,
    *,
    record: AttemptRecord | None = None,
    dead_lettered: bool = False,
) -> None:
    """Acknowledge the stream message of attempt ``attempt`` of ``job_id``,
    whose report the database committed (module docstring); dead-letter it
    when the report did. ``record`` is the attempt's record when the caller
    read it already. Nothing without a stream transport, or for an attempt
    that no stream message delivered (a database-fallback claim)."""
    transport = stream_transport(dispatcher)
    if transport is None:
        return
    if record is None or record.attempt != attempt:
        async with per_statement_reads(dispatcher.repo) as tx:
            record = await tx.attempts.find_by_number(job_id, attempt)
    if record is None or record.stream is None or record.message_id is None:
        return
    message = StreamMessage(record.stream, record.message_id, job_id)
    if isinstance(transport, CommitAckFaultPoint) and transport.between_commit_and_ack:
        await transport.between_commit_and_ack(message)
    try:
        if dead_lettered:
            await transport.dead_letter(message, str(NotClaimedReason.DEAD_LETTERED))
        else:
            await transport.ack([message])
    except Exception as exc:
        # Committed already: the report stands; the claims' sweep acks it later.
        log.warning(
            "job %s attempt %d: stream message %s/%s not acknowledged, left to the sweep: %s",
            job_id,
            attempt,
            message.stream,
            message.message_id,
            exc,
        )
