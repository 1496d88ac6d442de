"""The deploy area of the repository port: DAG versions, pointer sets, jobs.

Reached as ``tx.deploy`` on any :class:`~trace_core.storage.protocol.Transaction`.
Every method runs inside that transaction and sees its earlier writes; nothing
commits by itself. A DAG version's ``status`` is one of ``building``,
``current``, ``superseded``, ``abandoned``; its *pointer set* maps each
dataset it reads or writes (dataset_uuid) to one dataset version.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

__all__ = [
    "DagVersionRef",
    "DagVersionRow",
    "DeployOps",
    "JobOutputs",
    "JobRecord",
    "LiveVersion",
    "LiveVersionJob",
    "NewDagVersion",
    "Pointers",
]

Pointers = dict[uuid.UUID, uuid.UUID]
"""dataset_uuid -> dataset_version."""


@dataclass(frozen=True)
class DagVersionRef:
    """A DAG version and its status."""

    version_id: uuid.UUID
    status: str


@dataclass(frozen=True)
class DagVersionRow:
    """Who a DAG version belongs to, and its status."""

    version_id: uuid.UUID
    org_id: uuid.UUID
    dag_name: str
    status: str


@dataclass(frozen=True)
class NewDagVersion:
    """A DAG version to insert; it starts ``building``."""

    version_id: uuid.UUID
    org_id: uuid.UUID
    dag_name: str
    yaml_hash: str
    yaml_text: str
    created_at: datetime


@dataclass(frozen=True)
class JobRecord:
    """A row of ``jobs``: one job of one DAG version, as deploy wrote it."""

    job_id: uuid.UUID
    org_id: uuid.UUID
    name: str
    dag_name: str
    dag_version_id: uuid.UUID
    activation: str
    runtime: str
    operator: str
    config_hash: str
    update_strategy: str
    input_datasets: tuple[uuid.UUID, ...] = ()
    """Input dataset uuids in input order."""
    output_datasets: tuple[uuid.UUID, ...] = ()
    """Output dataset uuids by output index."""
    config: Mapping[str, Any] = field(default_factory=dict)
    source: Mapping[str, Any] | None = None
    bootstrap: Mapping[str, Any] | None = None
    execution_strategy: str | None = None
    idle_timeout: str | None = None
    unique_key: tuple[str, ...] | None = None
    scaling: Mapping[str, Any] | None = None
    timeout_seconds: int | None = None
    heartbeat_timeout_seconds: int | None = None
    max_attempts: int | None = None
    backpressure: Mapping[str, Any] | None = None
    priority_tier: str = "normal"


@dataclass(frozen=True)
class LiveVersionJob:
    """A job of a ``current`` or ``building`` DAG version."""

    job: JobRecord
    version_status: str


@dataclass(frozen=True)
class LiveVersion:
    """A ``current`` or ``building`` DAG version with its pointer set."""

    version_id: uuid.UUID
    org_id: uuid.UUID
    dag_name: str
    status: str
    pointers: Pointers


@dataclass(frozen=True)
class JobOutputs:
    """The datasets one job writes."""

    job_id: uuid.UUID
    dag_version_id: uuid.UUID
    output_datasets: tuple[uuid.UUID, ...]


class DeployOps(Protocol):
    """DAG versions, their pointer sets and their jobs, inside one transaction."""

    # --- serialization -----------------------------------------------------

    async def lock_dag_versions(self, org_id: uuid.UUID, dag_name: str) -> None:
        """Serialize changes to the versions of one DAG until the transaction ends.

        A second transaction taking the same lock waits for the first to
        commit or roll back; taking it again in the same transaction is a
        no-op. On SQLite this takes nothing: its write transactions are
        already serialized by ``BEGIN IMMEDIATE``.
        """
        ...

    # --- versions ------------------------------------------------------------

    async def version(self, version_id: uuid.UUID) -> DagVersionRow | None:
        """The version's owner and status, or ``None`` if it does not exist."""
        ...

    async def versions_with_yaml_hash(
        self, org_id: uuid.UUID, dag_name: str, yaml_hash: str
    ) -> list[DagVersionRef]:
        """The DAG's versions stored under ``yaml_hash`` or one of its
        generations (``yaml_hash + "+" + n``), newest first."""
        ...

    async def version_ids_with_status(
        self, org_id: uuid.UUID, dag_name: str, status: str
    ) -> list[uuid.UUID]:
        """The DAG's versions in ``status``, in no particular order."""
        ...

    async def building_versions(self) -> list[DagVersionRow]:
        """Every ``building`` version of every DAG, oldest first (creation
        time, then id)."""
        ...

    async def latest_superseded_version(self, org_id: uuid.UUID, dag_name: str) -> uuid.UUID | None:
        """The DAG's superseded version activated last (creation time breaks
        ties; a never-activated one comes after any activated one)."""
        ...

    async def insert_version(self, version: NewDagVersion) -> None:
        """Insert a ``building`` version. :class:`~trace_core.errors.DuplicateItem`
        if the DAG already has a version stored under the same hash."""
        ...

    async def mark_version_building(self, version_id: uuid.UUID) -> None:
        """Set the version's status to ``building`` (whatever it was)."""
        ...

    async def mark_version_current(self, version_id: uuid.UUID, *, now: datetime) -> None:
        """Set the version's status to ``current`` and its activation time to ``now``.

        Does not touch the DAG's current-version pointer
        (:meth:`set_current_version`) or any other version.
        """
        ...

    async def mark_version_superseded_if_current(self, version_id: uuid.UUID) -> bool:
        """Set the version's status to ``superseded`` only if it is ``current``;
        whether it was."""
        ...

    async def mark_versions_abandoned(self, version_ids: Collection[uuid.UUID]) -> None:
        """Set each version's status to ``abandoned`` (whatever it was)."""
        ...

    # --- the current version -------------------------------------------------

    async def current_version_id(self, org_id: uuid.UUID, dag_name: str) -> uuid.UUID | None:
        """The version the DAG's current-version pointer names, if any."""
        ...

    async def set_current_version(
        self, org_id: uuid.UUID, dag_name: str, version_id: uuid.UUID, *, now: datetime
    ) -> None:
        """Point the DAG's current-version pointer at ``version_id`` (created or
        replaced). Version statuses are left as they are."""
        ...

    # --- pointer sets --------------------------------------------------------

    async def pointers(self, version_id: uuid.UUID) -> Pointers:
        """The version's pointer set (empty for an unknown version)."""
        ...

    async def pointers_of_versions(
        self, version_ids: Collection[uuid.UUID]
    ) -> dict[uuid.UUID, Pointers]:
        """version_id -> pointer set, for those of ``version_ids`` that have pointers."""
        ...

    async def produced_pointers(self, version_id: uuid.UUID, dag_name: str) -> Pointers:
        """The version's pointers for the datasets ``dag_name`` produces (its
        inputs from other DAGs left out)."""
        ...

    async def producers_current_pointers(
        self, org_id: uuid.UUID, dataset_uuids: Collection[uuid.UUID]
    ) -> Pointers:
        """For each of ``dataset_uuids``: the dataset version its producer DAG's
        current version points at. Datasets whose producer has no current
        version, or whose current version does not point at them, are absent."""
        ...

    async def live_dataset_versions(self) -> set[uuid.UUID]:
        """Dataset versions pointed at by a ``current`` or ``building`` DAG
        version (each once)."""
        ...

    async def insert_pointers(
        self, version_id: uuid.UUID, pointers: Mapping[uuid.UUID, uuid.UUID]
    ) -> None:
        """Add pointers to the version's set; a dataset already in it is a
        :class:`~trace_core.errors.DuplicateItem`."""
        ...

    async def update_pointers(
        self, version_id: uuid.UUID, pointers: Mapping[uuid.UUID, uuid.UUID]
    ) -> None:
        """Repoint the version's existing pointers for these datasets; datasets
        not in its set are left out (nothing is added)."""
        ...

    async def repoint_live_consumers(
        self, org_id: uuid.UUID, producer_dag: str, pointers: Mapping[uuid.UUID, uuid.UUID]
    ) -> None:
        """Repoint every ``current`` or ``building`` version of the org's other
        DAGs (not ``producer_dag``) that points at one of these datasets, at the
        given dataset version."""
        ...

    # --- jobs ----------------------------------------------------------------

    async def insert_jobs(self, jobs: Sequence[JobRecord], *, now: datetime) -> None:
        """Insert the jobs (created and updated at ``now``); a job name repeated
        within one version is a :class:`~trace_core.errors.DuplicateItem`."""
        ...

    async def job_ids_by_name(self, version_id: uuid.UUID) -> dict[str, uuid.UUID]:
        """Job name -> job id, for the jobs of one version."""
        ...

    async def job_outputs(self, version_ids: Collection[uuid.UUID]) -> list[JobOutputs]:
        """The output datasets of every job of ``version_ids``."""
        ...

    async def live_versions(self) -> list[LiveVersion]:
        """Every ``current`` or ``building`` version, each with its pointer set."""
        ...

    async def live_version_jobs(self) -> list[LiveVersionJob]:
        """Every job of a ``current`` or ``building`` version, ordered by org,
        DAG name, version status (``current`` first) and job name."""
        ...
