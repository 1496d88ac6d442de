"""The jobs the Dispatcher runs now: its router, source supervisor and reaper read these.

Live jobs are the jobs of every current DAG version, plus the jobs of a
building version that write a dataset version the current version does not
have (they build the new generation while readers keep the current one). A
building job whose outputs are all shared with the current version is not
live: the current version's job already produces those dataset versions.

Two queries, whatever the number of jobs: the jobs of current and building
versions, and the pointer sets of those versions.

Every transaction that changes the live set (a deploy that changed anything,
a promotion, a rollback) notifies :data:`LIVE_JOBS_CHANNEL`, so a running
Dispatcher acts on it at once, also when the change was made by another
process (``trace-lite dag deploy``) on Postgres.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from trace_core.dag.validate import INPUTS_WHERE_KEY
from trace_core.storage import schema

__all__ = ["LIVE_JOBS_CHANNEL", "LiveJob", "live_jobs"]

LIVE_JOBS_CHANNEL = "trace_live_jobs"
"""Notified on commit of every change to the live jobs (deploy, promotion, rollback)."""

Role = Literal["current", "building"]


@dataclass(frozen=True)
class LiveJob:
    """A job the Dispatcher should serve, with its version's dataset pointers."""

    job_id: uuid.UUID
    org_id: uuid.UUID
    job_name: str
    dag_name: str
    dag_version_id: uuid.UUID
    role: Role
    activation: str
    runtime: str
    operator: str
    execution_strategy: str | None
    input_datasets: tuple[uuid.UUID, ...]
    """Input dataset uuids in input order."""
    output_datasets: tuple[uuid.UUID, ...]
    """Output dataset uuids by output index."""
    input_pointers: Mapping[uuid.UUID, uuid.UUID]
    """dataset_uuid -> the dataset_version this DAG version reads."""
    output_pointers: Mapping[uuid.UUID, uuid.UUID]
    """dataset_uuid -> the dataset_version this job writes."""
    where: Mapping[uuid.UUID, str]
    """dataset_uuid -> the input's read-time filter, for filtered inputs only."""
    max_attempts: int
    priority_tier: str
    backpressure: Mapping[str, Any] | None
    scaling: Mapping[str, Any] | None
    timeout_seconds: int | None
    heartbeat_timeout_seconds: int | None
    source: Mapping[str, Any] | None = None
    idle_timeout: str | None = None
    config: Mapping[str, Any] = field(default_factory=dict)


async def live_jobs(conn: AsyncConnection) -> list[LiveJob]:
    """Every live job (see the module docstring), ordered by DAG, role, job name."""
    dv, j, p = schema.dag_versions, schema.jobs, schema.dag_version_datasets
    live = dv.c.status.in_(["current", "building"])
    ptr_rows = (
        await conn.execute(
            sa.select(
                dv.c.id,
                dv.c.org_id,
                dv.c.dag_name,
                dv.c.status,
                p.c.dataset_uuid,
                p.c.dataset_version,
            )
            .select_from(dv.outerjoin(p, p.c.dag_version_id == dv.c.id))
            .where(live)
        )
    ).all()
    by_version: dict[uuid.UUID, dict[uuid.UUID, uuid.UUID]] = {}
    current_of: dict[tuple[uuid.UUID, str], uuid.UUID] = {}
    for version_id, org_id, dag_name, status, dataset_uuid, dataset_version in ptr_rows:
        mapping = by_version.setdefault(version_id, {})
        if dataset_uuid is not None:
            mapping[dataset_uuid] = dataset_version
        if status == "current":
            current_of[(org_id, dag_name)] = version_id
    job_rows = (
        await conn.execute(
            sa.select(j, dv.c.status.label("version_status"))
            .join(dv, dv.c.id == j.c.dag_version_id)
            .where(live)
            .order_by(j.c.org_id, j.c.dag_name, dv.c.status.desc(), j.c.name)
        )
    ).mappings()
    out = []
    for row in job_rows:
        version_pointers = by_version.get(row["dag_version_id"], {})
        inputs = tuple(uuid.UUID(s) for s in row["input_datasets"] or [])
        outputs = tuple(uuid.UUID(s) for s in row["output_datasets"] or [])
        writes = {ds: version_pointers[ds] for ds in outputs if ds in version_pointers}
        role: Role = "current" if row["version_status"] == "current" else "building"
        if role == "building":
            current = current_of.get((row["org_id"], row["dag_name"]))
            current_versions = set(by_version.get(current, {}).values()) if current else set()
            if all(version in current_versions for version in writes.values()):
                continue
        config = dict(row["config"] or {})
        where = {uuid.UUID(k): str(v) for k, v in (config.get(INPUTS_WHERE_KEY) or {}).items()}
        out.append(
            LiveJob(
                job_id=row["id"],
                org_id=row["org_id"],
                job_name=row["name"],
                dag_name=row["dag_name"],
                dag_version_id=row["dag_version_id"],
                role=role,
                activation=row["activation"],
                runtime=row["runtime"],
                operator=row["operator"],
                execution_strategy=row["execution_strategy"],
                input_datasets=inputs,
                output_datasets=outputs,
                input_pointers={
                    ds: version_pointers[ds] for ds in inputs if ds in version_pointers
                },
                output_pointers=writes,
                where=where,
                max_attempts=row["max_attempts"] if row["max_attempts"] is not None else 3,
                priority_tier=row["priority_tier"],
                backpressure=row["backpressure"],
                scaling=row["scaling"],
                timeout_seconds=row["timeout_seconds"],
                heartbeat_timeout_seconds=row["heartbeat_timeout_seconds"],
                source=row["source"],
                idle_timeout=row["idle_timeout"],
                config=config,
            )
        )
    return out
