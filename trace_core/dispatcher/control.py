"""The task-facing operations of the Dispatcher (what workers call).

``/internal/task-claim``, ``task-fetch``, ``heartbeat``, ``task-complete``
and ``events`` map one-to-one onto these methods; the HTTP layer only
translates. Completion with final events is one transaction: the events are
accepted (fenced by the attempt) and the task completed (fenced by attempt
and lease token) together, or neither.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from trace_core.clock import Clock, SystemClock
from trace_core.dispatcher.events import AcceptResult, DatasetEvent, EventGateway, Producer
from trace_core.dispatcher.payload import task_payloads
from trace_core.dispatcher.reaper import lease_seconds_for_task
from trace_core.errors import NotFound
from trace_core.leasing import FailOutcome
from trace_core.model import ClaimOutcome, Fence
from trace_core.retry import RetryClass
from trace_core.storage.protocol import Repository
from trace_core.storage.sql import as_sql
from trace_core.tasks import TaskQueue

__all__ = ["ClaimedTask", "Claimer", "TaskControl"]

Claimer = Callable[[uuid.UUID, str], Awaitable[ClaimOutcome]]
"""Claims one task by id for a worker."""


@dataclass(frozen=True)
class ClaimedTask:
    """A claim's answer: the outcome and, when claimed, the full task payload."""

    outcome: ClaimOutcome
    task: dict[str, Any] | None


class TaskControl:
    """Claim, fetch, heartbeat, emit, complete and fail tasks, fenced."""

    def __init__(
        self,
        repo: Repository,
        *,
        clock: Clock | None = None,
        tasks: TaskQueue | None = None,
        gateway: EventGateway | None = None,
        claim: Claimer | None = None,
        directive: Callable[[uuid.UUID], Awaitable[str]] | None = None,
    ) -> None:
        self.repo = repo
        self.clock = clock or SystemClock()
        self.tasks = tasks or TaskQueue(repo, clock=self.clock)
        self.gateway = gateway or EventGateway(repo, clock=self.clock)
        self._claim = claim or self.tasks.claim
        """The claim path; the Dispatcher passes its concurrency gate (limits and
        per-job leases) here."""
        self._directive = directive

    async def claim(self, task_id: uuid.UUID, worker_id: str) -> ClaimedTask:
        """Lease the task's next attempt and return its payload, or why not."""
        outcome = await self._claim(task_id, worker_id)
        if outcome.lease is None:
            return ClaimedTask(outcome, None)
        return ClaimedTask(outcome, await self.fetch(task_id))

    async def fetch(self, task_id: uuid.UUID) -> dict[str, Any]:
        """The full task payload (read-only); :class:`NotFound` if there is no such task."""
        async with self.repo.read() as tx:
            payloads = await task_payloads(as_sql(tx).connection, [task_id])
        if task_id not in payloads:
            raise NotFound(f"task {task_id} does not exist")
        return payloads[task_id]

    async def heartbeat(self, fence: Fence) -> datetime:
        """Extend the current attempt's lease by the job's heartbeat timeout;
        :class:`StaleClaim` if it is not current."""
        async with self.repo.read() as tx:
            lease = await lease_seconds_for_task(as_sql(tx).connection, _task_id(fence))
        return await self.tasks.heartbeat(fence, lease_seconds=lease)

    async def directive(self, task_id: uuid.UUID) -> str:
        """What a running source should do now: ``run``, ``pause`` (backpressure)
        or ``stop`` (shutdown drain); always ``run`` without a source supervisor."""
        return "run" if self._directive is None else str(await self._directive(task_id))

    async def emit(
        self, task_id: uuid.UUID, attempt: int, events: Sequence[DatasetEvent]
    ) -> AcceptResult:
        """Accept mid-task events from the task's current attempt."""
        return await self.gateway.accept(events, producer=Producer(task_id, attempt))

    async def complete(
        self,
        fence: Fence,
        *,
        events: Sequence[DatasetEvent] = (),
        outputs: Sequence[Mapping[str, Any]] | None = None,
    ) -> AcceptResult:
        """Accept the final events and complete the attempt, atomically."""
        async with self.repo.transaction() as tx:
            accepted = await self.gateway.accept(
                events, producer=Producer(_task_id(fence), fence.attempt), tx=tx
            )
            await self.tasks.complete(fence, outputs=outputs, tx=tx)
        return accepted

    async def fail(self, fence: Fence, error: str, *, retryable: bool = True) -> FailOutcome:
        """Fail the current attempt: a retry with backoff, or terminal."""
        retry_class = RetryClass.RETRYABLE if retryable else RetryClass.FATAL
        return await self.tasks.fail(fence, error, retry_class=retry_class)


def _task_id(fence: Fence) -> uuid.UUID:
    item = fence.item_id
    return item if isinstance(item, uuid.UUID) else uuid.UUID(str(item))
