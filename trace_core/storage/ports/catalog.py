"""The catalog area of the repository port: what one org holds, for people's reads.

Reached as ``tx.catalog``. Every operation takes the caller's ``org_id`` and
matches nothing outside it (DAGs, versions and jobs by their ``org_id``,
datasets by theirs, tasks through their job's), so another org's object
reads exactly like one that does not exist. Visibility *within* the org
(datasets' ``read_roles``) is not decided here but by
:mod:`trace_core.people.visibility`, from the ``read_roles`` and the dataset
ids these records carry.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

__all__ = [
    "CatalogDag",
    "CatalogDagVersion",
    "CatalogDataset",
    "CatalogDatasetVersion",
    "CatalogJob",
    "CatalogOps",
    "CatalogTask",
]


@dataclass(frozen=True)
class CatalogDag:
    """One DAG of the org: its current version (if any) and how many it has."""

    name: str
    current_version_id: uuid.UUID | None
    versions: int
    last_deployed_at: datetime


@dataclass(frozen=True)
class CatalogDagVersion:
    """One deployed version of a DAG and the datasets it points at."""

    version_id: uuid.UUID
    dag_name: str
    status: str
    yaml_hash: str
    created_at: datetime
    activated_at: datetime | None
    datasets: tuple[uuid.UUID, ...]
    """Every dataset the version points at (produced or read), by id."""


@dataclass(frozen=True)
class CatalogDataset:
    """One dataset of the org with its visibility and its live version."""

    dataset_uuid: uuid.UUID
    name: str
    producer_dag_name: str
    producer_job_name: str
    read_roles: tuple[str, ...]
    created_at: datetime
    current_version: uuid.UUID | None
    """The version its producer DAG's current version points at, if any."""
    location: str | None
    """That version's storage location."""


@dataclass(frozen=True)
class CatalogDatasetVersion:
    """One version of a dataset with its recorded coverage."""

    version_id: uuid.UUID
    config_hash: str
    location: str
    range_start: int | None
    range_end: int | None
    created_at: datetime
    ranges: list[Any]
    """Covered block ranges ``[[start, end], ...]`` (merged, inclusive)."""
    max_cursor: int | None
    events: int


@dataclass(frozen=True)
class CatalogJob:
    """One job of one DAG version, with the datasets it reads and writes."""

    job_id: uuid.UUID
    name: str
    dag_name: str
    dag_version_id: uuid.UUID
    version_status: str
    inputs: tuple[uuid.UUID, ...]
    outputs: tuple[uuid.UUID, ...]


@dataclass(frozen=True)
class CatalogTask:
    """One task: its job, state and timestamps."""

    task_id: uuid.UUID
    job_id: uuid.UUID
    status: str
    attempt: int
    max_attempts: int
    partitions: tuple[str, ...]
    queued_at: datetime
    started_at: datetime | None
    completed_at: datetime | None
    next_retry_at: datetime | None
    error_message: str | None


class CatalogOps(Protocol):
    """Org-scoped reads of DAGs, datasets, jobs and tasks, inside one transaction."""

    async def dags(self, org_id: uuid.UUID) -> list[CatalogDag]:
        """The org's DAGs (every name with a deployed version), by name."""
        ...

    async def dag_versions(self, org_id: uuid.UUID, dag_name: str) -> list[CatalogDagVersion]:
        """The org's DAG's versions, newest first (ties by id); empty for no such DAG."""
        ...

    async def live_dag_yaml(self, org_id: uuid.UUID, dag_name: str) -> str | None:
        """The YAML text of the org's DAG's newest live version (``building``,
        else ``current``), as deployed; None for no such DAG or none live."""
        ...

    async def datasets(self, org_id: uuid.UUID) -> list[CatalogDataset]:
        """The org's datasets, by name."""
        ...

    async def dataset_versions(
        self, org_id: uuid.UUID, dataset: uuid.UUID
    ) -> list[CatalogDatasetVersion]:
        """The versions of the org's ``dataset``, newest first (ties by id)."""
        ...

    async def jobs(self, org_id: uuid.UUID) -> list[CatalogJob]:
        """Every job of every version of the org's DAGs."""
        ...

    async def tasks(
        self,
        org_id: uuid.UUID,
        job_ids: Collection[uuid.UUID],
        *,
        status: str | None,
        limit: int,
    ) -> list[CatalogTask]:
        """Up to ``limit`` tasks of the org's jobs among ``job_ids`` (in ``status``
        when given), most recently queued first (ties by id)."""
        ...

    async def task(self, org_id: uuid.UUID, task_id: uuid.UUID) -> CatalogTask | None:
        """The task ``task_id`` if its job is the org's, else None."""
        ...
