"""The lineage area of the repository port: column lineage per output dataset.

Reached as ``tx.lineage`` on any :class:`~trace_core.storage.protocol.Transaction`.
Rows live in ``column_lineage`` (orchestration-data-model.md, plus migration
0007): one per (output dataset, dataset version, output column, input
dataset, input column, kind) with the producing job. Each dataset version
keeps its own lineage: recording a new version's (a rematerialization) leaves
the older versions' rows alone. Reads answer, for every output dataset they
reach, the lineage of its *current* version: the version its producer DAG's
current version points at, or, for a dataset without such a pointer, its
newest version with recorded lineage (unless a read names the version of the
dataset it starts from). Indirect dependencies (filters, join keys,
grouping) are stored with the output column ``*``
(:data:`trace_core.dag.lineage.DATASET_WIDE`); ``kind`` is OpenLineage's
subtype (``DIRECT`` / ``INDIRECT`` without a subtype on rows recorded before
kinds were kept).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["LineageOps", "LineageRow", "NewLineageEdge", "TaskOutputs"]


@dataclass(frozen=True, order=True)
class NewLineageEdge:
    """One edge to record: ``output_column`` ← ``input_dataset``.``input_column``,
    as ``kind`` (:data:`trace_core.dag.lineage.DIRECT_KINDS` /
    :data:`~trace_core.dag.lineage.INDIRECT_KINDS`)."""

    output_column: str
    input_dataset: uuid.UUID
    input_column: str
    kind: str = "TRANSFORMATION"


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
    kind: str = "TRANSFORMATION"
    dataset_version: uuid.UUID | None = None


@dataclass(frozen=True)
class TaskOutputs:
    """A task's job, the datasets it produces (in output order) and those it
    reads; ``output_versions[i]`` is the version of output ``i`` the job's DAG
    version points at (``None`` without a pointer)."""

    job_id: uuid.UUID
    output_datasets: tuple[uuid.UUID, ...]
    input_datasets: frozenset[uuid.UUID]
    output_versions: tuple[uuid.UUID | None, ...] = ()


class LineageOps(Protocol):
    """Writes and transitive reads of column lineage, inside one transaction."""

    async def record(
        self,
        output_dataset: uuid.UUID,
        job_id: uuid.UUID | None,
        edges: Sequence[NewLineageEdge],
        *,
        dataset_version: uuid.UUID | None = None,
    ) -> None:
        """Make ``edges`` the lineage of ``dataset_version`` of ``output_dataset``
        (produced by ``job_id``), replacing what was recorded for that version
        before (an unchanged set writes nothing); other versions' lineage is
        left alone. Without ``dataset_version``: the dataset's current version
        (its producer's current pointer, else its newest version). A dataset
        without any version raises :class:`~trace_core.errors.NotFound`."""
        ...

    async def task_outputs(self, task_id: uuid.UUID) -> TaskOutputs | None:
        """The job of ``task_id`` and its datasets; ``None`` for an unknown task."""
        ...

    async def upstream(
        self,
        dataset: uuid.UUID,
        column: str | None = None,
        *,
        max_depth: int = 10,
        dataset_version: uuid.UUID | None = None,
    ) -> list[LineageRow]:
        """The edges ``dataset`` (or only its ``column`` and the dataset-wide
        ``*``) is computed from, followed up through the input columns' own
        lineage to ``max_depth`` levels; sorted by depth. Each dataset's
        current version's lineage, or ``dataset_version``'s for ``dataset``."""
        ...

    async def downstream(
        self, dataset: uuid.UUID, column: str | None = None, *, max_depth: int = 10
    ) -> list[LineageRow]:
        """The edges computed from ``dataset`` (or its ``column``; an input
        ``*`` counts for every column), followed down to ``max_depth`` levels;
        sorted by depth. Only the current version's lineage of each dataset
        computed from it counts."""
        ...
