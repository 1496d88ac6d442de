"""Column lineage as OpenLineage run events (JSON), to a file or an HTTP endpoint.

One ``COMPLETE`` run event per output dataset version with recorded
lineage: the producing job (``namespace`` ``trace://<org>``, ``name``
``<dag>.<job>``), its input datasets, and the output with the
``columnLineage`` dataset facet (ColumnLineageDatasetFacet 1-2-0) and the
``version`` facet (the dataset version). ``fields`` maps each output column to
its ``inputFields``; dataset-wide (indirect) dependencies go to the facet's
``dataset`` list. Each input field carries its ``transformations``: the
edge's kind as OpenLineage's ``type`` (``DIRECT`` / ``INDIRECT``) and
``subtype`` (``IDENTITY``, ``AGGREGATION``, ``FILTER``, ``JOIN`` ...; a row
recorded before kinds were kept has a type only). The JSON is built to the
published spec's shape; no client library is needed for that (see
docs/lineage.md).
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from trace_core.dag.lineage import DATASET_WIDE, INDIRECT_KINDS
from trace_core.errors import InvalidInput
from trace_core.storage.ports import LineageRow

__all__ = [
    "COLUMN_LINEAGE_FACET_URL",
    "PRODUCER",
    "RUN_EVENT_SCHEMA_URL",
    "VERSION_FACET_URL",
    "openlineage_events",
    "send_events",
    "transformation",
]

PRODUCER = "https://github.com/trace/trace/tree/main/trace_lite"
"""The ``producer`` / ``_producer`` URI of the events Trace writes."""

RUN_EVENT_SCHEMA_URL = "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunEvent"
COLUMN_LINEAGE_FACET_URL = (
    "https://openlineage.io/spec/facets/1-2-0/ColumnLineageDatasetFacet.json"
    "#/$defs/ColumnLineageDatasetFacet"
)
VERSION_FACET_URL = (
    "https://openlineage.io/spec/facets/1-0-1/DatasetVersionDatasetFacet.json"
    "#/$defs/DatasetVersionDatasetFacet"
)
_UNTYPED = ("DIRECT", "INDIRECT")  # kinds of rows recorded before kinds were kept


def transformation(kind: str) -> dict[str, str]:
    """The facet's ``transformations`` entry of an edge of ``kind``."""
    if kind in _UNTYPED:
        return {"type": kind}
    return {"type": "INDIRECT" if kind in INDIRECT_KINDS else "DIRECT", "subtype": kind}


def openlineage_events(
    rows: Iterable[LineageRow],
    *,
    org: str,
    jobs: Mapping[uuid.UUID, str],
    event_time: datetime,
) -> list[dict[str, Any]]:
    """One run event per output dataset (and version) of ``rows``; ``jobs``
    names the producing jobs (``dag.job``) by id."""
    namespace = f"trace://{org}"
    by_output: dict[tuple[uuid.UUID, uuid.UUID | None], list[LineageRow]] = {}
    for row in rows:
        by_output.setdefault((row.output_dataset, row.dataset_version), []).append(row)
    events = []
    for (dataset, version), edges in sorted(
        by_output.items(), key=lambda kv: (kv[1][0].output_name, str(kv[0][1]))
    ):
        job_id = edges[0].job_id
        fields: dict[str, list[dict[str, Any]]] = {}
        for e in sorted(edges):
            # one entry per input field, with every kind it has (a JOIN and GROUP_BY key)
            sources = fields.setdefault(e.output_column, [])
            source = {"namespace": namespace, "name": e.input_name, "field": e.input_column}
            entry = next((s for s in sources if _same(s, source)), None)
            if entry is None:
                entry = {**source, "transformations": []}
                sources.append(entry)
            entry["transformations"].append(transformation(e.kind))
        wide = fields.pop(DATASET_WIDE, [])
        facet: dict[str, Any] = {
            "_producer": PRODUCER,
            "_schemaURL": COLUMN_LINEAGE_FACET_URL,
            "fields": {column: {"inputFields": s} for column, s in fields.items()},
        }
        if wide:
            facet["dataset"] = wide
        facets: dict[str, Any] = {"columnLineage": facet}
        if version is not None:
            facets["version"] = {
                "_producer": PRODUCER,
                "_schemaURL": VERSION_FACET_URL,
                "datasetVersion": str(version),
            }
        inputs = sorted({e.input_name for e in edges})
        run = f"{namespace}/{dataset}" + ("" if version is None else f"/{version}")
        events.append(
            {
                "eventType": "COMPLETE",
                "eventTime": event_time.isoformat(),
                "producer": PRODUCER,
                "schemaURL": RUN_EVENT_SCHEMA_URL,
                "run": {"runId": str(uuid.uuid5(uuid.NAMESPACE_URL, run))},
                "job": {
                    "namespace": namespace,
                    "name": jobs.get(job_id, "unknown") if job_id else "unknown",
                },
                "inputs": [{"namespace": namespace, "name": name} for name in inputs],
                "outputs": [
                    {"namespace": namespace, "name": edges[0].output_name, "facets": facets}
                ],
            }
        )
    return events


def _same(entry: Mapping[str, Any], source: Mapping[str, str]) -> bool:
    return all(entry[k] == v for k, v in source.items())


def send_events(events: Sequence[Mapping[str, Any]], target: str, *, timeout: float = 10) -> None:
    """Write ``events`` to ``target``: an ``http(s)://`` endpoint (one POST per
    event, as OpenLineage's HTTP transport does, e.g. Marquez's
    ``/api/v1/lineage``) or a file (one JSON event per line)."""
    if target.startswith(("http://", "https://")):
        for event in events:
            request = urllib.request.Request(
                target,
                data=json.dumps(event).encode(),
                headers={"Content-Type": "application/json"},
                method="POST",
            )
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                if answer.status >= 300:
                    raise InvalidInput("--openlineage", f"{target} answered {answer.status}")
        return
    if "://" in target:
        raise InvalidInput("--openlineage", "must be a file path or an http(s):// URL")
    Path(target).write_text("".join(json.dumps(e, sort_keys=True) + "\n" for e in events))
