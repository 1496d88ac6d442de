"""Deploying a DAG file: registry, dataset versions, jobs and the pointer swap, atomically.

One transaction per deploy, on either engine:

1. Ensure the org. A version with the same ``(org, dag_name, yaml_hash)``
   that is current makes the deploy a no-op (``changed=False``); one that is
   superseded or abandoned is reactivated instead of copied (see
   :mod:`trace_core.dag.activation`).
2. Check the file against the registry: inputs by dataset name must exist,
   and a dataset has one producer ``(dag, job, output_index)`` forever. Any
   problem raises :class:`~trace_core.dag.problems.DagValidationError` and
   nothing is written.
3. Register new datasets; find or create the dataset version of every output
   (a new row only when its config hash, :mod:`trace_core.dag.hashing`,
   changes); insert the ``dag_versions`` row (``building``, with the YAML
   text), the ``jobs`` rows and the pointer set (``dag_version_datasets``):
   one pointer per dataset the DAG produces, plus one per input read from
   another DAG, at that producer's current version.
4. Swap at once when nothing needs building: a first deploy, or every
   dataset the current version publishes keeps its version (datasets it does
   not publish, such as ones new to the registry, hold nothing back).
   Otherwise the version stays ``building`` and
   :func:`~trace_core.dag.activation.promote_if_caught_up` swaps it once the
   new dataset versions have caught up. A version that was building is
   abandoned (its obsolete tasks canceled after commit).

Where input filters live: ``jobs.config`` is the operator config as written,
plus the reserved key ``inputs_where`` = ``{dataset_uuid: where}`` for the
inputs that have a filter (validation rejects the key in YAML). The filter is
a read-time predicate the consumer applies (ADR 0007), so it belongs in what
the operator receives; the router finds it through
:func:`~trace_core.dag.live.live_jobs`. A dedicated ``jobs.inputs`` column of
edges would be cleaner (see the design notes).

Column mapping: ``source`` is ``{"kind", "schedule"?, "timezone"?}`` (cron
timezone defaults to UTC), ``bootstrap`` is ``{"reset_outputs"}``,
``scaling`` is ``{"max_concurrency"}``, ``backpressure`` is
``{"max_queue_depth"?, "max_queue_age_seconds"?}`` with the tier in
``priority_tier``; durations are stored as seconds, ``idle_timeout`` as text.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from trace_core.clock import Clock
from trace_core.dag.activation import (
    CancelTasks,
    abandon_versions,
    refresh_external_pointers,
    resolve_cancel,
    swap_current,
)
from trace_core.dag.hashing import yaml_hash as compute_yaml_hash
from trace_core.dag.live import LIVE_JOBS_CHANNEL
from trace_core.dag.loader import DagDocument
from trace_core.dag.problems import DagValidationError
from trace_core.dag.registry import (
    Pointers,
    all_dataset_names,
    ensure_org,
    registered_datasets,
    registry_problems,
)
from trace_core.dag.spec import DEFAULT_OPERATORS, DEFAULT_RUNTIMES
from trace_core.dag.version_rows import DatasetPointer, dag_dataset_names, write_version
from trace_core.storage.protocol import Repository, Transaction

__all__ = ["DatasetPointer", "DeployResult", "deploy"]

VersionStatus = Literal["building", "current", "superseded", "abandoned"]


@dataclass(frozen=True)
class DeployResult:
    """The outcome of :func:`deploy`."""

    dag_version_id: uuid.UUID
    dag_name: str
    org_slug: str
    yaml_hash: str
    status: VersionStatus
    changed: bool
    """False when the same YAML was already current or building (nothing was written)."""
    jobs: Mapping[str, uuid.UUID]
    """Job name -> job id."""
    datasets: Mapping[str, DatasetPointer]
    """Dataset name -> pointer, for the datasets this DAG produces."""
    abandoned_version_ids: tuple[uuid.UUID, ...] = ()
    canceled_task_ids: tuple[uuid.UUID, ...] = ()


async def deploy(
    repo: Repository,
    document: DagDocument,
    *,
    clock: Clock,
    org_slug: str | None = None,
    storage_root: str = "s3://trace-lite/",
    operators: Collection[str] = DEFAULT_OPERATORS,
    runtimes: Collection[str] = DEFAULT_RUNTIMES,
    cancel: CancelTasks | None = None,
) -> DeployResult:
    """Deploy a validated DAG file (see the module docstring for the steps).

    ``org_slug`` overrides the file's ``org:`` (default ``"default"``).
    ``cancel`` cancels the tasks of a building version this deploy abandons
    (default: ``TaskQueue(repo, clock=clock).cancel``).
    """
    spec = document.spec
    slug = org_slug or spec.org or "default"
    dag_hash = compute_yaml_hash(spec)
    now = clock.now()
    async with repo.transaction() as tx:
        org_id = await ensure_org(tx, slug, now)
        await tx.deploy.lock_dag_versions(org_id, spec.dag)
        same_yaml = await tx.deploy.versions_with_yaml_hash(org_id, spec.dag, dag_hash)
        # An abandoned version is never brought back: its unfinished tasks were
        # canceled (a terminal state) and would block its units of work for good.
        # The same YAML deployed again after that is a fresh version (new jobs,
        # new tasks) recorded under the hash with a generation suffix.
        existing = next((v for v in same_yaml if v.status != "abandoned"), None)
        stored_hash = f"{dag_hash}+{len(same_yaml)}" if same_yaml else dag_hash
        if existing is not None and existing.status in ("current", "building"):
            jobs, datasets = await _summary(tx, existing.version_id, spec.dag)
            same: VersionStatus = "current" if existing.status == "current" else "building"
            return DeployResult(
                existing.version_id, spec.dag, slug, dag_hash, same, False, jobs, datasets
            )
        problems = document.recheck(
            operators=operators,
            runtimes=runtimes,
            known_datasets=await all_dataset_names(tx, org_id),
        )
        registered = await registered_datasets(
            tx, org_id, names=dag_dataset_names(spec), producer_dag=spec.dag
        )
        problems += registry_problems(document, registered)
        if any(p.severity == "error" for p in problems):
            raise DagValidationError(problems)
        if existing is not None:
            version_id = existing.version_id
            await refresh_external_pointers(tx, org_id, spec.dag, version_id)
            jobs, datasets = await _summary(tx, version_id, spec.dag)
        else:
            version_id = uuid.uuid4()
            jobs, datasets = await write_version(
                tx, document, org_id, slug, version_id, stored_hash, storage_root, now
            )
        status, abandoned, to_cancel = await _activate(tx, org_id, spec.dag, version_id, now)
        tx.notify(LIVE_JOBS_CHANNEL)
    if to_cancel:
        await resolve_cancel(repo, clock, cancel)(
            to_cancel, f"dag '{spec.dag}' redeployed: its building version was abandoned"
        )
    return DeployResult(
        version_id,
        spec.dag,
        slug,
        dag_hash,
        status,
        True,
        jobs,
        datasets,
        tuple(abandoned),
        tuple(to_cancel),
    )


async def _activate(
    tx: Transaction, org_id: uuid.UUID, dag_name: str, version_id: uuid.UUID, now: datetime
) -> tuple[VersionStatus, list[uuid.UUID], list[uuid.UUID]]:
    """Swap now or leave building; abandon any other building version."""
    deploy = tx.deploy
    current = await deploy.current_version_id(org_id, dag_name)
    new = await deploy.produced_pointers(version_id, dag_name)
    old: Pointers = await deploy.produced_pointers(current, dag_name) if current else {}
    others = [
        v
        for v in await deploy.version_ids_with_status(org_id, dag_name, "building")
        if v != version_id
    ]
    keep = set(new.values()) | set((await deploy.pointers(current)).values() if current else ())
    to_cancel = await abandon_versions(tx, others, keep=keep)
    if current is None or all(old.get(ds, v) == v for ds, v in new.items()):
        await swap_current(tx, org_id=org_id, dag_name=dag_name, version_id=version_id, now=now)
        return "current", others, to_cancel
    await deploy.mark_version_building(version_id)
    return "building", others, to_cancel


async def _summary(
    tx: Transaction, version_id: uuid.UUID, dag_name: str
) -> tuple[dict[str, uuid.UUID], dict[str, DatasetPointer]]:
    jobs = await tx.deploy.job_ids_by_name(version_id)
    own = await tx.deploy.produced_pointers(version_id, dag_name)
    names = await tx.registry.dataset_names_by_id(list(own))
    datasets = {names[ds]: DatasetPointer(ds, v, False) for ds, v in own.items()}
    return jobs, datasets
