"""The concurrency area of the repository port: what each job has queued and
running, and the reads of the concurrency gate's claims.

Reached as ``tx.concurrency`` on any :class:`~trace_core.storage.protocol.Transaction`.
Backpressure (queue depth and age), the concurrency gate (running tasks,
claim candidates, the jobs' claim settings) and the idle scaler (active
tasks) measure the task table here. Every method runs inside that
transaction and sees its earlier writes; nothing commits by itself. The
claims themselves are the ownership protocol's (``tx.claim``).
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

__all__ = ["ConcurrencyOps", "JobClaimSettings", "QueuedTasks"]


@dataclass(frozen=True)
class QueuedTasks:
    """A job's ``Queued`` tasks: how many, and when the oldest was created."""

    depth: int
    oldest_created_at: datetime | None


@dataclass(frozen=True)
class JobClaimSettings:
    """The columns of a job that decide how its tasks are claimed, as stored."""

    scaling: Any
    """``jobs.scaling`` (JSON; ``max_concurrency`` is the limit)."""
    heartbeat_timeout_seconds: int | None


class ConcurrencyOps(Protocol):
    """Task counts per job and the concurrency gate's reads, inside one transaction."""

    async def running_by_job(
        self, job_ids: Collection[uuid.UUID] | None = None
    ) -> dict[uuid.UUID, int]:
        """``Running`` tasks per job, of ``job_ids`` or (``None``) of every job,
        in one grouped query. Jobs without one are absent; an empty
        ``job_ids`` is an empty answer."""
        ...

    async def running_by_operator(self) -> dict[str, int]:
        """``Running`` tasks per operator of their job, in one grouped query;
        operators without one are absent."""
        ...

    async def queued_by_job(self) -> dict[uuid.UUID, QueuedTasks]:
        """Every job's ``Queued`` tasks, in one grouped query; jobs without one
        are absent."""
        ...

    async def active_by_job(self, job_ids: Collection[uuid.UUID]) -> dict[uuid.UUID, int]:
        """``Queued`` plus ``Running`` tasks per job of ``job_ids`` (a task
        waiting for a retry is not counted), in one grouped query; jobs without
        one are absent, and an empty ``job_ids`` is an empty answer."""
        ...

    async def claim_settings(
        self, job_ids: Collection[uuid.UUID]
    ) -> dict[uuid.UUID, JobClaimSettings]:
        """The claim settings of each of ``job_ids`` that exists (others are
        absent); empty for an empty ``job_ids``."""
        ...

    async def job_of_task(self, task_id: uuid.UUID) -> uuid.UUID | None:
        """The job of the task; ``None`` if there is no such task."""
        ...

    async def oldest_queued_of_job(self, job_id: uuid.UUID, *, limit: int) -> list[uuid.UUID]:
        """Up to ``limit`` ``Queued`` tasks of the job, in claim order
        (``queued_at``, then id); empty when ``limit`` < 1."""
        ...

    async def oldest_queued_except_jobs(
        self, excluded: Collection[uuid.UUID], *, limit: int
    ) -> list[tuple[uuid.UUID, uuid.UUID]]:
        """Up to ``limit`` ``(task id, job id)`` of ``Queued`` tasks whose job is
        not in ``excluded``, in claim order (``queued_at``, then id)."""
        ...

    async def lock_claim_candidates(self, task_ids: Collection[uuid.UUID]) -> set[uuid.UUID]:
        """The tasks of ``task_ids`` this transaction may claim without waiting
        for another claimer. On Postgres: those still ``Queued`` that no other
        transaction holds, locked until this one ends (``SKIP LOCKED``: it never
        waits, and concurrent claimers skip them). On SQLite, whose write
        transaction already excludes every other claimer: all of them, without
        a statement. Empty for an empty ``task_ids``."""
        ...
