"""Lineage edges and the declared lineage of operators that are not Spark.

The kinds follow OpenLineage's column-lineage facet: a DIRECT edge says the
output value is computed from the input column (``IDENTITY``,
``TRANSFORMATION``, ``AGGREGATION``); an INDIRECT edge says the input column
decides which rows exist or how they are grouped (``FILTER``, ``JOIN``,
``GROUP_BY``, ``SORT``, ``WINDOW``, ``CONDITIONAL``). Indirect dependencies
concern the whole output, so they are recorded once with the output column
:data:`DATASET_WIDE`; an input column ``*`` means the input's rows as such
(``count(*)``).

An operator reports the lineage of output ``i`` in its result's
``outputs[i]["lineage"]`` (:func:`lineage_output`); the control plane takes
it out of the outputs (:func:`take_lineage`) and records it with the
completion that commits the output (:mod:`trace_core.dag.lineage_record`).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trace_core.errors import InvalidInput

__all__ = [
    "DATASET_WIDE",
    "DIRECT_KINDS",
    "INDIRECT_KINDS",
    "ColumnEdge",
    "OutputLineage",
    "lineage_output",
    "merge_edges",
    "parse_declared",
    "take_lineage",
]

DATASET_WIDE = "*"
"""The output "column" of indirect edges (and the input column of ``count(*)``)."""

DIRECT_KINDS = ("IDENTITY", "TRANSFORMATION", "AGGREGATION")
"""Direct subtypes, weakest first: a chain of steps takes the strongest."""

INDIRECT_KINDS = ("FILTER", "JOIN", "GROUP_BY", "SORT", "WINDOW", "CONDITIONAL")
"""Indirect subtypes."""


@dataclass(frozen=True, order=True)
class ColumnEdge:
    """``output_column`` of the output dataset depends on ``input_column`` of
    ``input_dataset`` (a dataset name), as ``kind``."""

    output_column: str
    input_dataset: str
    input_column: str
    kind: str = "TRANSFORMATION"

    @property
    def indirect(self) -> bool:
        """Whether the edge is an indirect (row-selecting) dependency."""
        return self.kind in INDIRECT_KINDS


def merge_edges(edges: Iterable[ColumnEdge]) -> list[ColumnEdge]:
    """``edges`` without duplicates, sorted: of the direct kinds of one
    (output, input) pair the strongest is kept, every indirect kind is kept."""
    best: dict[tuple[str, str, str, str], ColumnEdge] = {}
    for edge in edges:
        # direct kinds collapse to the strongest; each indirect kind is kept
        kind = edge.kind if edge.indirect else ""
        key = (edge.output_column, edge.input_dataset, edge.input_column, kind)
        have = best.get(key)
        if have is None or _rank(edge.kind) > _rank(have.kind):
            best[key] = edge
    return sorted(best.values())


def _rank(kind: str) -> int:
    return DIRECT_KINDS.index(kind) + 1 if kind in DIRECT_KINDS else 0


def parse_declared(raw: Any, *, inputs: Sequence[str], field: str = "lineage") -> list[ColumnEdge]:
    """The declared lineage of a job (YAML ``lineage:`` or code).

    The form maps each output column to a list of ``dataset.column`` sources,
    each a string (a ``TRANSFORMATION``) or ``{from: dataset.column, kind: K}``;
    the key ``"*"`` holds indirect dependencies (kind required, e.g. FILTER)::

        lineage:
          tx_count: [{from: transactions.*, kind: AGGREGATION}]
          "*": [{from: transactions.value, kind: FILTER}]

    Every source must name one of ``inputs`` (the job's input dataset names).
    Raises :class:`~trace_core.errors.InvalidInput` naming the field.
    """
    if not isinstance(raw, Mapping):
        raise InvalidInput(field, "must map output columns to lists of sources")
    known = set(inputs)
    edges = []
    for output, sources in raw.items():
        at = f"{field}.{output}"
        if not isinstance(output, str) or not output:
            raise InvalidInput(field, "output column names must be non-empty strings")
        if not isinstance(sources, list) or not sources:
            raise InvalidInput(at, "must be a non-empty list of sources")
        for i, source in enumerate(sources):
            edges.append(_source(source, f"{at}[{i}]", output, known))
    return merge_edges(edges)


def _source(source: Any, at: str, output: str, known: set[str]) -> ColumnEdge:
    kind = "TRANSFORMATION"
    if isinstance(source, Mapping):
        kind = source.get("kind", kind)
        if kind not in DIRECT_KINDS + INDIRECT_KINDS:
            raise InvalidInput(
                f"{at}.kind", f"must be one of {', '.join(DIRECT_KINDS + INDIRECT_KINDS)}"
            )
        source = source.get("from")
        at = f"{at}.from"
    if not isinstance(source, str) or source.count(".") < 1:
        raise InvalidInput(at, "must be 'dataset.column'")
    dataset, _, column = source.rpartition(".")
    if dataset not in known:
        raise InvalidInput(at, f"dataset {dataset!r} is not an input of the job")
    if not column:
        raise InvalidInput(at, "names no column")
    if output == DATASET_WIDE and kind not in INDIRECT_KINDS:
        raise InvalidInput(
            f"{at}", f"'*' holds indirect sources: give kind one of {', '.join(INDIRECT_KINDS)}"
        )
    if output != DATASET_WIDE and kind in INDIRECT_KINDS:
        raise InvalidInput(at, "indirect sources go under '*' (they concern every row)")
    return ColumnEdge(output, dataset, column, kind)


@dataclass(frozen=True)
class OutputLineage:
    """The lineage an operator reported for one output dataset: edges whose
    ``input_dataset`` is a dataset id (as a string)."""

    dataset_uuid: uuid.UUID
    edges: tuple[ColumnEdge, ...]


def lineage_output(
    edges: Iterable[ColumnEdge], inputs: Mapping[str, uuid.UUID | str]
) -> list[list[str]]:
    """``edges`` (input datasets by name) in the form of ``outputs[i]["lineage"]``:
    ``[output_column, input dataset id, input_column, kind]`` rows; ``inputs``
    maps the names to the ids (a task's ``inputs[j]`` entries carry both)."""
    rows = []
    for edge in merge_edges(edges):
        if edge.input_dataset not in inputs:
            raise InvalidInput("lineage", f"{edge.input_dataset!r} is not an input of the task")
        dataset = str(inputs[edge.input_dataset])
        rows.append([edge.output_column, dataset, edge.input_column, edge.kind])
    return rows


def take_lineage(
    outputs: Sequence[Mapping[str, Any]] | None, output_datasets: Sequence[uuid.UUID | str]
) -> tuple[list[Mapping[str, Any]] | None, list[OutputLineage]]:
    """``outputs`` without their ``lineage`` entries, and those entries, output
    ``i`` belonging to ``output_datasets[i]`` (the task's payload outputs).

    Raises :class:`~trace_core.errors.InvalidInput` naming the field of a
    malformed entry or of an output the task does not have.
    """
    if outputs is None:
        return None, []
    kept: list[Mapping[str, Any]] = []
    found = []
    for i, output in enumerate(outputs):
        if not isinstance(output, Mapping) or "lineage" not in output:
            kept.append(output)
            continue
        at = f"outputs[{i}].lineage"
        if i >= len(output_datasets):
            raise InvalidInput(at, f"the task has {len(output_datasets)} outputs")
        kept.append({k: v for k, v in output.items() if k != "lineage"})
        found.append(
            OutputLineage(uuid.UUID(str(output_datasets[i])), _edges(output["lineage"], at))
        )
    return kept, found


def _edges(raw: Any, at: str) -> tuple[ColumnEdge, ...]:
    if not isinstance(raw, list):
        raise InvalidInput(at, "must be a list of [output_column, dataset id, column, kind]")
    edges = []
    for j, row in enumerate(raw):
        if (
            not isinstance(row, list | tuple)
            or len(row) != 4
            or not all(isinstance(v, str) and v for v in row)
        ):
            raise InvalidInput(f"{at}[{j}]", "must be [output_column, dataset id, column, kind]")
        out, dataset, column, kind = row
        try:
            uuid.UUID(dataset)
        except ValueError:
            raise InvalidInput(f"{at}[{j}][1]", "must be a dataset id") from None
        if kind not in DIRECT_KINDS + INDIRECT_KINDS:
            raise InvalidInput(f"{at}[{j}][3]", f"unknown kind {kind!r}")
        edges.append(ColumnEdge(out, dataset, column, kind))
    return tuple(merge_edges(edges))
