"""The sources area of the repository port: source runs, cron schedules, and
the per-job decisions the source services record.

Reached as ``tx.sources`` on any :class:`~trace_core.storage.protocol.Transaction`.
The source supervisor, the cron scheduler, the manual trigger and the
backfiller decide what to do (:mod:`trace_core.dispatcher.sources` and
siblings); this area reads and writes the ``job_states`` source and cron
columns and the job's first-task bootstrap.

Every ``job_states`` write creates the job's row first when it is missing and
sets ``updated_at``; it also locks the row until commit (Postgres; SQLite
serializes writers), so services deciding about the same job take turns.
A write guarded by a compare-and-set says so in its name and returns whether
it matched.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, Protocol

__all__ = ["CronState", "SourceOps", "SourceRun", "SourceState", "SourceStatus"]


class SourceStatus(StrEnum):
    """``job_states.source_status`` (Source Job Lifecycle)."""

    PENDING = "Pending"
    RUNNING = "Running"
    DEAD = "Dead"
    DRAINING = "Draining"
    STOPPED = "Stopped"


@dataclass(frozen=True)
class SourceRun:
    """The task row of a job's always-on run (``job_states.source_task_id``)."""

    task_id: uuid.UUID
    status: str
    attempt: int
    claim_version: int
    next_retry_at: datetime | None
    error: str | None

    @property
    def deaths(self) -> int:
        """Attempts of this run that died (failed), from the task row alone."""
        if self.status == "Failed" or (self.status == "Queued" and self.claim_version > 0):
            return self.attempt
        return self.attempt - 1


@dataclass(frozen=True)
class SourceState:
    """A job's ``job_states`` source columns, with its run's task row."""

    status: str | None
    task_id: uuid.UUID | None
    restarts: int
    paused: bool
    run: SourceRun | None
    """``None`` when the job has no run, or its task row is gone."""


@dataclass(frozen=True)
class CronState:
    """A job's cron columns of ``job_states``."""

    next_fire_at: datetime | None
    source_status: str | None


class SourceOps(Protocol):
    """Source runs and cron schedules, inside one transaction."""

    # --- source jobs and their first task -------------------------------------

    async def job_bootstraps(
        self, job_ids: Collection[uuid.UUID]
    ) -> dict[uuid.UUID, Mapping[str, Any]]:
        """The ``bootstrap`` settings of each existing job among ``job_ids``
        (``{}`` for a job without any). Empty for empty ``job_ids``."""
        ...

    async def job_has_tasks(self, job_id: uuid.UUID) -> bool:
        """Whether the job has any task with a dedupe key (every task of a
        source job has one), in any status."""
        ...

    async def clear_operator_state(self, org_id: uuid.UUID, job_id: uuid.UUID) -> int:
        """Delete the job's ``operator_state`` rows in ``org_id``; how many.
        Other jobs' and other orgs' rows are left alone."""
        ...

    # --- the always-on run ------------------------------------------------------

    async def source_states(self, job_ids: Collection[uuid.UUID]) -> dict[uuid.UUID, SourceState]:
        """The :class:`SourceState` of each of ``job_ids`` that has a
        ``job_states`` row (others are absent). Empty for empty ``job_ids``."""
        ...

    async def active_sources(self) -> list[tuple[uuid.UUID, str, uuid.UUID | None]]:
        """``(job_id, source_status, source_task_id)`` of every job whose
        source status is set and is not ``Stopped``, in no particular order."""
        ...

    async def start_run_if_previous(
        self,
        job_id: uuid.UUID,
        *,
        previous: uuid.UUID | None,
        task_id: uuid.UUID,
        now: datetime,
    ) -> bool:
        """Make ``task_id`` the job's run, ``Pending`` with no restarts, if
        its run is still ``previous`` (``None``: no run yet). False, changing
        nothing, when another run was set since."""
        ...

    async def set_run_status_if_current(
        self,
        job_id: uuid.UUID,
        *,
        task_id: uuid.UUID,
        expected: str | None,
        status: str,
        restarts: int,
        now: datetime,
    ) -> bool:
        """Set the source ``status`` and ``restarts`` of the job's run if its
        run is still ``task_id`` and its status still ``expected`` (``None``
        matches no status). False, changing nothing, otherwise."""
        ...

    async def set_source_status_if_status(
        self, job_id: uuid.UUID, *, expected: str | None, status: str, now: datetime
    ) -> bool:
        """Set the job's source ``status`` if it is still ``expected`` (``None``
        matches no status); the run is left as it is. False, changing nothing,
        otherwise."""
        ...

    async def running_sources(self) -> list[uuid.UUID]:
        """Jobs whose source status is ``Running`` and whose run's task is
        ``Running``, in no particular order."""
        ...

    async def drain_run_if_running(self, job_id: uuid.UUID, *, now: datetime) -> uuid.UUID | None:
        """Set the job's source status from ``Running`` to ``Draining`` if its
        run's task is still ``Running``; the run's task id, or ``None`` (nothing
        changed) when either no longer holds. Creates no row."""
        ...

    async def run_directive_state(self, task_id: uuid.UUID) -> tuple[str | None, bool] | None:
        """``(source_status, paused)`` of the job whose run is ``task_id``;
        ``None`` when no job's run is that task."""
        ...

    # --- cron schedules -------------------------------------------------------------

    async def cron_states(self, job_ids: Collection[uuid.UUID]) -> dict[uuid.UUID, CronState]:
        """The :class:`CronState` of each of ``job_ids`` that has a
        ``job_states`` row, and of every other job with a ``next_fire_at``."""
        ...

    async def schedule_cron_if_unscheduled(
        self, job_id: uuid.UUID, *, first: datetime, now: datetime
    ) -> bool:
        """Set the job's ``next_fire_at`` to ``first`` if it has none. False,
        changing nothing, when it has one."""
        ...

    async def advance_cron_if_next_fire(
        self, job_id: uuid.UUID, *, expected: datetime, next_fire_at: datetime, now: datetime
    ) -> bool:
        """Move the job's ``next_fire_at`` from ``expected`` to
        ``next_fire_at``: exactly one caller wins a fire time. False, changing
        nothing, when it is no longer ``expected``."""
        ...

    async def record_cron_fire(
        self, job_id: uuid.UUID, *, fired_at: datetime, now: datetime
    ) -> None:
        """Set the job's ``last_fired_at`` to ``fired_at`` (unconditionally)."""
        ...

    async def clear_cron_if_next_fire(
        self, job_id: uuid.UUID, *, expected: datetime, now: datetime
    ) -> bool:
        """Clear the job's ``next_fire_at`` if it is still ``expected``. False,
        changing nothing, otherwise."""
        ...
