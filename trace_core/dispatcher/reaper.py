"""The reaper: attempts that stopped heartbeating or ran too long become ``Failed``.

Two rules, both ending in the core's retry policy (backoff while the task's
attempts remain, terminal ``Failed`` when they are exhausted):

- **Lease expiry.** A ``Running`` task whose lease ran out is failed with
  ``"lease expired: no heartbeat within N s"``. The lease length is the job's
  ``heartbeat_timeout_seconds``: the claim and heartbeat of a task of that job
  pass :func:`lease_seconds_for` as ``lease_seconds`` (``None`` = the queue's
  default), so expiry needs no per-job logic here.
- **Attempt timeout.** A ``Running`` attempt whose ``started_at`` is older than
  its job's ``timeout_seconds`` is failed through the fenced
  :meth:`~trace_core.tasks.TaskQueue.fail`, however well it heartbeats. If the
  worker finished (or the attempt was reclaimed or canceled) between the scan
  and the write, the fenced write refuses and the attempt is left alone.

Every terminal failure is journaled for ``explain``.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from trace_core.clock import Clock
from trace_core.dispatcher.periodic import DispatcherService, require_positive
from trace_core.errors import ConfigurationError, InvalidTransition, StaleClaim
from trace_core.leasing import FailOutcome, ReclaimHooks
from trace_core.model import Fence
from trace_core.storage.protocol import Repository, Transaction
from trace_core.tasks import TaskQueue

__all__ = [
    "ReapReport",
    "Reaper",
    "ReaperConfig",
    "lease_seconds_for",
    "lease_seconds_for_task",
]


@dataclass(frozen=True)
class ReaperConfig:
    """Reaper settings."""

    interval_seconds: float = 5.0
    """Time between passes; an expired lease waits at most this long past expiry."""
    batch_size: int = 500
    """Upper bound on the expired leases, and on the timed-out attempts, per pass."""

    def __post_init__(self) -> None:
        require_positive("ReaperConfig.interval_seconds", self.interval_seconds)
        if not 1 <= self.batch_size <= 10_000:
            raise ConfigurationError("ReaperConfig.batch_size must be within 1..10000")


@dataclass
class ReapReport:
    """What one reaper pass did."""

    expired: int = 0
    """Attempts failed because their lease expired."""
    timed_out: int = 0
    """Attempts failed because they ran longer than their job's timeout."""
    retried: int = 0
    """Of those, how many have a retry scheduled."""
    dead_lettered: list[uuid.UUID] = field(default_factory=list)
    """Tasks failed terminally (attempts exhausted)."""
    raced: int = 0
    """Timed-out attempts that finished or heartbeated meanwhile (left alone)."""


class _HeartbeatTimeout(Protocol):
    @property
    def heartbeat_timeout_seconds(self) -> int | None: ...


def lease_seconds_for(job: _HeartbeatTimeout) -> float | None:
    """The lease length of tasks of ``job``: its ``heartbeat_timeout_seconds``.

    The claim path passes this as ``lease_seconds`` to
    :meth:`~trace_core.leasing.LeaseQueue.claim` / ``claim_batch`` and to every
    :meth:`~trace_core.leasing.LeaseQueue.heartbeat` of a task of that job;
    ``None`` means the queue's default lease.
    """
    value = job.heartbeat_timeout_seconds
    return float(value) if value else None


async def lease_seconds_for_task(tx: Transaction, task_id: uuid.UUID) -> float | None:
    """:func:`lease_seconds_for` the job of ``task_id`` (for a heartbeat that
    knows only the task); ``None`` also when the task does not exist."""
    value = await tx.reaper.heartbeat_timeout_of_task(task_id)
    return float(value) if value else None


def _seconds(value: float) -> str:
    return f"{value:g}"


class Reaper(DispatcherService):
    """Fails expired leases and timed-out attempts; see the module docstring."""

    def __init__(
        self,
        repo: Repository,
        *,
        clock: Clock | None = None,
        config: ReaperConfig | None = None,
        tasks: TaskQueue | None = None,
    ) -> None:
        self.config = config or ReaperConfig()
        super().__init__(repo, self.config.interval_seconds, clock=clock, tasks=tasks)
        """Its lease config (the default lease) and retry policy are the ones used."""

    async def run_once(self) -> ReapReport:
        """Fail expired leases, then timed-out attempts; what was done."""
        report = ReapReport()
        await self._reap_expired(report)
        await self._reap_timed_out(report)
        return report

    async def reclaim_held_by(self, worker_prefix: str, reason: str) -> ReapReport:
        """Fail at once the running attempts whose worker id starts with
        ``worker_prefix``, a holder known to be gone (see
        :meth:`~trace_core.leasing.LeaseQueue.reclaim_held_by`), with ``reason``
        as their error; terminal failures are journaled like expired ones."""
        report = ReapReport()
        now = self.clock.now()
        jobs: dict[Any, uuid.UUID] = {}

        async def reasons(t: Transaction, fences: Sequence[Fence]) -> dict[Any, str]:
            for item_id, (job_id, _) in (await _lease_info(t, [f.item_id for f in fences])).items():
                jobs[item_id] = job_id
            return {}

        async def failed(t: Transaction, fence: Fence, outcome: FailOutcome, error: str) -> None:
            if not outcome.retrying:
                await _journal_dead(t, jobs[fence.item_id], fence, error, now)

        reclaimed = await self.tasks.leases.reclaim_held_by(
            worker_prefix,
            reason=reason,
            limit=self.config.batch_size,
            hooks=ReclaimHooks(reasons, failed),
        )
        report.expired += len(reclaimed.retried) + len(reclaimed.dead_lettered)
        report.retried += len(reclaimed.retried)
        report.dead_lettered.extend(uuid.UUID(str(i)) for i in reclaimed.dead_lettered)
        return report

    async def _reap_expired(self, report: ReapReport) -> None:
        # The queue's own reclaim, with the reason worded from the lease each
        # attempt held and terminal failures journaled in its transaction.
        now = self.clock.now()
        jobs: dict[Any, uuid.UUID] = {}

        async def reasons(t: Transaction, fences: Sequence[Fence]) -> dict[Any, str]:
            info = await _lease_info(t, [f.item_id for f in fences])
            default = self.tasks.leases.config.lease_seconds
            worded = {}
            for item_id, (job_id, lease) in info.items():
                jobs[item_id] = job_id
                held = default if lease is None else lease
                worded[item_id] = f"lease expired: no heartbeat within {_seconds(held)} s"
            return worded

        async def failed(t: Transaction, fence: Fence, outcome: FailOutcome, reason: str) -> None:
            if not outcome.retrying:
                await _journal_dead(t, jobs[fence.item_id], fence, reason, now)

        reclaimed = await self.tasks.leases.reclaim_expired(
            limit=self.config.batch_size, hooks=ReclaimHooks(reasons, failed)
        )
        report.expired += len(reclaimed.retried) + len(reclaimed.dead_lettered)
        report.retried += len(reclaimed.retried)
        report.dead_lettered.extend(uuid.UUID(str(i)) for i in reclaimed.dead_lettered)

    async def _reap_timed_out(self, report: ReapReport) -> None:
        now = self.clock.now()
        async with self.repo.read() as t:
            rows = await _timed_out(t, now, self.config.batch_size)
        for task_id, attempt, token, job_id, timeout in rows:
            fence = Fence(task_id, attempt, token, None)
            reason = f"timeout: attempt ran longer than {timeout} s"
            try:
                async with self.repo.transaction() as t:
                    outcome = await self.tasks.fail(fence, reason, tx=t, timed_out=True)
                    if not outcome.retrying:
                        await _journal_dead(t, job_id, fence, reason, now)
            except (StaleClaim, InvalidTransition):
                # The worker finished, or the attempt was reclaimed or canceled,
                # between the scan and this fenced write: nothing to time out.
                report.raced += 1
                continue
            report.timed_out += 1
            if outcome.retrying:
                report.retried += 1
            else:
                report.dead_lettered.append(task_id)


async def _lease_info(
    tx: Transaction, task_ids: list[Any]
) -> dict[Any, tuple[uuid.UUID, float | None]]:
    """Per task: its job and the lease it was given (expiry minus last heartbeat)."""
    info: dict[Any, tuple[uuid.UUID, float | None]] = {}
    for task_id, held in (await tx.reaper.held_leases(task_ids)).items():
        beat, expires = held.last_heartbeat, held.lease_expires_at
        # Both are written from the same clock reading at claim and heartbeat,
        # so their difference is the lease the worker actually held.
        lease = (expires - beat).total_seconds() if beat and expires else None
        info[task_id] = (held.job_id, lease)
    return info


async def _timed_out(
    tx: Transaction, now: datetime, limit: int
) -> list[tuple[uuid.UUID, int, uuid.UUID, uuid.UUID, int]]:
    """Running attempts older than their job's ``timeout_seconds``, oldest first."""
    found = await tx.reaper.timed_out_attempts(now=now, limit=limit)
    return [(a.task_id, a.attempt, a.lease_token, a.job_id, a.timeout_seconds) for a in found]


async def _journal_dead(
    tx: Transaction, job_id: uuid.UUID, fence: Fence, reason: str, now: datetime
) -> None:
    await tx.journal.append(
        job_id,
        "task_dead",
        f"task {fence.item_id} failed terminally on attempt {fence.attempt}: {reason}",
        now=now,
        detail={"task_id": str(fence.item_id), "attempt": fence.attempt, "reason": reason},
    )
