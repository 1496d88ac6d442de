"""Column lineage of the lite profile's operators, in the form a result reports it.

An operator adds ``lineage`` to its result's ``outputs[i]``
(:func:`~trace_core.dag.lineage.lineage_output` rows); the control plane
records it with the completion (:mod:`trace_core.dag.lineage_record`).

- Spark operators derive it from the output DataFrame's analyzed plan
  (:func:`spark_output_lineage`), on classic and Spark Connect sessions,
  once per job and output version in a process (every partition of a
  version runs the same plan).
- Other operators declare it in code, or the job's ``config.lineage``
  overrides it (:func:`declared_output_lineage`, the form of
  :func:`~trace_core.dag.lineage.parse_declared`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from trace_core.dag.lineage import ColumnEdge, lineage_output, parse_declared

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["declared_output_lineage", "input_ids", "spark_output_lineage"]

log = logging.getLogger(__name__)

_derived: dict[tuple[str, str], list[list[str]]] = {}
_lock = threading.Lock()
_MEMO_LIMIT = 1024


def input_ids(inputs: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """dataset name → dataset id, of a task's payload inputs."""
    return {
        str(item["dataset"]): str(item["dataset_uuid"])
        for item in inputs
        if item.get("dataset") and item.get("dataset_uuid")
    }


def spark_output_lineage(
    output: DataFrame,
    frames: Mapping[str, DataFrame],
    *,
    job: Mapping[str, Any],
    output_entry: Mapping[str, Any],
    inputs: Sequence[Mapping[str, Any]],
) -> list[list[str]] | None:
    """The lineage rows of ``output`` over ``frames`` (the inputs as read, by
    dataset name), or ``None`` where no plan can be read (logged)."""
    from trace_lite.lineage_spark import LineageUnavailable, derive_lineage

    key = (str(job.get("id")), str(output_entry.get("dataset_version")))
    with _lock:
        if key in _derived:
            return _derived[key]
    try:
        rows = lineage_output(derive_lineage(output, frames), input_ids(inputs))
    except LineageUnavailable as exc:
        log.info("job %s: no column lineage derived: %s", key[0], exc)
        return None
    with _lock:
        if len(_derived) >= _MEMO_LIMIT:
            _derived.clear()
        _derived[key] = rows
    return rows


def declared_output_lineage(
    config: Mapping[str, Any],
    inputs: Sequence[Mapping[str, Any]],
    default: Sequence[ColumnEdge],
) -> list[list[str]]:
    """``config.lineage`` (validated) when the job declares it, else ``default``."""
    ids = input_ids(inputs)
    raw = config.get("lineage")
    declared = (
        None if raw is None else parse_declared(raw, inputs=list(ids), field="config.lineage")
    )
    return lineage_output(default if declared is None else declared, ids)
