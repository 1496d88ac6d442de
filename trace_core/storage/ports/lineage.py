"""The lineage area of the repository port: column lineage per output dataset.

Reached as ``tx.lineage`` on any :class:`~trace_core.storage.protocol.Transaction`.
Rows live in ``column_lineage`` (orchestration-data-model.md): one per
(output dataset, output column, input dataset, input column) with the
producing job. The table keeps no version: recording the lineage of a new
version of a dataset (a rematerialization) replaces the previous version's,
so the stored lineage is the latest committed version's. Indirect
dependencies (filters, join keys, grouping) are stored with the output
column ``*`` (:data:`trace_core.dag.lineage.DATASET_WIDE`).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["LineageOps", "LineageRow", "NewLineageEdge", "TaskOutputs"]


@dataclass(frozen=True, order=True)
class NewLineageEdge:
    """One edge to record: ``output_column`` ← ``input_dataset``.``input_column``."""

    output_column: str
    input_dataset: uuid.UUID
    input_column: str


@dataclass(frozen=True, order=True)
class LineageRow:
    """A stored edge with the datasets' names; ``depth`` is 1 for a direct
    neighbour, 2 for one further away, and so on."""

    depth: int
    output_name: str
    output_column: str
    input_name: str
    input_column: str
    output_dataset: uuid.UUID
    input_dataset: uuid.UUID
    job_id: uuid.UUID | None


@dataclass(frozen=True)
class TaskOutputs:
    """A task's job, the datasets it produces (in output order) and those it reads."""

    job_id: uuid.UUID
    output_datasets: tuple[uuid.UUID, ...]
    input_datasets: frozenset[uuid.UUID]


class LineageOps(Protocol):
    """Writes and transitive reads of column lineage, inside one transaction."""

    async def record(
        self,
        output_dataset: uuid.UUID,
        job_id: uuid.UUID | None,
        edges: Sequence[NewLineageEdge],
    ) -> None:
        """Make ``edges`` the lineage of ``output_dataset`` (produced by ``job_id``),
        replacing what was recorded for it before (an unchanged set writes nothing)."""
        ...

    async def task_outputs(self, task_id: uuid.UUID) -> TaskOutputs | None:
        """The job of ``task_id`` and its datasets; ``None`` for an unknown task."""
        ...

    async def upstream(
        self, dataset: uuid.UUID, column: str | None = None, *, max_depth: int = 10
    ) -> list[LineageRow]:
        """The edges ``dataset`` (or only its ``column`` and the dataset-wide
        ``*``) is computed from, followed up through the input columns' own
        lineage to ``max_depth`` levels; sorted by depth."""
        ...

    async def downstream(
        self, dataset: uuid.UUID, column: str | None = None, *, max_depth: int = 10
    ) -> list[LineageRow]:
        """The edges computed from ``dataset`` (or its ``column``; an input
        ``*`` counts for every column), followed down to ``max_depth`` levels."""
        ...
