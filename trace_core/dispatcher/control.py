"""The task-facing operations of the Dispatcher (what workers call).

``/internal/task-claim``, ``task-fetch``, ``heartbeat``, ``task-complete``
and ``events`` map one-to-one onto these methods; the HTTP layer only
translates. Completion with final events is one transaction: the events are
accepted (fenced by the attempt) and the task completed (fenced by attempt
and lease token) together, or neither.

With a :class:`~trace_core.dispatcher.capabilities.CapabilityIssuer`, a
claimed payload also carries ``capability_token``, issued for the claimed
``(task_id, attempt)``. If the token cannot be issued, the fresh attempt is
failed at once (terminally when issuing can never succeed, for instance a
location no token can grant; with a retry otherwise) and the claim is
answered as not claimed: no worker runs an attempt it could not authorize.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from trace_core.clock import Clock, SystemClock
from trace_core.dispatcher.events import AcceptResult, DatasetEvent, EventGateway, Producer
from trace_core.dispatcher.payload import task_payloads
from trace_core.dispatcher.reaper import lease_seconds_for_task
from trace_core.errors import ConfigurationError, NotFound
from trace_core.leasing import FailOutcome
from trace_core.model import ClaimOutcome, Fence, Lease, NotClaimedReason
from trace_core.retry import RetryClass
from trace_core.storage.protocol import Repository
from trace_core.storage.sql import as_sql
from trace_core.tasks import TaskQueue

if TYPE_CHECKING:  # the security stack is imported only by whoever configures it
    from trace_core.dispatcher.capabilities import CapabilityIssuer

__all__ = ["ClaimedTask", "Claimer", "TaskControl"]

log = logging.getLogger(__name__)

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
        capabilities: CapabilityIssuer | None = None,
        on_release: Callable[[uuid.UUID], Awaitable[object]] | None = None,
    ) -> None:
        self.repo = repo
        self.clock = clock or SystemClock()
        self.tasks = tasks or TaskQueue(repo, clock=self.clock)
        self.gateway = gateway or EventGateway(repo, clock=self.clock)
        self._claim = claim or self.tasks.claim
        """The claim path; the Dispatcher passes its concurrency gate (limits and
        per-job leases) here."""
        self._directive = directive
        self._capabilities = capabilities
        """Issues each claimed attempt's capability token, when configured."""
        self._on_release = on_release
        """Called with the task id after an attempt completed or failed (the
        Dispatcher wakes tasks waiting for the job's concurrency slot)."""

    async def claim(self, task_id: uuid.UUID, worker_id: str) -> ClaimedTask:
        """Lease the task's next attempt and return its payload, or why not.

        With a capability issuer the payload carries ``capability_token``.
        """
        outcome = await self._claim(task_id, worker_id)
        if outcome.lease is None:
            return ClaimedTask(outcome, None)
        payload = await self.fetch(task_id)
        if self._capabilities is None:
            return ClaimedTask(outcome, payload)
        return await self._authorized(task_id, outcome, outcome.lease, payload, self._capabilities)

    async def _authorized(
        self,
        task_id: uuid.UUID,
        outcome: ClaimOutcome,
        lease: Lease,
        payload: dict[str, Any],
        capabilities: CapabilityIssuer,
    ) -> ClaimedTask:
        """The claimed payload with its token, or the attempt failed and a refusal."""
        try:
            token = await capabilities.issue_for(payload)
        except Exception as exc:
            # InvalidInput is a ConfigurationError: the payload itself cannot be
            # granted, so another attempt would fail the same way.
            final = isinstance(exc, ConfigurationError)
            log.warning(
                "no capability token for task %s attempt %s (%s): %s",
                task_id,
                lease.attempt,
                "failing it" if final else "retrying it",
                exc,
            )
            fence = Fence(task_id, lease.attempt, lease.lease_token)
            failed = await self.fail(
                fence, f"capability token not issued: {exc}", retryable=not final
            )
            reason = (
                NotClaimedReason.NOT_READY if failed.retrying else NotClaimedReason.DEAD_LETTERED
            )
            return ClaimedTask(ClaimOutcome(None, reason), None)
        return ClaimedTask(outcome, {**payload, "capability_token": token})

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
        await self._released(fence)
        return accepted

    async def fail(self, fence: Fence, error: str, *, retryable: bool = True) -> FailOutcome:
        """Fail the current attempt: a retry with backoff, or terminal."""
        retry_class = RetryClass.RETRYABLE if retryable else RetryClass.FATAL
        outcome = await self.tasks.fail(fence, error, retry_class=retry_class)
        await self._released(fence)
        return outcome

    async def _released(self, fence: Fence) -> None:
        """A running slot of the task's job is free: wake who waits for it."""
        if self._on_release is not None:
            await self._on_release(_task_id(fence))


def _task_id(fence: Fence) -> uuid.UUID:
    item = fence.item_id
    return item if isinstance(item, uuid.UUID) else uuid.UUID(str(item))
