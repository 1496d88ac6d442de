"""Concurrency limits: ``scaling.max_concurrency`` enforced when a task is claimed.

A claim of a limited job's task is one transaction: lock the job, count its
``Running`` tasks, and claim only below the limit; otherwise the answer is
``NotClaimedReason.CONCURRENCY_LIMIT`` (the wake-up is retried later) and the
wait is journaled, at most once per job per ``journal_interval_seconds``.

Race-freedom. On SQLite every write transaction holds the database's single
write lock from ``BEGIN IMMEDIATE``, so count-then-claim is already atomic.
On Postgres (READ COMMITTED) two claimers could both count 1 of 2 and both
claim; so claims of the same limited job are serialized on that job's
``job_states`` row (``SELECT ... FOR UPDATE``, the row created on first use,
both through the shared helpers of :mod:`trace_core.dispatcher.job_states`).
The count runs after the lock is granted, in a fresh snapshot that sees the
previous holder's committed claim.

Deadlock-freedom on Postgres: every path here takes ``job_states`` locks
first, several of them in job id order (as the backpressure monitor writes
them), and only then touches task rows; batch claims lock their candidate
tasks with ``SKIP LOCKED``, which never waits.

Every claim of tasks that may belong to a limited job must go through this
gate (the task-claim endpoint and poll-driven workers); a plain
:meth:`TaskQueue.claim` does not look at limits. Jobs without a limit take the
plain path: one read of the task's job (its limits are cached: ``jobs`` rows
are immutable within a DAG version) and the claim itself; a caller that read
the task's job already (:meth:`TaskControl.claim <trace_core.dispatcher.control.TaskControl.claim>`)
passes it, and the claim is then a single statement without a transaction.
Which job a task belongs to never changes either: the gate remembers it from
the claim, so releasing a slot of a job without a limit reads nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from trace_core.dispatcher.bounded import BoundedMemo
from trace_core.dispatcher.job_states import by_job_id
from trace_core.errors import ConfigurationError
from trace_core.model import TASKS, ClaimOutcome, Lease, NotClaimedReason
from trace_core.storage.protocol import Repository, Transaction
from trace_core.tasks import TaskQueue

__all__ = [
    "CONCURRENCY_WAIT",
    "ConcurrencyConfig",
    "ConcurrencyGate",
    "JobLimits",
    "count_in_flight_by_operator",
    "count_running",
]

_TASK_JOBS = 65_536  # tasks whose job the gate remembers (a job never changes)

CONCURRENCY_WAIT = "concurrency_wait"
"""Journal kind of a claim refused at the job's concurrency limit."""


@dataclass(frozen=True)
class ConcurrencyConfig:
    """Gate settings."""

    journal_interval_seconds: float = 60.0
    """At most one ``concurrency_wait`` journal entry per job per interval (per gate)."""
    batch_scan_factor: int = 4
    """A batch claim of ``limit`` tasks looks at up to ``limit * factor`` of the
    oldest queued tasks, so tasks of jobs at their limit do not starve the rest."""

    def __post_init__(self) -> None:
        if self.journal_interval_seconds < 0:
            raise ConfigurationError("ConcurrencyConfig.journal_interval_seconds must be >= 0")
        if self.batch_scan_factor < 1:
            raise ConfigurationError("ConcurrencyConfig.batch_scan_factor must be >= 1")


@dataclass(frozen=True)
class JobLimits:
    """The claim-time settings of one job."""

    max_concurrency: int | None = None
    """``scaling.max_concurrency``; ``None`` = unlimited."""
    lease_seconds: float | None = None
    """The job's heartbeat timeout as the lease length; ``None`` = the queue default."""

    @classmethod
    def from_row(cls, job_id: uuid.UUID, scaling: Any, heartbeat_timeout: int | None) -> JobLimits:
        """Read ``jobs.scaling`` and ``jobs.heartbeat_timeout_seconds``."""
        limit = scaling.get("max_concurrency") if isinstance(scaling, Mapping) else None
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
            raise ConfigurationError(
                f"job {job_id}: scaling.max_concurrency must be an integer, got {limit!r}"
            )
        if limit is not None and limit < 1:
            raise ConfigurationError(
                f"job {job_id}: scaling.max_concurrency must be >= 1, got {limit}"
            )
        lease = float(heartbeat_timeout) if heartbeat_timeout else None
        return cls(limit, lease)


async def count_running(
    tx: Transaction, job_ids: Collection[uuid.UUID] | None = None
) -> dict[uuid.UUID, int]:
    """``Running`` tasks per job (of ``job_ids``, or of every job), one grouped query."""
    return await tx.concurrency.running_by_job(job_ids)


async def count_in_flight_by_operator(tx: Transaction) -> dict[str, int]:
    """``Running`` tasks per operator (scaling control), one grouped query."""
    return await tx.concurrency.running_by_operator()


class ConcurrencyGate:
    """Claims tasks without exceeding any job's ``scaling.max_concurrency``."""

    def __init__(self, tasks: TaskQueue, *, config: ConcurrencyConfig | None = None) -> None:
        self.tasks = tasks
        self.repo: Repository = tasks.repo
        self.clock = tasks.clock
        self.config = config or ConcurrencyConfig()
        self._limits: dict[uuid.UUID, JobLimits] = {}
        self._task_jobs: BoundedMemo[uuid.UUID, uuid.UUID] = BoundedMemo(_TASK_JOBS)
        self._journaled: dict[uuid.UUID, datetime] = {}

    async def job_limits(self, job_ids: Iterable[uuid.UUID]) -> dict[uuid.UUID, JobLimits]:
        """The limits of ``job_ids`` (cached; read once per job)."""
        ids = set(job_ids)
        if ids - self._limits.keys():
            async with self.repo.read() as tx:
                await self._load_limits(tx, ids)
        return {job_id: self._limits[job_id] for job_id in ids if job_id in self._limits}

    async def _load_limits(self, tx: Transaction, job_ids: Iterable[uuid.UUID]) -> None:
        missing = [job_id for job_id in set(job_ids) if job_id not in self._limits]
        if not missing:
            return
        for job_id, row in (await tx.concurrency.claim_settings(missing)).items():
            self._limits[job_id] = JobLimits.from_row(
                job_id, row.scaling, row.heartbeat_timeout_seconds
            )

    async def claim(
        self,
        task_id: uuid.UUID,
        worker_id: str,
        *,
        job_id: uuid.UUID | None = None,
        limits: JobLimits | None = None,
    ) -> ClaimOutcome:
        """Claim one task by id (wake-up driven), or say why not.

        ``CONCURRENCY_LIMIT`` only for a claimable (``Queued``) task of a job
        at its limit; any other refusal is the plain claim's. ``job_id`` (with
        the job's ``limits``, as read from its row) is the task's job when the
        caller read it already: a job without a limit then needs no transaction.
        """
        if job_id is not None:
            self._task_jobs.put(task_id, job_id)
            if limits is not None:
                self._limits.setdefault(job_id, limits)
            known = self._limits.get(job_id)
            if known is not None and known.max_concurrency is None:
                return await self.tasks.leases.claim(
                    task_id, worker_id, lease_seconds=known.lease_seconds
                )
        async with self.repo.transaction() as tx:
            if job_id is None:
                job_id = await tx.concurrency.job_of_task(task_id)
                if job_id is None:
                    return ClaimOutcome(None, NotClaimedReason.NOT_FOUND)
                self._task_jobs.put(task_id, job_id)
            await self._load_limits(tx, [job_id])
            limits = self._limits[job_id]
            if limits.max_concurrency is not None:
                await self._lock_jobs(tx, [job_id])
                running = (await count_running(tx, [job_id])).get(job_id, 0)
                if running >= limits.max_concurrency:
                    state = await tx.inspect(TASKS, task_id)
                    if state is None or state.status != TASKS.ready:
                        return ClaimOutcome(None, self.tasks.leases.refusal_reason(state))
                    await self._journal_wait(tx, job_id, running, limits.max_concurrency)
                    return ClaimOutcome(None, NotClaimedReason.CONCURRENCY_LIMIT)
            return await self.tasks.leases.claim(
                task_id, worker_id, tx=tx, lease_seconds=limits.lease_seconds
            )

    async def wake_waiting(self, task_id: uuid.UUID) -> list[uuid.UUID]:
        """After ``task_id`` finished (completed or failed), wake the oldest
        queued tasks of its job for the slots now free; the woken ids.

        Wake-up driven claims refused at the limit are acknowledged and
        dropped, so a freed slot must bring the waiting tasks back: this is
        the wake-up that was promised to them. Jobs without a limit need none.
        """
        job_id = self._task_jobs.get(task_id)
        if job_id is None:
            async with self.repo.read() as tx:
                job_id = await tx.concurrency.job_of_task(task_id)
            if job_id is None:
                return []
            self._task_jobs.put(task_id, job_id)
        limit = (await self.job_limits([job_id])).get(job_id)
        if limit is None or limit.max_concurrency is None:
            return []
        async with self.repo.transaction() as tx:
            running = (await count_running(tx, [job_id])).get(job_id, 0)
            free = limit.max_concurrency - running
            if free <= 0:
                return []
            ids = await tx.concurrency.oldest_queued_of_job(job_id, limit=free)
            await tx.wake_tasks(ids, self.tasks.wakeup, now=self.clock.now())
        return ids

    async def claim_batch(self, worker_id: str, limit: int) -> list[Lease]:
        """Claim up to ``limit`` queued tasks, oldest first (claim order), poll driven.

        Never takes a job past its limit; tasks of jobs at their limit are
        skipped, not waited for.
        """
        max_batch = self.tasks.leases.config.max_batch
        if not 1 <= limit <= max_batch:
            raise ConfigurationError(f"claim limit must be within 1..{max_batch}, got {limit}")
        async with self.repo.transaction() as tx:
            running = await count_running(tx)
            await self._load_limits(tx, running)
            full = [
                job_id
                for job_id, n in running.items()
                if (cap := self._limits[job_id].max_concurrency) is not None and n >= cap
            ]
            candidates = await tx.concurrency.oldest_queued_except_jobs(
                full, limit=limit * self.config.batch_scan_factor
            )
            await self._load_limits(tx, {job_id for _, job_id in candidates})
            limited = {
                job_id
                for _, job_id in candidates
                if self._limits[job_id].max_concurrency is not None
            }
            if limited:
                await self._lock_jobs(tx, limited)
                running.update(await count_running(tx, limited))  # counted under the locks
            capacity = {
                job_id: (self._limits[job_id].max_concurrency or 0) - running.get(job_id, 0)
                for job_id in limited
            }
            if candidates:
                # Take the candidates we may claim so concurrent pollers skip
                # them instead of queueing behind our claims.
                locked = await tx.concurrency.lock_claim_candidates(
                    [task_id for task_id, _ in candidates]
                )
                candidates = [c for c in candidates if c[0] in locked]
            leases: list[Lease] = []
            for task_id, job_id in candidates:
                if len(leases) >= limit:
                    break
                if job_id in capacity and capacity[job_id] <= 0:
                    continue
                outcome = await self.tasks.leases.claim(
                    task_id, worker_id, tx=tx, lease_seconds=self._limits[job_id].lease_seconds
                )
                if outcome.lease is not None:
                    leases.append(outcome.lease)
                    if job_id in capacity:
                        capacity[job_id] -= 1
            return leases

    async def in_flight_by_operator(self) -> dict[str, int]:
        """``Running`` tasks per operator."""
        async with self.repo.read() as tx:
            return await count_in_flight_by_operator(tx)

    async def _lock_jobs(self, tx: Transaction, job_ids: Iterable[uuid.UUID]) -> None:
        """Serialize claims of these jobs until ``tx`` ends (Postgres; SQLite already is)."""
        now = self.clock.now()
        # One row at a time, in lock order, its creation included: a row this
        # transaction inserts is held like a locked one, so creating every
        # missing row first and locking afterwards could take them out of order.
        for job_id in by_job_id(job_ids):
            await tx.job_states.lock_for_claims(job_id, now=now)

    async def _journal_wait(
        self, tx: Transaction, job_id: uuid.UUID, running: int, limit: int
    ) -> None:
        now = self.clock.now()
        last = self._journaled.get(job_id)
        if last is not None and now - last < timedelta(
            seconds=self.config.journal_interval_seconds
        ):
            return
        self._journaled[job_id] = now
        await tx.journal.append(
            job_id,
            CONCURRENCY_WAIT,
            f"claim refused: {running} tasks running, max_concurrency {limit}",
            now=now,
            detail={"running": running, "max_concurrency": limit},
        )
