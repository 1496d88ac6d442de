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

A client that disconnects while waiting is not noticed until the wait ends;
a task claimed for it then simply expires and is retried by the reaper.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import anyio

from trace_core.dispatcher.control import ClaimedTask
from trace_core.dispatcher.runtimes import RuntimeKind
from trace_core.dispatcher.service import Dispatcher
from trace_core.errors import InvalidInput
from trace_core.storage.ports import RuntimeRoute
from trace_core.tasks import TASKS_CHANNEL

__all__ = ["StreamClaim", "StreamClaimer", "WakeupReceiver"]


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
    source: Literal["wakeup", "database"]
    claimed: ClaimedTask


class StreamClaimer:
    """Claims for v1 workers; see the module docstring."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        *,
        wakeups_per_round: int = 32,
        fallback_scan: int = 16,
        recheck_seconds: float = 2.0,
    ) -> None:
        self.dispatcher = dispatcher
        self.wakeups_per_round = wakeups_per_round
        self.fallback_scan = fallback_scan
        self.recheck_seconds = recheck_seconds

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
        deadline = anyio.current_time() + max_wait
        # Subscribed before the first look: a task made claimable between the
        # look and the wait still wakes the wait.
        subscription = await self.dispatcher.repo.subscribe(TASKS_CHANNEL)
        while True:
            for stream, matchers in plan:
                found = await self._claim_from(stream, matchers, worker_id)
                if found is not None:
                    return found
            remaining = deadline - anyio.current_time()
            if remaining <= 0:
                return None
            await subscription.wait(min(remaining, self.recheck_seconds))

    async def _claim_from(
        self, stream: str, matchers: list[Matcher], worker_id: str
    ) -> StreamClaim | None:
        control = self.dispatcher.control
        wakeups = self.dispatcher.wakeups
        if isinstance(wakeups, WakeupReceiver):
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
        async with self.dispatcher.repo.read() as tx:
            return await tx.tasks.oldest_queued(matchers, limit=self.fallback_scan)
