"""The rows of a new DAG version: registry entries, dataset versions, pointers, jobs.

Called by :func:`trace_core.dag.deploy.deploy` inside its transaction, after
the file was checked against the registry. How spec fields map to ``jobs``
columns is described in :mod:`trace_core.dag.deploy`.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from trace_core.dag.hashing import (
    dataset_version_hashes,
    job_config_hashes,
    job_input_datasets,
)
from trace_core.dag.loader import DagDocument
from trace_core.dag.problems import DagValidationError, Problem, format_field
from trace_core.dag.registry import (
    ensure_dataset_version,
    registered_datasets,
    registry_problems,
)
from trace_core.dag.spec import DagSpec, JobSpec
from trace_core.dag.validate import INPUTS_WHERE_KEY
from trace_core.storage.ports import JobRecord, NewDagVersion, NewDataset
from trace_core.storage.protocol import Transaction

__all__ = ["DatasetPointer", "dag_dataset_names", "job_row", "write_version"]


@dataclass(frozen=True)
class DatasetPointer:
    """Where a DAG version points for one dataset."""

    dataset_uuid: uuid.UUID
    dataset_version: uuid.UUID
    new_version: bool
    """True if this deploy created the dataset version (it has to be built)."""


def _input_path(spec: DagSpec, dataset: str) -> tuple[str | int, ...]:
    for i, job in enumerate(spec.jobs):
        for k, edge in enumerate(job.inputs):
            if edge.from_.dataset == dataset:
                return ("jobs", i, "inputs", k, "from", "dataset")
    return ()


def dag_dataset_names(spec: DagSpec) -> set[str]:
    """Every dataset name the DAG produces or reads."""
    names = set(spec.produced())
    for job in spec.jobs:
        names.update(job_input_datasets(spec, job))
    return names


async def write_version(
    tx: Transaction,
    document: DagDocument,
    org_id: uuid.UUID,
    org_slug: str,
    version_id: uuid.UUID,
    dag_hash: str,
    storage_root: str,
    now: datetime,
) -> tuple[dict[str, uuid.UUID], dict[str, DatasetPointer]]:
    """Insert the version (``building``), its datasets' rows, pointers and jobs.

    Returns job name -> id and dataset name -> pointer (datasets it produces).
    """
    spec = document.spec
    await tx.deploy.insert_version(
        NewDagVersion(version_id, org_id, spec.dag, dag_hash, document.text, now)
    )
    uuids = await _register(tx, document, org_id, now)
    version_hashes = dataset_version_hashes(spec, dag_yaml_hash=dag_hash)
    kinds = {o.dataset: o for job in spec.jobs for o in job.outputs}
    datasets: dict[str, DatasetPointer] = {}
    for name, config_hash in version_hashes.items():
        output = kinds[name]
        version, created = await ensure_dataset_version(
            tx,
            dataset_uuid=uuids[name],
            config_hash=config_hash,
            range_start=output.range.start if output.range else None,
            range_end=output.range.end if output.range else None,
            kind=output.kind,
            storage_root=storage_root,
            org_slug=org_slug,
            now=now,
        )
        datasets[name] = DatasetPointer(uuids[name], version, created)
    external = {uuids[n] for n in dag_dataset_names(spec) if n not in datasets}
    upstream = await tx.deploy.producers_current_pointers(org_id, external)
    missing = [
        n for n in sorted(dag_dataset_names(spec)) if n not in datasets and uuids[n] not in upstream
    ]
    if missing:
        raise DagValidationError(
            [
                Problem(
                    document.file,
                    document.lines.line(path),
                    format_field(path),
                    f"dataset '{name}' has no current version — the DAG that produces it "
                    "must publish it in its current version before another DAG can read it",
                )
                for name in missing
                for path in [_input_path(spec, name)]
            ]
        )
    await tx.deploy.insert_pointers(
        version_id,
        {p.dataset_uuid: p.dataset_version for p in datasets.values()} | dict(upstream),
    )
    config_hashes = job_config_hashes(spec)
    jobs = {job.name: uuid.uuid4() for job in spec.jobs}
    await tx.deploy.insert_jobs(
        [
            job_row(
                job,
                spec,
                job_id=jobs[job.name],
                org_id=org_id,
                version_id=version_id,
                config_hash=config_hashes[job.name],
                uuids=uuids,
            )
            for job in spec.jobs
        ],
        now=now,
    )
    return jobs, datasets


async def _register(
    tx: Transaction, document: DagDocument, org_id: uuid.UUID, now: datetime
) -> dict[str, uuid.UUID]:
    """Dataset name -> uuid for every dataset the DAG names, registering new outputs."""
    spec = document.spec
    await tx.registry.register_datasets_if_absent(
        [
            NewDataset(
                dataset_uuid=uuid.uuid4(),
                org_id=org_id,
                name=output.dataset,
                producer_dag_name=spec.dag,
                producer_job_name=job.name,
                producer_output_index=k,
                created_at=now,
                storage={"kind": output.kind},
            )
            for job in spec.jobs
            for k, output in enumerate(job.outputs)
        ]
    )
    # Re-read: a concurrent deploy of another DAG may have won a name (or a
    # slot) between our check and our insert; the same rules then reject it.
    rows = await registered_datasets(
        tx, org_id, names=dag_dataset_names(spec), producer_dag=spec.dag
    )
    problems = registry_problems(document, rows)
    uuids = {r.name: r.dataset_uuid for r in rows if r.name in dag_dataset_names(spec)}
    if problems or len(uuids) != len(dag_dataset_names(spec)):
        raise DagValidationError(
            problems
            or [Problem(document.file, None, "", "the dataset registry changed during deploy")]
        )
    return uuids


def job_row(
    job: JobSpec,
    spec: DagSpec,
    *,
    job_id: uuid.UUID,
    org_id: uuid.UUID,
    version_id: uuid.UUID,
    config_hash: str,
    uuids: Mapping[str, uuid.UUID],
) -> JobRecord:
    """The ``jobs`` row of one job (see :mod:`trace_core.dag.deploy` for the mapping)."""
    inputs = [uuids[name] for name in job_input_datasets(spec, job)]
    config: dict[str, Any] = dict(job.config)
    where = {str(ds): edge.where for ds, edge in zip(inputs, job.inputs, strict=True) if edge.where}
    if where:
        config[INPUTS_WHERE_KEY] = where
    source = None
    if job.source is not None:
        source = job.source.model_dump(exclude_none=True)
        if job.source.kind == "cron":
            source.setdefault("timezone", "UTC")
    backpressure = None
    if job.backpressure is not None:
        backpressure = {
            key: value
            for key, value in (
                ("max_queue_depth", job.backpressure.max_queue_depth),
                ("max_queue_age_seconds", job.backpressure.max_queue_age),
            )
            if value is not None
        } or None
    scaling = job.scaling.model_dump(exclude_none=True) or None if job.scaling else None
    return JobRecord(
        job_id=job_id,
        org_id=org_id,
        name=job.name,
        dag_name=spec.dag,
        dag_version_id=version_id,
        activation=job.activation,
        runtime=job.runtime,
        operator=job.operator,
        config_hash=config_hash,
        update_strategy=job.update_strategy,
        input_datasets=tuple(inputs),
        output_datasets=tuple(uuids[o.dataset] for o in job.outputs),
        config=config,
        source=source,
        bootstrap=job.bootstrap.model_dump() if job.bootstrap else None,
        execution_strategy=job.execution_strategy,
        idle_timeout=job.idle_timeout,
        unique_key=tuple(job.unique_key) if job.unique_key is not None else None,
        scaling=scaling,
        timeout_seconds=job.timeout_seconds,
        heartbeat_timeout_seconds=job.heartbeat_timeout_seconds,
        max_attempts=job.max_attempts,
        backpressure=backpressure,
        priority_tier=job.backpressure.priority_tier if job.backpressure else "normal",
    )
