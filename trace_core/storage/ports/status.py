"""The status area of the repository port: what a DAG has done so far, for the
``trace-lite`` read commands (``status``, ``datasets``, ``tasks``, ``run``).

Reached as ``tx.status`` on any :class:`~trace_core.storage.protocol.Transaction`.
How the figures are shown (coverage, tables, progress lines) is the caller's.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

__all__ = ["DagDataset", "OutputVersion", "StatusOps", "TaskListing"]


@dataclass(frozen=True)
class DagDataset:
    """A dataset version a live version of a DAG points at, with its progress."""

    name: str
    dataset_uuid: uuid.UUID
    dataset_version: uuid.UUID
    dag_version_status: str
    location: str
    range_start: int | None
    range_end: int | None
    ranges: list[Any]
    """The recorded block ranges as stored (empty when there is no progress)."""
    max_cursor: int | None
    events: int
    """Events stored for this dataset version."""


@dataclass(frozen=True)
class OutputVersion:
    """The dataset version a task writes one of its outputs to."""

    org_id: uuid.UUID
    """The org of the task's job."""
    dataset_version: uuid.UUID
    location: str
    """The version's storage location."""


@dataclass(frozen=True)
class TaskListing:
    """A task as ``trace-lite tasks`` lists it."""

    task_id: uuid.UUID
    job_name: str
    partitions: tuple[str, ...]
    status: str
    attempt: int
    queued_at: datetime
    error_message: str | None


class StatusOps(Protocol):
    """Reads of a DAG's datasets, tasks and outbox, inside one transaction."""

    async def dag_datasets(self, org_slug: str, dag_name: str) -> list[DagDataset]:
        """The dataset versions pointed at by the DAG's ``current`` and ``building``
        versions (``current`` first, then by dataset name); other versions, DAGs
        and orgs are left out."""
        ...

    async def task_counts_by_job(self, org_slug: str, dag_name: str) -> dict[str, dict[str, int]]:
        """``{job name: {status: tasks}}`` over every version of the DAG (a status
        with no task is absent; a job with no task too)."""
        ...

    async def recent_tasks(
        self,
        org_slug: str,
        dag_name: str,
        *,
        limit: int,
        job_name: str | None = None,
        status: str | None = None,
    ) -> list[TaskListing]:
        """Up to ``limit`` tasks of the DAG (of ``job_name`` and in ``status`` when
        given), most recently queued first."""
        ...

    async def open_outbox_count(self) -> int:
        """Outbox rows not yet delivered (``Pending`` or ``Processing``)."""
        ...

    async def task_counts_by_dedupe_prefix(self, prefix: str) -> list[tuple[str, int, int]]:
        """``(status, attempt, tasks)`` of the tasks whose dedupe key starts with
        ``prefix`` (taken literally: ``%`` and ``_`` are not wildcards), one
        tuple per status and attempt present, in no particular order."""
        ...

    async def org_of_task(self, task_id: uuid.UUID) -> uuid.UUID | None:
        """The org of ``task_id``'s job; ``None`` when the task does not exist."""
        ...

    async def output_version(self, task_id: uuid.UUID, dataset: uuid.UUID) -> OutputVersion | None:
        """The version of ``dataset`` that the task's DAG version points at, if
        ``dataset`` is one of the outputs of the task's job; ``None`` for an
        unknown task, a dataset its job does not produce, or no pointer."""
        ...
