"""Claiming the next job of a worker stream (the v1 ``claim`` long-poll).

A *stream* is a worker queue: the ``target`` of a ``queue`` runtime
(``trace-ecs-udf``; a target with ``{operator}`` names one queue per operator).
For each stream, in the worker's priority order:

1. take wake-ups from the Dispatcher's wake-up queue when it can be read
   in-process (the lite profile's :class:`InProcessWakeupQueue`), one at a
   time, claiming each through ``dispatcher.control.claim`` (the concurrency
   gate); a wake-up whose claim is refused is dropped and the next one tried;
2. else fall back to the database: the oldest ``Queued`` tasks of the jobs
   whose runtime maps to the stream. Wake-ups are hints (at-least-once, and
   lost on a restart); the database is the truth, so a lost wake-up never
   strands a task.

With nothing to claim, the call waits on the ``tasks`` wake-up channel, which
every commit that makes a task claimable notifies (creation, retry requeue;
LISTEN/NOTIFY across processes on Postgres), and looks again; it re-checks
after ``recheck_seconds`` regardless, for what no notification announces
(another process on SQLite, a concurrency slot freed by a completion).

With a stream transport (the Dispatcher's wake-up queue is a
:class:`~trace_core.ports.StreamTransport`: Redis Streams, see
:mod:`trace_lite.redis_streams`), step 1 reads the stream instead, as the
consumer ``worker_id`` of the stream's consumer group: ONE ``XREADGROUP``
reads every stream of the claim, and each stream's message is tried in
priority order before that stream's database fallback; the answer names the
real message id (``source: "stream"``). A claim first *settles* what the
worker already holds: messages taken over (``XAUTOCLAIM``) from consumers
idle too long (dead workers), and its own pending messages when it may hold
some (its first claim in this process, a message a claim left pending, else
every ``settle_interval_seconds``): reports acknowledge their messages right
away, so this read is mostly skipped. Each message
is decided by the database alone, through the claim it asks for:

========================================  ======================================
the claim of the message's job            the message
========================================  ======================================
granted                                   answered; stays pending while it runs
completed, canceled, not found,           acknowledged (the job's fate is
waiting for a retry (which sends a new    committed; redelivery could only be
message)                                  refused)
dead-lettered                             copied to the DLQ stream and
                                          acknowledged, in one ``MULTI``
already running                           a new message: acknowledged (a
                                          duplicate); a pending one: kept until
                                          the run ends
at the job's concurrency limit            kept pending, tried again next claim
========================================  ======================================

Acknowledgement (decision): **the control plane acks on the worker's
behalf**, never the worker. Workers speak HTTP only (the contract's "no
inbound ports", and ``trace-lite worker`` is unchanged by the transport),
so they hold no Redis connection or credentials. A completion or failure
report acknowledges its message right after the database committed it
(:mod:`trace_core.api.report_acks`); the settling above is the safety net
for what that ack missed (a control plane killed between its commit and the
ack, Redis unreachable then): a redelivery asks for a claim the database
refuses, so it is acknowledged without a second execution. ``ack: true`` in
``complete``/``fail`` answers keeps the contract's meaning ("the message may
be acknowledged"); the control plane does it.

When the transport is unreachable the claim logs it and carries on with the
database alone (step 2), and waits on the database notifications.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal, Protocol, TypeVar, runtime_checkable

import anyio

from trace_core.dispatcher.bounded import BoundedMemo
from trace_core.dispatcher.control import ClaimedTask
from trace_core.dispatcher.runtimes import RuntimeKind
from trace_core.dispatcher.service import Dispatcher
from trace_core.errors import InvalidInput, NotFound
from trace_core.model import NotClaimedReason
from trace_core.ports import StreamMessage, StreamTransport, StreamTransportUnavailable
from trace_core.storage.ports import RuntimeRoute
from trace_core.storage.scopes import per_statement_reads
from trace_core.tasks import TASKS_CHANNEL

__all__ = ["StreamClaim", "StreamClaimer", "WakeupReceiver"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_WORKERS = 65_536  # workers whose next read-back of pending messages is remembered
_ALWAYS = datetime.min.replace(tzinfo=UTC)  # a read-back due now, whatever the clock says

# Claims refused for these reasons settle the message for good: acknowledge it.
_SETTLED = frozenset(
    {
        NotClaimedReason.COMPLETED,
        NotClaimedReason.CANCELED,
        NotClaimedReason.NOT_FOUND,
        NotClaimedReason.NOT_READY,
    }
)


@runtime_checkable
class WakeupReceiver(Protocol):
    """A wake-up queue this process can read (the in-process queue does)."""

    async def receive(
        self, queue: str, *, max_messages: int = 10, wait: float = 0.0
    ) -> list[uuid.UUID]:
        """Take up to ``max_messages`` task-id wake-ups from ``queue``."""
        ...


Matcher = RuntimeRoute
"""(runtime name, operator or ``None`` for any operator)."""


@dataclass(frozen=True)
class StreamClaim:
    """A claimed task, the stream it came from and how it was found."""

    stream: str
    source: Literal["wakeup", "database", "stream"]
    claimed: ClaimedTask
    message_id: str | None = None
    """The transport's message id (``source == "stream"``), else ``None``."""


class StreamClaimer:
    """Claims for v1 workers; see the module docstring."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        *,
        wakeups_per_round: int = 32,
        fallback_scan: int = 16,
        recheck_seconds: float = 2.0,
        settle_interval_seconds: float = 10.0,
    ) -> None:
        self.dispatcher = dispatcher
        self.wakeups_per_round = wakeups_per_round
        self.fallback_scan = fallback_scan
        self.recheck_seconds = recheck_seconds
        self.settle_interval_seconds = settle_interval_seconds
        """How often (on the Dispatcher's clock) a worker's own pending messages
        are read back when nothing says it holds any."""
        self._next_settle: BoundedMemo[str, datetime] = BoundedMemo(_WORKERS)
        """Per worker: when its own pending messages are next read back. A
        worker not in it (its first claim in this process, or the memo started
        over) is read back at once."""

    def matchers(self, stream: str, field: str) -> list[Matcher]:
        """The runtimes (and operators) whose tasks go to ``stream``;
        :class:`InvalidInput` naming ``field`` when no runtime does."""
        runtimes = self.dispatcher.runtimes
        found: list[Matcher] = []
        for name in sorted(runtimes.names()):
            runtime = runtimes.get(name)
            if runtime.kind is not RuntimeKind.QUEUE:
                continue
            if "{operator}" not in runtime.target:
                if runtime.target == stream:
                    found.append((name, None))
                continue
            head, _, _ = runtime.target.partition("{operator}")
            tail = runtime.target.rpartition("{operator}")[2]
            if len(stream) > len(head) + len(tail) and stream.startswith(head):
                operator = stream[len(head) : len(stream) - len(tail)]
                if stream.endswith(tail) and runtime.target_for(operator) == stream:
                    found.append((name, operator))
        if not found:
            queues = sorted(
                runtimes.get(n).target
                for n in runtimes.names()
                if runtimes.get(n).kind is RuntimeKind.QUEUE
            )
            raise InvalidInput(field, f"{stream!r} is not a worker queue (known: {queues})")
        return found

    async def claim(
        self, worker_id: str, streams: list[str], *, max_wait: float
    ) -> StreamClaim | None:
        """The first task claimable from ``streams`` (priority order), waiting
        up to ``max_wait`` seconds for one; ``None`` if none came."""
        plan = [(s, self.matchers(s, f"streams[{i}]")) for i, s in enumerate(streams)]
        transport = self.transport
        deadline = anyio.current_time() + max_wait
        # Subscribed before the first look: a task made claimable between the
        # look and the wait still wakes the wait.
        subscription = await self.dispatcher.repo.subscribe(TASKS_CHANNEL)
        if transport is not None:
            found = await self._settle(transport, worker_id, streams)
            if found is not None:
                return found
        while True:
            found = await self._look(plan, worker_id)
            if found is not None:
                return found
            remaining = deadline - anyio.current_time()
            if remaining <= 0:
                return None
            wait = min(remaining, self.recheck_seconds)
            if transport is not None:
                messages = await self._guarded(transport.read(worker_id, streams, wait=wait))
                if messages is not None:
                    found = await self._take_first(messages, worker_id, pending=False)
                    if found is not None:
                        return found
                    continue
            await subscription.wait(wait)

    @functools.cached_property
    def transport(self) -> StreamTransport | None:
        """The Dispatcher's wake-up queue when it is a stream transport (looked
        at once: a runtime-checkable protocol's check is not free, and the
        Dispatcher's queue never changes)."""
        wakeups = self.dispatcher.wakeups
        return wakeups if isinstance(wakeups, StreamTransport) else None

    async def _guarded(self, call: Awaitable[T]) -> T | None:
        """``await call``; ``None`` (logged) when the transport is unreachable."""
        try:
            return await call
        except StreamTransportUnavailable as exc:
            log.warning("stream transport unavailable, claiming from the database: %s", exc)
            return None

    async def _settle(
        self, transport: StreamTransport, worker_id: str, streams: list[str]
    ) -> StreamClaim | None:
        """Decide the messages ``worker_id`` holds: those taken over from dead
        consumers (the transport spaces its sweeps), and its own pending ones
        when it may have some (:meth:`_settle_due`); the first one whose job
        could be claimed is answered, the rest stay pending for the next claim."""
        taken = await self._guarded(transport.take_over(worker_id, streams)) or []
        own: list[StreamMessage] = []
        if self._settle_due(worker_id):
            read = await self._guarded(transport.pending(worker_id, streams))
            if read is not None:
                own = read
                now = self.dispatcher.clock.now()
                self._next_settle.put(
                    worker_id, now + timedelta(seconds=self.settle_interval_seconds)
                )
        # A takeover may return the worker's own messages too: decide each once.
        unique = {(m.stream, m.message_id): m for m in [*own, *taken]}
        return await self._take_first(list(unique.values()), worker_id, pending=True)

    def _settle_due(self, worker_id: str) -> bool:
        """Whether ``worker_id``'s own pending messages should be read back now.

        Reports acknowledge their messages right away
        (:mod:`~trace_core.api.report_acks`), so a worker mostly holds none:
        only what a claim left pending (:meth:`_unsettled`), what a failed or
        lost ack left (the interval), and what a previous control plane
        process left (a worker's first claim here) are read back.
        """
        due = self._next_settle.get(worker_id)
        return due is None or self.dispatcher.clock.now() >= due

    def _unsettled(self, worker_id: str) -> None:
        """``worker_id`` holds pending messages to decide: its next claim reads them back."""
        self._next_settle.put(worker_id, _ALWAYS)

    async def _take_first(
        self, messages: list[StreamMessage], worker_id: str, *, pending: bool
    ) -> StreamClaim | None:
        """Claim the job of each message in turn until one is granted (see the
        module docstring for what happens to the others)."""
        transport = self.transport
        assert transport is not None
        settled: list[StreamMessage] = []
        found: StreamClaim | None = None
        for message in messages:
            if found is not None:
                # One job per claim: the rest stay pending for the next one.
                self._unsettled(worker_id)
                break
            if message.job_id is None:
                settled.append(message)
                continue
            reason = await self._reason_now(message.job_id) if pending else None
            if reason is None or reason is NotClaimedReason.NOT_READY:
                claimed = await self.dispatcher.control.claim(message.job_id, worker_id)
                lease = claimed.outcome.lease
                if lease is not None:
                    found = StreamClaim(message.stream, "stream", claimed, message.message_id)
                    await self.dispatcher.control.record_transport(
                        message.job_id,
                        lease.attempt,
                        stream=message.stream,
                        message_id=message.message_id,
                    )
                    continue
                reason = claimed.outcome.reason
            if reason is NotClaimedReason.DEAD_LETTERED:
                await self._guarded(transport.dead_letter(message, str(reason)))
            elif reason in _SETTLED or (reason is NotClaimedReason.ALREADY_RUNNING and not pending):
                settled.append(message)
            elif reason is NotClaimedReason.CONCURRENCY_LIMIT:
                self._unsettled(worker_id)  # tried again by the next claim
            # else: a pending message of a running job, decided again on the interval
        await self._guarded(transport.ack(settled))
        return found

    async def _reason_now(self, job_id: uuid.UUID) -> NotClaimedReason:
        """Why the job could not be claimed now, from one read (``NOT_READY``
        also for a queued job: only a claim tells). A pending message is most
        often its worker's finished job: this read spares the claim attempt."""
        leases = self.dispatcher.tasks.leases
        try:
            state = await leases.inspect(job_id)
        except NotFound:
            return NotClaimedReason.NOT_FOUND
        return leases.refusal_reason(state)

    async def _look(
        self, plan: list[tuple[str, list[Matcher]]], worker_id: str
    ) -> StreamClaim | None:
        """One look at every stream, in priority order: a new message of the
        stream, else its database fallback. With a stream transport, ONE
        ``XREADGROUP`` reads every stream; a stream's messages are tried before
        its fallback and before any lower stream, and messages of lower streams
        left untried stay pending for the next claim."""
        transport = self.transport
        messages: list[StreamMessage] = []
        if transport is not None:
            streams = [stream for stream, _ in plan]
            messages = await self._guarded(transport.read(worker_id, streams, wait=0)) or []
        for index, (stream, matchers) in enumerate(plan):
            found = await self._claim_from(
                stream, matchers, worker_id, [m for m in messages if m.stream == stream]
            )
            if found is not None:
                lower = {s for s, _ in plan[index + 1 :]}
                if any(m.stream in lower for m in messages):
                    self._unsettled(worker_id)
                return found
        return None

    async def _claim_from(
        self,
        stream: str,
        matchers: list[Matcher],
        worker_id: str,
        messages: list[StreamMessage],
    ) -> StreamClaim | None:
        """A task of ``stream``: from its new transport ``messages``, else its
        in-process wake-ups (without a transport), else the database fallback."""
        control = self.dispatcher.control
        wakeups = self.dispatcher.wakeups
        if self.transport is not None:
            found = await self._take_first(messages, worker_id, pending=False)
            if found is not None:
                return found
        elif isinstance(wakeups, WakeupReceiver):
            for _ in range(self.wakeups_per_round):
                received = await wakeups.receive(stream, max_messages=1, wait=0)
                if not received:
                    break
                claimed = await control.claim(received[0], worker_id)
                if claimed.outcome.claimed:
                    return StreamClaim(stream, "wakeup", claimed)
        for task_id in await self._queued(matchers):
            claimed = await control.claim(task_id, worker_id)
            if claimed.outcome.claimed:
                return StreamClaim(stream, "database", claimed)
        return None

    async def _queued(self, matchers: list[Matcher]) -> list[uuid.UUID]:
        """The oldest queued tasks of the jobs routed to one stream, in claim order."""
        async with per_statement_reads(self.dispatcher.repo) as tx:
            return await tx.tasks.oldest_queued(matchers, limit=self.fallback_scan)
