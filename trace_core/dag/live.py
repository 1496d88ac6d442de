"""The jobs the Dispatcher runs now: its router, source supervisor and reaper read these.

Live jobs are the jobs of every current DAG version, plus the jobs of a
building version that write a dataset version the current version does not
have (they build the new generation while readers keep the current one). A
building job whose outputs are all shared with the current version is not
live: the current version's job already produces those dataset versions.

Two port operations, whatever the number of jobs: the current and building
versions with their pointer sets (``tx.deploy.live_versions``), and their jobs
(``tx.deploy.live_version_jobs``).

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

from trace_core.dag.validate import INPUTS_WHERE_KEY
from trace_core.storage.protocol import Transaction

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


async def live_jobs(tx: Transaction) -> list[LiveJob]:
    """Every live job (see the module docstring), ordered by DAG, role, job name."""
    by_version: dict[uuid.UUID, Mapping[uuid.UUID, uuid.UUID]] = {}
    current_of: dict[tuple[uuid.UUID, str], uuid.UUID] = {}
    for version in await tx.deploy.live_versions():
        by_version[version.version_id] = version.pointers
        if version.status == "current":
            current_of[(version.org_id, version.dag_name)] = version.version_id
    out = []
    for live in await tx.deploy.live_version_jobs():
        job = live.job
        version_pointers = by_version.get(job.dag_version_id, {})
        inputs, outputs = job.input_datasets, job.output_datasets
        writes = {ds: version_pointers[ds] for ds in outputs if ds in version_pointers}
        role: Role = "current" if live.version_status == "current" else "building"
        if role == "building":
            current = current_of.get((job.org_id, job.dag_name))
            current_versions = set(by_version.get(current, {}).values()) if current else set()
            if all(version in current_versions for version in writes.values()):
                continue
        config = dict(job.config)
        where = {uuid.UUID(k): str(v) for k, v in (config.get(INPUTS_WHERE_KEY) or {}).items()}
        out.append(
            LiveJob(
                job_id=job.job_id,
                org_id=job.org_id,
                job_name=job.name,
                dag_name=job.dag_name,
                dag_version_id=job.dag_version_id,
                role=role,
                activation=job.activation,
                runtime=job.runtime,
                operator=job.operator,
                execution_strategy=job.execution_strategy,
                input_datasets=inputs,
                output_datasets=outputs,
                input_pointers={
                    ds: version_pointers[ds] for ds in inputs if ds in version_pointers
                },
                output_pointers=writes,
                where=where,
                max_attempts=job.max_attempts if job.max_attempts is not None else 3,
                priority_tier=job.priority_tier,
                backpressure=job.backpressure,
                scaling=job.scaling,
                timeout_seconds=job.timeout_seconds,
                heartbeat_timeout_seconds=job.heartbeat_timeout_seconds,
                source=job.source,
                idle_timeout=job.idle_timeout,
                config=config,
            )
        )
    return out
