"""Tasks: creation with dedupe keys and wake-up outbox rows, on the lease protocol.

A task's side effect (waking a worker: SQS, a Lambda invoke, an in-process
queue) is an ``enqueue_task`` outbox row written in the same transaction as
the task itself, and again when a retry puts it back to ``Queued``.

A consumer of this process waiting in :meth:`TaskQueue.claim_wait` may be
handed a new task directly: :meth:`TaskQueue.create` then inserts it already
claimed for that consumer, so the enqueue's commit is the claim's too (see
docs/core.md, "The one-commit hand-off").
"""

from __future__ import annotations

import logging
import random
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import anyio

from trace_core.clock import Clock, SystemClock
from trace_core.errors import ConfigurationError, TraceError
from trace_core.leasing import FailOutcome, LeaseConfig, LeaseQueue, ReclaimReport
from trace_core.model import TASKS, ClaimOutcome, Fence, Holder, Lease
from trace_core.outbox import OUTBOX_CHANNEL
from trace_core.retry import RetryClass, RetryPolicy
from trace_core.storage.protocol import (
    NewTask,
    Repository,
    TaskCreated,
    TaskWakeup,
    Transaction,
    within,
)
from trace_core.wakeup import Offer, Subscription

__all__ = ["ENQUEUE_TASK", "TASKS_CHANNEL", "WAKEUP_CHUNK", "TaskQueue"]

ENQUEUE_TASK = "enqueue_task"
"""Outbox kind: start the tasks in ``{"task_ids": [...]}`` (one wake-up each).

One row carries the tasks created by one transaction (up to
:data:`WAKEUP_CHUNK`), so routing an event to many jobs writes one row, not
one per task; SQS takes them ten per ``SendMessageBatch`` anyway."""

WAKEUP_CHUNK = 500

TASKS_CHANNEL = "trace_tasks"
"""Wake-up channel notified when tasks become claimable."""

log = logging.getLogger(__name__)


class TaskQueue:
    """The task side of the ownership protocol."""

    def __init__(
        self,
        repo: Repository,
        *,
        clock: Clock | None = None,
        config: LeaseConfig | None = None,
        retry: RetryPolicy | None = None,
        rng: random.Random | None = None,
        wakeup_outbox: bool = True,
        handoff: bool = True,
    ) -> None:
        self.repo = repo
        self.clock = clock or SystemClock()
        self.leases = LeaseQueue(repo, TASKS, clock=self.clock, config=config, retry=retry, rng=rng)
        self.wakeup_outbox = wakeup_outbox
        """Write ``enqueue_task`` outbox rows (needed when wake-ups go through a
        queue such as SQS; a deployment whose workers only poll may turn it off)."""
        self.wakeup = TaskWakeup(
            ENQUEUE_TASK if wakeup_outbox else None,
            (TASKS_CHANNEL, OUTBOX_CHANNEL) if wakeup_outbox else (TASKS_CHANNEL,),
            WAKEUP_CHUNK,
        )
        self.handoff = handoff
        """Hand new tasks to consumers waiting in :meth:`claim_wait` (this
        process, same database), and let those wait for hand-offs."""
        self.handoff_key = f"{TASKS.name}@{repo.identity}"
        """The key of this queue's offers in ``repo.hub`` (see :meth:`claim_wait`)."""

    async def create(
        self, tasks: Sequence[NewTask], *, tx: Transaction | None = None
    ) -> list[TaskCreated]:
        """Create tasks; one per ``(job_id, dedupe_key)`` however often asked.

        Race-safe: concurrent creators of the same key get the same task id,
        and only the one that inserted it writes the wake-up.
        """
        for i, task in enumerate(tasks):
            if task.max_attempts < 1:
                raise ConfigurationError(f"tasks[{i}].max_attempts must be >= 1")
            if task.dedupe_key is not None and not task.dedupe_key.strip():
                raise ConfigurationError(f"tasks[{i}].dedupe_key must not be blank")
            if task.handicap_seconds < 0:
                raise ConfigurationError(f"tasks[{i}].handicap_seconds must be >= 0")
        # A batch of any size is one statement (tasks, wake-up rows, notify): on
        # Postgres it runs in autocommit on the driver, sparing the BEGIN and
        # COMMIT round trips; on SQLite a statement scope is one transaction.
        single = tx is None
        if single and len(tasks) == 1 and self.handoff:
            handed = await self._hand_off(tasks)
            if handed is not None:
                return handed
        async with self.repo.statement() if single else within(self.repo, tx) as t:
            return await t.create_tasks(tasks, now=self.clock.now(), wakeup=self.wakeup)

    async def _hand_off(self, tasks: Sequence[NewTask]) -> list[TaskCreated] | None:
        """Create the task already claimed for a consumer waiting in
        :meth:`claim_wait`, if one waits; ``None`` when nothing was handed
        over (nobody waits, an older task is queued, a duplicate dedupe key)."""
        offer = self.repo.hub.take(self.handoff_key, len(tasks))
        if offer is None:
            return None
        leases: list[Lease] = []
        try:
            async with self.repo.statement() as t:
                made = await t.create_claimed_tasks(
                    tasks,
                    now=self.clock.now(),
                    worker_id=offer.claimant,
                    lease_seconds=offer.lease_seconds,
                )
            leases = made  # committed: the scope ended without an error
        finally:
            # After the commit only; a failed or empty insert puts the offer back.
            delivered = self.repo.hub.settle(offer, leases or None)
        if not leases:
            return None
        if not delivered:
            # Its consumer was cancelled during our commit. The lease is ended
            # at once (a fenced write, as any), so that the reaper's next round
            # reclaims the task, as for a claimant that died before starting.
            # The task exists either way: a failure here must not fail the
            # enqueue (its lease then simply runs its full length).
            now = self.clock.now()
            try:
                async with self.repo.statement() as t:
                    for lease in leases:
                        await t.heartbeat(TASKS, lease.fence, now=now, expires_at=now)
            except TraceError as exc:
                log.warning(
                    "could not end the lease of orphaned task %s: %s", leases[0].item_id, exc
                )
            else:
                log.info(
                    "task %s was handed to a consumer that left; lease ended", leases[0].item_id
                )
        return [
            TaskCreated(_uuid(lease.item_id), True, task.dedupe_key)
            for lease, task in zip(leases, tasks, strict=True)
        ]

    async def claim_wait(
        self,
        worker_id: str,
        limit: int,
        *,
        max_wait: float,
        lease_seconds: float | None = None,
        wakeups: Subscription | None = None,
    ) -> list[Lease]:
        """:meth:`claim_batch`, waiting up to ``max_wait`` seconds for tasks
        when none is queued; ``[]`` if none came.

        While it waits, a task that :meth:`create` makes in this process
        (another coroutine or thread, same database) is handed over already
        claimed for it, in the enqueue's own commit, unless an older task is
        queued; tasks committed elsewhere wake it through ``TASKS_CHANNEL``.
        A consumer loop may pass its own ``wakeups`` subscription to spare
        one per call.
        """
        if max_wait < 0:
            raise ConfigurationError(f"max_wait must be >= 0, got {max_wait}")
        if wakeups is None:
            wakeups = await self.repo.subscribe(TASKS_CHANNEL)
        lease = lease_seconds or self.leases.config.lease_seconds
        deadline = anyio.current_time() + max_wait
        while True:
            leases = await self.claim_batch(worker_id, limit, lease_seconds=lease_seconds)
            remaining = deadline - anyio.current_time()
            if leases or remaining <= 0:
                return leases
            offer: Offer[list[Lease]] | None = None
            if self.handoff:
                offer = Offer(self.handoff_key, worker_id, limit, lease)
            await wakeups.wait(remaining, offer=offer)
            if offer is not None and offer.value:
                return offer.value

    async def claim(
        self, task_id: uuid.UUID, worker_id: str, *, lease_seconds: float | None = None
    ) -> ClaimOutcome:
        """Claim one task by id (``/internal/task-claim``).

        ``lease_seconds`` overrides the default lease (the job's heartbeat timeout).
        """
        return await self.leases.claim(task_id, worker_id, lease_seconds=lease_seconds)

    async def claim_batch(
        self, worker_id: str, limit: int, *, lease_seconds: float | None = None
    ) -> list[Lease]:
        """Claim up to ``limit`` queued tasks in claim order (``queued_at``)."""
        return await self.leases.claim_batch(worker_id, limit, lease_seconds=lease_seconds)

    async def heartbeat(
        self, fence: Fence, *, lease_seconds: float | None = None, holder: Holder | None = None
    ) -> datetime:
        """Extend the lease of the current attempt by ``lease_seconds`` (or the
        default); with ``holder``, only if the write finds what it says."""
        return await self.leases.heartbeat(fence, lease_seconds=lease_seconds, holder=holder)

    async def complete(
        self,
        fence: Fence,
        *,
        outputs: Sequence[Mapping[str, Any]] | None = None,
        tx: Transaction | None = None,
        result: Mapping[str, Any] | None = None,
        holder: Holder | None = None,
    ) -> None:
        """Mark the current attempt completed (a late reply included).

        Accepted while the task is Running, or after a timeout mark as long as
        no newer attempt has been claimed; rejected as stale otherwise.
        ``result`` is kept on the attempt's record by the same write, which
        also checks ``holder`` when given.
        """
        values = {"outputs": list(outputs)} if outputs is not None else None
        await self.leases.complete(
            fence, values=values, tx=tx, attempt_result=result, holder=holder
        )

    async def complete_many(self, fences: Sequence[Fence]) -> set[Any]:
        """Complete many attempts in one statement; the ids that were current."""
        return await self.leases.complete_many(fences)

    async def fail(
        self,
        fence: Fence,
        error: str,
        *,
        retry_class: RetryClass = RetryClass.RETRYABLE,
        tx: Transaction | None = None,
        timed_out: bool = False,
    ) -> FailOutcome:
        """Fail the current attempt: ``Failed`` with a retry time, or terminally.

        ``timed_out`` marks a failure the system decided (the attempt ran too
        long): the attempt's late reply stays acceptable until a newer
        attempt starts; a failure the holder reports ends the attempt."""
        return await self.leases.fail(
            fence, error, retry_class=retry_class, tx=tx, timed_out=timed_out
        )

    async def cancel(self, task_ids: Sequence[uuid.UUID], reason: str = "canceled") -> set[Any]:
        """Cancel unfinished tasks; their current holders become stale."""
        return await self.leases.cancel(task_ids, reason=reason)

    async def reclaim_expired(self) -> ReclaimReport:
        """The reaper's core: expired leases become ``Failed`` (retry or terminal)."""
        return await self.leases.reclaim_expired()

    async def requeue_due(self) -> list[Any]:
        """The retry scheduler's core: due retries go back to ``Queued`` with a wake-up."""
        async with self.repo.transaction() as tx:
            ids = await self.leases.requeue_due(tx=tx)
            await tx.wake_tasks(ids, self.wakeup, now=self.clock.now())
        return ids


def _uuid(item_id: Any) -> uuid.UUID:
    """A task id (tasks have UUID ids; a lease carries any queue's id type)."""
    assert isinstance(item_id, uuid.UUID)
    return item_id
