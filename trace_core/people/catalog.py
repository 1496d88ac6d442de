"""People's reads of their org: :class:`PeopleCatalog`.

DAGs and their versions, datasets with their versions and coverage, tasks
with their attempts, lineage, and the checks the API makes before it
explains or triggers a job: each within the caller's org and visibility
(:mod:`trace_core.people.visibility`). Something the caller may not see
raises :class:`~trace_core.errors.NotFound` with the very message of a
missing one.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

from trace_core.dag.spec import DagSpec
from trace_core.dag.version_rows import dag_dataset_names
from trace_core.errors import InvalidInput, NotFound
from trace_core.people.access import Caller
from trace_core.people.visibility import may_read, visible_to
from trace_core.security.claims import DatasetInput
from trace_core.storage.ports import AttemptRecord, LineageRow
from trace_core.storage.ports.catalog import (
    CatalogDag,
    CatalogDagVersion,
    CatalogDataset,
    CatalogDatasetVersion,
    CatalogJob,
    CatalogTask,
)
from trace_core.storage.protocol import Repository, Transaction

__all__ = ["DagDetail", "DatasetDetail", "Lineage", "PeopleCatalog", "TaskDetail"]

_LIVE = ("current", "building")


@dataclass(frozen=True)
class DagDetail:
    """A DAG's versions (newest first), each listing only visible datasets by name."""

    name: str
    versions: list[CatalogDagVersion]
    dataset_names: dict[uuid.UUID, str]


@dataclass(frozen=True)
class DatasetDetail:
    """A visible dataset and its versions (newest first) with coverage."""

    dataset: CatalogDataset
    versions: list[CatalogDatasetVersion]


@dataclass(frozen=True)
class TaskDetail:
    """A visible task, its job and its attempts (oldest first)."""

    task: CatalogTask
    job: CatalogJob
    attempts: list[AttemptRecord]


@dataclass(frozen=True)
class Lineage:
    """Upstream and downstream edges through visible datasets only."""

    upstream: list[LineageRow]
    downstream: list[LineageRow]


def missing_job(dag: str, job: str, org_slug: str) -> NotFound:
    """The answer for a job that is missing or invisible (the explainer's own words)."""
    return NotFound(f"no job {job!r} in DAG {dag!r} of org {org_slug!r}")


class PeopleCatalog:
    """Reads of the caller's org, filtered by what the caller may see."""

    def __init__(self, repo: Repository) -> None:
        self._repo = repo

    async def dags(self, caller: Caller) -> list[CatalogDag]:
        """The org's DAGs."""
        async with self._repo.read() as tx:
            return await tx.catalog.dags(caller.org_id)

    async def dag(self, caller: Caller, name: str) -> DagDetail:
        """The org's DAG ``name`` with its versions."""
        async with self._repo.read() as tx:
            versions = await tx.catalog.dag_versions(caller.org_id, name)
            visible = await visible_to(tx, caller)
        if not versions:
            raise NotFound(f"no DAG {name!r}")
        shown = [
            CatalogDagVersion(
                version_id=v.version_id,
                dag_name=v.dag_name,
                status=v.status,
                yaml_hash=v.yaml_hash,
                created_at=v.created_at,
                activated_at=v.activated_at,
                datasets=tuple(d for d in v.datasets if d in visible.datasets),
            )
            for v in versions
        ]
        names = {d: visible.datasets[d].name for v in shown for d in v.datasets}
        return DagDetail(name, shown, names)

    async def datasets(self, caller: Caller) -> list[CatalogDataset]:
        """The org's datasets the caller may see, by name."""
        async with self._repo.read() as tx:
            visible = await visible_to(tx, caller)
        return sorted(visible.datasets.values(), key=lambda d: d.name)

    async def dataset(self, caller: Caller, name: str) -> DatasetDetail:
        """The visible dataset ``name`` with its versions and coverage."""
        async with self._repo.read() as tx:
            found = (await visible_to(tx, caller)).named(name)
            versions = await tx.catalog.dataset_versions(caller.org_id, found.dataset_uuid)
        return DatasetDetail(found, versions)

    async def views(self, caller: Caller) -> dict[str, DatasetInput]:
        """The query service's views of the caller: visible datasets' live versions."""
        async with self._repo.read() as tx:
            return (await visible_to(tx, caller)).views()

    async def dataset_view(self, caller: Caller, name: str) -> DatasetInput:
        """The live version of the visible dataset ``name``, as a query input; a
        dataset without one reads as having no rows yet (a 404)."""
        async with self._repo.read() as tx:
            found = (await visible_to(tx, caller)).named(name)
        if found.current_version is None or found.location is None:
            raise NotFound(f"dataset {name!r} has no live version to read")
        return DatasetInput(found.dataset_uuid, found.current_version, found.location)

    async def check_deploy(self, caller: Caller, spec: DagSpec) -> None:
        """That ``caller`` may deploy ``spec``: every existing dataset it names, and
        every dataset the DAG produces today, is visible to them. Otherwise a new
        version could read a hidden dataset into a visible one.

        Raises :class:`~trace_core.errors.InvalidInput` naming ``yaml``; a hidden
        dataset the DAG produces today is not named. (A hidden *input* never
        gets here: the DAG is validated against the visible names first, so it
        reads as an unknown dataset.)
        """
        await self.check_dag_writable(caller, spec.dag, named=dag_dataset_names(spec))

    async def check_dag_writable(
        self, caller: Caller, dag: str, *, named: Collection[str] = ()
    ) -> None:
        """That every dataset DAG ``dag`` produces today, and every existing one of
        ``named``, is visible to ``caller`` (deploy and rollback change what it
        produces from what); :class:`~trace_core.errors.InvalidInput` otherwise."""
        async with self._repo.read() as tx:
            every = await tx.catalog.datasets(caller.org_id)
        hidden = [d for d in every if not may_read(caller, d.read_roles)]
        for dataset in sorted(hidden, key=lambda d: d.name):
            if dataset.name in named:
                raise InvalidInput("yaml", f"dataset {dataset.name!r} is not one you may see")
        if any(d.producer_dag_name == dag for d in hidden):
            raise InvalidInput(
                "dag" if not named else "yaml",
                f"DAG {dag!r} produces a dataset you may not see: only who may see "
                "every dataset of a DAG may deploy or roll it back",
            )

    async def tasks(
        self,
        caller: Caller,
        *,
        dag: str | None,
        job: str | None,
        status: str | None,
        limit: int,
    ) -> list[tuple[CatalogTask, CatalogJob]]:
        """Up to ``limit`` visible tasks, most recently queued first."""
        async with self._repo.read() as tx:
            visible = await visible_to(tx, caller)
            jobs = {
                j.job_id: j
                for j in await tx.catalog.jobs(caller.org_id)
                if visible.job(j)
                and (dag is None or j.dag_name == dag)
                and (job is None or j.name == job)
            }
            tasks = await tx.catalog.tasks(caller.org_id, jobs, status=status, limit=limit)
        return [(t, jobs[t.job_id]) for t in tasks]

    async def task(self, caller: Caller, task_id: uuid.UUID) -> TaskDetail:
        """The visible task ``task_id`` with its attempts."""
        async with self._repo.read() as tx:
            task = await tx.catalog.task(caller.org_id, task_id)
            visible = await visible_to(tx, caller)
            jobs = {j.job_id: j for j in await tx.catalog.jobs(caller.org_id)}
            job = jobs.get(task.job_id) if task is not None else None
            if task is None or job is None or not visible.job(job):
                raise NotFound(f"no task {task_id}")
            attempts = (await tx.attempts.of_tasks([task_id])).get(task_id, [])
        return TaskDetail(task, job, list(attempts))

    async def check_job(self, caller: Caller, dag: str, job: str) -> None:
        """That every version's job ``dag/job`` is visible (else it reads as missing)."""
        async with self._repo.read() as tx:
            found = await self._jobs_named(tx, caller, dag, job)
        if not found:
            raise missing_job(dag, job, caller.org_slug)

    async def live_job(self, caller: Caller, dag: str, job: str) -> uuid.UUID:
        """The id of the live (current, else building) job ``dag/job``, if visible."""
        return (await self.live_jobs(caller, dag, job))[0]

    async def live_jobs(self, caller: Caller, dag: str, job: str) -> list[uuid.UUID]:
        """The ids of every live job ``dag/job`` (current first, then building),
        if visible; :class:`~trace_core.errors.NotFound` when there is none."""
        async with self._repo.read() as tx:
            found = await self._jobs_named(tx, caller, dag, job)
        live = sorted(
            (j for j in found if j.version_status in _LIVE),
            key=lambda j: _LIVE.index(j.version_status),
        )
        if not live:
            raise missing_job(dag, job, caller.org_slug)
        return [j.job_id for j in live]

    async def producer_yaml(self, caller: Caller, name: str) -> tuple[str, str]:
        """The producer DAG of the visible dataset ``name`` and the YAML of its
        newest live version (what a rematerialization rewrites); the DAG must be
        one the caller may deploy (:meth:`check_dag_writable`)."""
        async with self._repo.read() as tx:
            found = (await visible_to(tx, caller)).named(name)
            text = await tx.catalog.live_dag_yaml(caller.org_id, found.producer_dag_name)
        if text is None:
            raise NotFound(f"dataset {name!r} has no live producer to rebuild it")
        await self.check_dag_writable(caller, found.producer_dag_name)
        return found.producer_dag_name, text

    async def lineage(
        self,
        caller: Caller,
        dataset: str,
        column: str | None,
        *,
        depth: int,
        direction: Literal["up", "down", "both"],
    ) -> Lineage:
        """Lineage of the visible ``dataset`` (or its ``column``), through visible datasets."""
        async with self._repo.read() as tx:
            visible = await visible_to(tx, caller)
            subject = visible.named(dataset).dataset_uuid
            up: list[LineageRow] = []
            down: list[LineageRow] = []
            if direction in ("up", "both"):
                rows = await tx.lineage.upstream(subject, column, max_depth=depth)
                up = visible.lineage(subject, rows, "up")
            if direction in ("down", "both"):
                rows = await tx.lineage.downstream(subject, column, max_depth=depth)
                down = visible.lineage(subject, rows, "down")
        return Lineage(up, down)

    @staticmethod
    async def _jobs_named(tx: Transaction, caller: Caller, dag: str, job: str) -> list[CatalogJob]:
        """The jobs ``dag/job`` of every version, or none if any of them is invisible."""
        visible = await visible_to(tx, caller)
        found = [
            j for j in await tx.catalog.jobs(caller.org_id) if j.dag_name == dag and j.name == job
        ]
        return found if all(visible.job(j) for j in found) else []
