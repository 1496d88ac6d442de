"""Column lineage as OpenLineage run events (JSON), to a file or an HTTP endpoint.

One ``COMPLETE`` run event per output dataset with recorded lineage: the
producing job (``namespace`` ``trace://<org>``, ``name`` ``<dag>.<job>``),
its input datasets, and the output with the ``columnLineage`` dataset facet
(ColumnLineageDatasetFacet 1-2-0): ``fields`` maps each output column to its
``inputFields``; dataset-wide (indirect) dependencies go to the facet's
``dataset`` list with ``type: INDIRECT``. The JSON is built to the published
spec's shape; no client library is needed for that (see docs/lineage.md).

The ``column_lineage`` table keeps no kind, so exported direct edges carry
``type: DIRECT`` without a subtype.
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from trace_core.dag.lineage import DATASET_WIDE
from trace_core.errors import InvalidInput
from trace_core.storage.ports import LineageRow

__all__ = [
    "COLUMN_LINEAGE_FACET_URL",
    "PRODUCER",
    "RUN_EVENT_SCHEMA_URL",
    "openlineage_events",
    "send_events",
]

PRODUCER = "https://github.com/trace/trace/tree/main/trace_lite"
"""The ``producer`` / ``_producer`` URI of the events Trace writes."""

RUN_EVENT_SCHEMA_URL = "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunEvent"
COLUMN_LINEAGE_FACET_URL = (
    "https://openlineage.io/spec/facets/1-2-0/ColumnLineageDatasetFacet.json"
    "#/$defs/ColumnLineageDatasetFacet"
)


def openlineage_events(
    rows: Iterable[LineageRow],
    *,
    org: str,
    jobs: Mapping[uuid.UUID, str],
    event_time: datetime,
) -> list[dict[str, Any]]:
    """One run event per output dataset of ``rows``; ``jobs`` names the
    producing jobs (``dag.job``) by id."""
    namespace = f"trace://{org}"
    by_output: dict[uuid.UUID, list[LineageRow]] = {}
    for row in rows:
        by_output.setdefault(row.output_dataset, []).append(row)
    events = []
    for dataset, edges in sorted(by_output.items(), key=lambda kv: kv[1][0].output_name):
        job_id = edges[0].job_id
        fields: dict[str, dict[str, Any]] = {}
        wide = []
        for e in sorted(edges):
            source = {"namespace": namespace, "name": e.input_name, "field": e.input_column}
            if e.output_column == DATASET_WIDE:
                wide.append({**source, "transformations": [{"type": "INDIRECT"}]})
                continue
            field = fields.setdefault(e.output_column, {"inputFields": []})
            field["inputFields"].append({**source, "transformations": [{"type": "DIRECT"}]})
        facet: dict[str, Any] = {
            "_producer": PRODUCER,
            "_schemaURL": COLUMN_LINEAGE_FACET_URL,
            "fields": fields,
        }
        if wide:
            facet["dataset"] = wide
        inputs = sorted({e.input_name for e in edges})
        events.append(
            {
                "eventType": "COMPLETE",
                "eventTime": event_time.isoformat(),
                "producer": PRODUCER,
                "schemaURL": RUN_EVENT_SCHEMA_URL,
                "run": {"runId": str(uuid.uuid5(uuid.NAMESPACE_URL, f"{namespace}/{dataset}"))},
                "job": {
                    "namespace": namespace,
                    "name": jobs.get(job_id, "unknown") if job_id else "unknown",
                },
                "inputs": [{"namespace": namespace, "name": name} for name in inputs],
                "outputs": [
                    {
                        "namespace": namespace,
                        "name": edges[0].output_name,
                        "facets": {"columnLineage": facet},
                    }
                ],
            }
        )
    return events


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
