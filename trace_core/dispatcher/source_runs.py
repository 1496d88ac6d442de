"""Source runs: the tasks of source jobs, and what every source kind shares.

The source supervisor (``always_on``), cron and the manual trigger all work
on the same things, defined here so none of them imports another:

- :func:`live_source_jobs`: the live ``activation: source`` jobs
  (:class:`SourceJob`);
- :func:`create_source_task`: a task of a source job, once per dedupe key,
  with the **bootstrap.reset_outputs** rule: the first task a source job ever
  gets carries ``input_versions = {"bootstrap": {"reset_outputs": true}}``
  and, in the same transaction, the job's ``operator_state`` rows are deleted
  (once: a later task finds earlier ones);
- :class:`SourceStatus`: ``job_states.source_status``;
- the always-on run as stored: its dedupe key (:func:`source_run_key`), and
  its ``job_states`` row joined with its task row (:func:`read_source_states`,
  :func:`derive_status`, :func:`retired_sources`).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from trace_core.dag import live_jobs
from trace_core.dispatcher.job_states import upsert_job_state
from trace_core.dispatcher.journal import record
from trace_core.storage import schema
from trace_core.storage.protocol import NewTask, TaskCreated
from trace_core.storage.sql import SqlTransaction
from trace_core.tasks import TaskQueue

__all__ = [
    "SourceJob",
    "SourceRun",
    "SourceState",
    "SourceStatus",
    "create_source_task",
    "derive_status",
    "live_source_jobs",
    "read_source_states",
    "retired_sources",
    "source_run_key",
]


class SourceStatus(StrEnum):
    """``job_states.source_status`` (Source Job Lifecycle)."""

    PENDING = "Pending"
    RUNNING = "Running"
    DEAD = "Dead"
    DRAINING = "Draining"
    STOPPED = "Stopped"


# --- the live source jobs ----------------------------------------------------


@dataclass(frozen=True)
class SourceJob:
    """A live ``activation: source`` job, as the source services need it."""

    job_id: uuid.UUID
    org_id: uuid.UUID
    job_name: str
    dag_name: str
    role: str
    """``current`` or ``building`` (a version catching up on new dataset versions)."""
    kind: str
    """``always_on`` | ``cron`` | ``manual``."""
    schedule: str | None
    timezone: str
    reset_outputs: bool
    max_attempts: int
    priority_tier: str


async def live_source_jobs(st: SqlTransaction) -> list[SourceJob]:
    """The live source jobs (:func:`trace_core.dag.live_jobs`) with their bootstrap."""
    live = [j for j in await live_jobs(st) if j.activation == "source"]
    if not live:
        return []
    jobs = schema.jobs
    rows = await st.connection.execute(
        sa.select(jobs.c.id, jobs.c.bootstrap).where(jobs.c.id.in_([j.job_id for j in live]))
    )
    bootstrap = {r[0]: r[1] or {} for r in rows}
    out = []
    for job in live:
        source = dict(job.source or {})
        out.append(
            SourceJob(
                job_id=job.job_id,
                org_id=job.org_id,
                job_name=job.job_name,
                dag_name=job.dag_name,
                role=job.role,
                kind=str(source.get("kind") or "manual"),
                schedule=source.get("schedule"),
                timezone=str(source.get("timezone") or "UTC"),
                reset_outputs=bool(bootstrap.get(job.job_id, {}).get("reset_outputs")),
                max_attempts=job.max_attempts,
                priority_tier=job.priority_tier,
            )
        )
    return out


# --- creating source tasks ---------------------------------------------------


def source_run_key(job_id: uuid.UUID, previous_run: uuid.UUID | None = None) -> str:
    """The dedupe key of an always-on run (the first, or the one after ``previous_run``)."""
    if previous_run is None:
        return f"source-run:{job_id}"
    return f"source-run:{job_id}:after:{previous_run}"


async def create_source_task(
    st: SqlTransaction,
    tasks: TaskQueue,
    job: SourceJob,
    dedupe_key: str,
    *,
    now: datetime,
    inputs: Mapping[str, Any] | None = None,
    max_attempts: int | None = None,
    handicap_seconds: float = 0.0,
) -> TaskCreated:
    """Create (once per ``dedupe_key``) a task of a source job, in ``st``.

    Applies ``bootstrap.reset_outputs`` to the job's first task: the flag in
    its ``input_versions`` and the deletion of the job's ``operator_state``.
    """
    conn = st.connection
    # Lock the job's state row first, so two creators cannot both see "no
    # task yet" and both reset (Postgres; SQLite serializes writers anyway).
    await upsert_job_state(st, job.job_id, {}, now=now)
    input_versions = dict(inputs or {})
    bootstrap = job.reset_outputs and not await _has_tasks(conn, job.job_id)
    if bootstrap:
        input_versions["bootstrap"] = {"reset_outputs": True}
    [created] = await tasks.create(
        [
            NewTask(
                job.job_id,
                dedupe_key=dedupe_key,
                input_versions=input_versions or None,
                max_attempts=max_attempts or job.max_attempts,
                handicap_seconds=handicap_seconds,
            )
        ],
        tx=st,
    )
    if created.created and bootstrap:
        o = schema.operator_state
        deleted = await conn.execute(
            sa.delete(o).where(o.c.org_id == job.org_id, o.c.job_id == job.job_id)
        )
        await record(
            st,
            job.job_id,
            "bootstrap_reset",
            f"first task {created.task_id} resets the outputs; "
            f"{deleted.rowcount} operator_state row(s) cleared",
            now=now,
            detail={"task_id": str(created.task_id), "operator_state_deleted": deleted.rowcount},
        )
    return created


async def _has_tasks(conn: AsyncConnection, job_id: uuid.UUID) -> bool:
    t = schema.tasks
    # Every task of a source job has a dedupe key; saying so lets the lookup
    # use the (job_id, dedupe_key) partial index instead of scanning tasks.
    stmt = sa.select(t.c.id).where(t.c.job_id == job_id, t.c.dedupe_key.is_not(None)).limit(1)
    return (await conn.execute(stmt)).first() is not None


# --- the always-on run as stored ----------------------------------------------


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


def derive_status(run: SourceRun, draining: bool) -> SourceStatus:
    """The source status a run's task row implies."""
    if run.status == "Queued":
        return SourceStatus.PENDING
    if run.status == "Running":
        # A supervisor that is not draining lifts a drain left over from a
        # previous Dispatcher: the run keeps going under the same run id.
        return SourceStatus.DRAINING if draining else SourceStatus.RUNNING
    if run.status == "Failed":
        return SourceStatus.DEAD
    return SourceStatus.STOPPED  # Completed or Canceled


async def read_source_states(
    conn: AsyncConnection, job_ids: list[uuid.UUID]
) -> dict[uuid.UUID, SourceState]:
    """The :class:`SourceState` of those of ``job_ids`` that have a ``job_states`` row."""
    if not job_ids:
        return {}
    s, t = schema.job_states, schema.tasks
    rows = await conn.execute(
        sa.select(
            s.c.job_id,
            s.c.source_status,
            s.c.source_task_id,
            s.c.source_restarts,
            s.c.paused,
            t.c.status,
            t.c.attempt,
            t.c.claim_version,
            t.c.next_retry_at,
            t.c.error_message,
        )
        .select_from(s.outerjoin(t, t.c.id == s.c.source_task_id))
        .where(s.c.job_id.in_(job_ids))
    )
    out = {}
    for r in rows:
        run = SourceRun(r[2], r[5], r[6], r[7], r[8], r[9]) if r[5] is not None else None
        out[r[0]] = SourceState(r[1], r[2], r[3], bool(r[4]), run)
    return out


async def retired_sources(
    conn: AsyncConnection, live: set[uuid.UUID]
) -> list[tuple[uuid.UUID, str, uuid.UUID | None]]:
    """``(job, status, run)`` of jobs that are not live but whose source is not stopped."""
    s = schema.job_states
    active = [str(x) for x in SourceStatus if x != SourceStatus.STOPPED]
    rows = await conn.execute(
        sa.select(s.c.job_id, s.c.source_status, s.c.source_task_id).where(
            s.c.source_status.in_(active)
        )
    )
    return [(r[0], r[1], r[2]) for r in rows if r[0] not in live]
