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

They reach the database through the sources area of the port
(``tx.sources``, :mod:`trace_core.storage.ports.sources`).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from trace_core.dag import live_jobs
from trace_core.storage.ports.sources import SourceRun, SourceState, SourceStatus
from trace_core.storage.protocol import NewTask, TaskCreated, Transaction
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


async def live_source_jobs(tx: Transaction) -> list[SourceJob]:
    """The live source jobs (:func:`trace_core.dag.live_jobs`) with their bootstrap."""
    live = [j for j in await live_jobs(tx) if j.activation == "source"]
    if not live:
        return []
    bootstrap = await tx.sources.job_bootstraps([j.job_id for j in live])
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
    tx: Transaction,
    tasks: TaskQueue,
    job: SourceJob,
    dedupe_key: str,
    *,
    now: datetime,
    inputs: Mapping[str, Any] | None = None,
    max_attempts: int | None = None,
    handicap_seconds: float = 0.0,
) -> TaskCreated:
    """Create (once per ``dedupe_key``) a task of a source job, in ``tx``.

    Applies ``bootstrap.reset_outputs`` to the job's first task: the flag in
    its ``input_versions`` and the deletion of the job's ``operator_state``.
    """
    # Lock the job's state row first, so two creators cannot both see "no
    # task yet" and both reset (Postgres; SQLite serializes writers anyway).
    await tx.job_states.update_if_matches(job.job_id, {}, now=now)
    input_versions = dict(inputs or {})
    bootstrap = job.reset_outputs and not await tx.sources.job_has_tasks(job.job_id)
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
        tx=tx,
    )
    if created.created and bootstrap:
        deleted = await tx.sources.clear_operator_state(job.org_id, job.job_id)
        await tx.journal.append(
            job.job_id,
            "bootstrap_reset",
            f"first task {created.task_id} resets the outputs; "
            f"{deleted} operator_state row(s) cleared",
            now=now,
            detail={"task_id": str(created.task_id), "operator_state_deleted": deleted},
        )
    return created


# --- the always-on run as stored ----------------------------------------------


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
    tx: Transaction, job_ids: list[uuid.UUID]
) -> dict[uuid.UUID, SourceState]:
    """The :class:`SourceState` of those of ``job_ids`` that have a ``job_states`` row."""
    return await tx.sources.source_states(job_ids)


async def retired_sources(
    tx: Transaction, live: set[uuid.UUID]
) -> list[tuple[uuid.UUID, str, uuid.UUID | None]]:
    """``(job, status, run)`` of jobs that are not live but whose source is not stopped."""
    return [row for row in await tx.sources.active_sources() if row[0] not in live]
