"""An attempt's final report (completed or failed), idempotent per attempt.

Both the internal task contract and the v1 worker contract finish an attempt
here. A repeated report of an attempt whose outcome the database already
holds is recognized and answered as a duplicate: the fenced write refuses
it (the lifecycle has no ``Completed -> Completed`` edge), and the task row,
which keeps the attempt number and lease token of its last claim, shows that
this very attempt got there. Nothing is written for a duplicate.

A report for a canceled task is stale: cancellation fences the holder out
(:class:`~trace_core.errors.StaleClaim`), whatever the lifecycle says.

The v1 contract also names the worker: :func:`holder_attempt` finds the
attempt a report is about (by number or by its record's ``attempt_id``) and
refuses a worker that is not the one the attempt was claimed by
(:class:`NotLeaseHolder`), and :func:`check_message` a report naming another
stream message than the one that delivered the attempt (:class:`WrongMessage`),
before anything is written. An attempt's worker
never changes, so checking it before the fenced write is as good as in it.
A completion's ``result`` and a failure's structured ``error`` are kept on the
attempt's record, in the transaction that ends the attempt; a duplicate
report keeps what the first one wrote.

After the commit, a report acknowledges the attempt's stream message when a
stream transport delivered it (:func:`~trace_core.api.report_acks.ack_reported`):
both contracts' reports, so a ``trace-lite worker`` (which reports through
``/internal/task-complete``) has its message acknowledged right away too.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trace_core.api.report_acks import ack_reported
from trace_core.authoring.events import DatasetEvent
from trace_core.dispatcher.service import Dispatcher
from trace_core.errors import InvalidTransition, NotFound, StaleClaim
from trace_core.model import Fence, Holder, ItemState
from trace_core.storage.ports.attempts import AttemptRecord
from trace_core.storage.scopes import per_statement_reads

__all__ = [
    "Completion",
    "Failure",
    "HeldAttempt",
    "NotLeaseHolder",
    "WrongMessage",
    "check_message",
    "complete_attempt",
    "complete_held",
    "fail_attempt",
    "holder_attempt",
    "report_state",
]

_MAX_ERROR = 8_192  # characters of an error message kept in tasks.error_message


class NotLeaseHolder(StaleClaim):
    """A report names another worker than the one the attempt was claimed by;
    nothing was changed."""


class WrongMessage(StaleClaim):
    """A report names another stream message than the one that delivered its
    attempt (as the claim answered it); nothing was changed."""


@dataclass(frozen=True)
class HeldAttempt:
    """The attempt a v1 report is about: its number and its record (``None``
    for an attempt claimed before records were kept)."""

    number: int
    record: AttemptRecord | None


async def holder_attempt(
    dispatcher: Dispatcher,
    job_id: uuid.UUID,
    attempt_id: int | uuid.UUID | None,
    worker_id: str,
) -> HeldAttempt:
    """The attempt a v1 report of ``worker_id`` is about.

    ``attempt_id`` is the attempt number, the attempt record's id, or ``None``
    for the task's current attempt. Raises :class:`NotFound` for an unknown
    job or an ``attempt_id`` that is no attempt of it, and
    :class:`NotLeaseHolder` when the attempt was claimed by another worker.
    An attempt without a record (claimed before records were kept) is not
    checked here; its fence still is.
    """
    if isinstance(attempt_id, uuid.UUID):
        async with per_statement_reads(dispatcher.repo) as tx:
            record = await tx.attempts.find(attempt_id)
        if record is None or record.task_id != job_id:
            raise NotFound(f"job {job_id} has no attempt {attempt_id}")
    else:
        number = attempt_id
        if number is None:
            number = (await dispatcher.tasks.leases.inspect(job_id)).attempt
        async with per_statement_reads(dispatcher.repo) as tx:
            record = await tx.attempts.find_by_number(job_id, number)
        if record is None:
            return HeldAttempt(number, None)
    if record.worker_id != worker_id:
        raise NotLeaseHolder("tasks", job_id, f"attempt {record.attempt} is held by another worker")
    return HeldAttempt(record.attempt, record)


def check_message(held: HeldAttempt, stream: str, message_id: str) -> None:
    """Raise :class:`WrongMessage` when the attempt's record names the stream
    message that delivered it and a report names another (``stream`` and
    ``message_id`` as the claim answered them). An attempt that no stream
    message delivered (a database-fallback or in-process wake-up claim, whose
    ``message_id`` is an opaque token) is not checked."""
    record = held.record
    if record is None or record.stream is None or record.message_id is None:
        return
    if (stream, message_id) != (record.stream, record.message_id):
        raise WrongMessage(
            "tasks",
            record.task_id,
            f"attempt {record.attempt} was delivered by message {record.message_id} of "
            f"stream {record.stream}: send back the stream and message_id its claim answered",
        )


@dataclass(frozen=True)
class Completion:
    """A completed attempt: new, or a duplicate report of one."""

    duplicate: bool
    event_ids: list[uuid.UUID] = field(default_factory=list)


@dataclass(frozen=True)
class Failure:
    """A failed attempt: a retry is scheduled (``retrying``) or it is dead-lettered."""

    retrying: bool
    duplicate: bool
    status: str


async def report_state(dispatcher: Dispatcher, fence: Fence) -> ItemState:
    """The task's state when ``fence``'s attempt already reported its outcome.

    Raises :class:`StaleClaim` when another attempt owns the task or it was
    canceled, and :class:`~trace_core.errors.NotFound` when it does not exist.
    """
    state = await dispatcher.tasks.leases.inspect(fence.item_id)
    if state.attempt != fence.attempt or state.lease_token != fence.lease_token:
        raise StaleClaim(
            "tasks",
            fence.item_id,
            f"attempt {fence.attempt} is not current (attempt {state.attempt}, {state.status})",
        )
    if state.status == "Canceled":
        raise StaleClaim("tasks", fence.item_id, "the task was canceled")
    return state


async def complete_attempt(
    dispatcher: Dispatcher,
    fence: Fence,
    *,
    events: Sequence[DatasetEvent] = (),
    outputs: Sequence[Mapping[str, Any]] | None = None,
    result: Mapping[str, Any] | None = None,
    record: AttemptRecord | None = None,
) -> Completion:
    """Commit the final events, the completion and the attempt's ``result`` in
    one transaction, or recognize a duplicate report of the same attempt; then
    acknowledge the attempt's stream message (``record``: the attempt's
    record, when the caller read it already)."""
    try:
        accepted = await dispatcher.control.complete(
            fence, events=events, outputs=outputs, result=result
        )
    except InvalidTransition:
        state = await report_state(dispatcher, fence)
        if state.status != "Completed":
            raise
        done = Completion(duplicate=True)
    else:
        done = Completion(duplicate=False, event_ids=list(accepted.event_ids))
    await ack_reported(dispatcher, _job_id(fence), fence.attempt, record=record)
    return done


async def complete_held(
    dispatcher: Dispatcher,
    fence: Fence,
    holder: Holder,
    *,
    events: Sequence[DatasetEvent] = (),
    outputs: Sequence[Mapping[str, Any]] | None = None,
    result: Mapping[str, Any] | None = None,
) -> Completion:
    """:func:`complete_attempt` of a v1 report whose worker and message the
    completion's own write checks (:class:`~trace_core.model.Holder`), with
    no read of the attempt's record before it. Any refusal propagates as the
    fenced write raised it (a duplicate report included): the caller then
    takes the checked path (:func:`holder_attempt`, :func:`check_message`,
    :func:`complete_attempt`), which says precisely why."""
    accepted = await dispatcher.control.complete(
        fence, events=events, outputs=outputs, result=result, holder=holder
    )
    await ack_reported(dispatcher, _job_id(fence), fence.attempt)
    return Completion(duplicate=False, event_ids=list(accepted.event_ids))


async def fail_attempt(
    dispatcher: Dispatcher,
    fence: Fence,
    error: str,
    *,
    retryable: bool,
    detail: Mapping[str, Any] | None = None,
    record: AttemptRecord | None = None,
) -> Failure:
    """Fail the attempt (retry with backoff, or dead-letter), or recognize a
    duplicate report of an attempt that already failed; then acknowledge the
    attempt's stream message (a new dead-letter copies it to the dead-letter
    stream too). ``detail`` is the structured error kept on the attempt's
    record; ``record`` the record, when the caller read it already."""
    try:
        outcome = await dispatcher.control.fail(
            fence, error[:_MAX_ERROR], retryable=retryable, detail=detail
        )
    except InvalidTransition:
        state = await report_state(dispatcher, fence)
        if state.status == "Queued":  # failed, and the retry already put it back
            failed = Failure(retrying=True, duplicate=True, status=state.status)
        elif state.status == "Failed":
            failed = Failure(retrying=state.retry_at is not None, duplicate=True, status="Failed")
        else:
            raise  # completed: a failure report contradicts the recorded outcome
    else:
        failed = Failure(retrying=outcome.retrying, duplicate=False, status=outcome.status)
    await ack_reported(
        dispatcher,
        _job_id(fence),
        fence.attempt,
        record=record,
        # Only the report that dead-lettered copies the message: a duplicate's
        # first report did.
        dead_lettered=not failed.retrying and not failed.duplicate,
    )
    return failed


def _job_id(fence: Fence) -> uuid.UUID:
    item = fence.item_id
    return item if isinstance(item, uuid.UUID) else uuid.UUID(str(item))
