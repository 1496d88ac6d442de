"""Recording the column lineage an operator reported with its completion.

The completion that commits an output (its final events, in one
transaction) records the lineage reported in ``outputs[i]["lineage"]`` for
the job's output ``i``; the entry is taken out of the outputs kept on the
task, with each edge's kind, for the dataset version the task's DAG
version points at: a rematerialization (a new dataset version, a new
operator) records its own next to the older version's (reads answer the
current version's). A repeated completion of the same version replaces it.
If the completion is refused (a stale attempt), the transaction rolls back
and nothing is recorded.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from trace_core.dag.lineage import take_lineage
from trace_core.errors import InvalidInput, NotFound
from trace_core.storage.ports.lineage import NewLineageEdge
from trace_core.storage.protocol import Transaction

__all__ = ["carries_lineage", "record_output_lineage"]

log = logging.getLogger(__name__)


def carries_lineage(outputs: Sequence[Mapping[str, Any]] | None) -> bool:
    """Whether any of ``outputs`` reports lineage."""
    return any(isinstance(o, Mapping) and "lineage" in o for o in outputs or ())


async def record_output_lineage(
    tx: Transaction, task_id: uuid.UUID, outputs: Sequence[Mapping[str, Any]] | None
) -> Sequence[Mapping[str, Any]] | None:
    """Record the lineage in ``outputs`` of task ``task_id`` in ``tx``; the
    outputs without it. An unknown task records nothing (its completion fails).

    Raises :class:`~trace_core.errors.InvalidInput` for malformed lineage or
    an edge from a dataset the job does not read."""
    if not carries_lineage(outputs):
        return outputs
    task = await tx.lineage.task_outputs(task_id)
    if task is None:
        return [{k: v for k, v in o.items() if k != "lineage"} for o in outputs or ()]
    kept, found = take_lineage(outputs, task.output_datasets)
    versions = dict(zip(task.output_datasets, task.output_versions, strict=False))
    for item in found:
        edges = [
            NewLineageEdge(e.output_column, uuid.UUID(e.input_dataset), e.input_column, e.kind)
            for e in item.edges
        ]
        # a worker names only datasets its job reads (never another org's)
        foreign = {e.input_dataset for e in edges} - task.input_datasets
        if foreign:
            names = ", ".join(sorted(map(str, foreign)))
            raise InvalidInput("outputs.lineage", f"datasets {names} are not inputs of the job")
        try:
            await tx.lineage.record(
                item.dataset_uuid,
                task.job_id,
                edges,
                dataset_version=versions.get(item.dataset_uuid),
            )
        except NotFound:
            # No version of the output to hang the lineage on: bookkeeping
            # must not fail the completion that commits the output.
            log.warning(
                "task %s: lineage of dataset %s not recorded: no version",
                task_id,
                item.dataset_uuid,
            )
    return kept
