"""The registry area of the repository port: orgs, datasets, dataset versions.

Reached as ``tx.registry`` on any :class:`~trace_core.storage.protocol.Transaction`.
Every method runs inside that transaction and sees its earlier writes; nothing
commits by itself. Values in and out are plain Python (UUIDs, strings, the
frozen dataclasses below), never driver or SQLAlchemy objects.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

__all__ = [
    "NewDataset",
    "NewDatasetVersion",
    "RegisteredDataset",
    "RegistryOps",
    "VersionProgress",
]


@dataclass(frozen=True)
class RegisteredDataset:
    """A row of the dataset registry."""

    dataset_uuid: uuid.UUID
    name: str
    producer_dag_name: str
    producer_job_name: str
    producer_output_index: int

    @property
    def producer(self) -> str:
        """``dag/job[index]``, as problems name it."""
        return f"{self.producer_dag_name}/{self.producer_job_name}[{self.producer_output_index}]"


@dataclass(frozen=True)
class NewDataset:
    """A dataset to register: its name and its one producer slot, forever."""

    dataset_uuid: uuid.UUID
    org_id: uuid.UUID
    name: str
    producer_dag_name: str
    producer_job_name: str
    producer_output_index: int
    created_at: datetime
    storage: Mapping[str, Any] = field(default_factory=dict)
    """E.g. ``{"kind": "parquet"}``."""


@dataclass(frozen=True)
class NewDatasetVersion:
    """A dataset version to create for one ``(dataset, config_hash, range)``."""

    version_id: uuid.UUID
    dataset_uuid: uuid.UUID
    config_hash: str
    range_start: int | None
    range_end: int | None
    storage_location: str
    created_at: datetime


@dataclass(frozen=True)
class VersionProgress:
    """What a dataset version has materialized, as recorded (``dataset_version_progress``)."""

    ranges: tuple[tuple[int, int], ...]
    """Inclusive ``(start, end)`` block ranges, as stored (merged by the writer)."""
    max_cursor: int | None


class RegistryOps(Protocol):
    """Orgs, the dataset registry and dataset versions, inside one transaction."""

    async def find_org(self, slug: str) -> uuid.UUID | None:
        """The id of the org with ``slug``, or ``None`` if there is none."""
        ...

    async def org_slug_of_job(self, job_id: uuid.UUID) -> str | None:
        """The slug of the org the job belongs to, or ``None`` if there is no such job."""
        ...

    async def create_org_if_absent(self, org_id: uuid.UUID, slug: str, *, now: datetime) -> None:
        """Insert the org ``(org_id, slug)`` unless an org with that id or slug exists.

        Never fails on a concurrent creator of the same org: the loser's insert
        is a no-op. Read the winner's id with :meth:`find_org`.
        """
        ...

    async def dataset_names(self, org_id: uuid.UUID) -> set[str]:
        """Every dataset name registered in the org."""
        ...

    async def dataset_names_by_id(
        self, dataset_uuids: Collection[uuid.UUID]
    ) -> dict[uuid.UUID, str]:
        """dataset_uuid -> name for those of ``dataset_uuids`` that exist."""
        ...

    async def datasets_named_or_produced_by(
        self,
        org_id: uuid.UUID,
        *,
        names: Collection[str] = (),
        producer_dag: str | None = None,
    ) -> list[RegisteredDataset]:
        """The org's registry rows named in ``names`` or produced by ``producer_dag``.

        Empty when neither is given. Order is unspecified.
        """
        ...

    async def register_datasets_if_absent(self, datasets: Sequence[NewDataset]) -> None:
        """Insert each dataset unless its name, or its producer slot, is already taken.

        A conflicting row is skipped silently (no error, the existing row is
        kept): the caller re-reads with :meth:`datasets_named_or_produced_by`
        and judges what it finds.
        """
        ...

    async def find_dataset_version(
        self,
        dataset_uuid: uuid.UUID,
        *,
        config_hash: str,
        range_start: int | None,
        range_end: int | None,
    ) -> uuid.UUID | None:
        """The dataset version with exactly this config hash and range, if any.

        A ``None`` bound matches only ``None`` (an open range is its own key).
        """
        ...

    async def insert_dataset_version_if_absent(self, version: NewDatasetVersion) -> bool:
        """Insert the version; False (and nothing written) if its id or its
        ``(dataset, config_hash, range)`` already exists."""
        ...

    async def dataset_version_progress(
        self, versions: Collection[uuid.UUID]
    ) -> dict[uuid.UUID, VersionProgress]:
        """The recorded progress of each of ``versions`` that has any."""
        ...
