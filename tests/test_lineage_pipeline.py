"""The chain pipeline records its column lineage; ``trace-lite lineage`` reads
it and exports it as OpenLineage run events, on both engines.

The expected table is what the operators compute: ``range_aggregator``'s
Spark plan (derived) and ``alert_evaluate``'s rules (declared in code).
"""

from __future__ import annotations

import http.server
import io
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.lite_pipeline import small_dag
from tests.test_lineage import check_run_event
from tests.test_lite_pipeline import _config
from trace_core.storage.sql import SqlRepository
from trace_lite.cli import main
from trace_lite.run_command import RunOptions, run_pipeline
from trace_lite.spark import SparkSessionProvider

pytestmark = pytest.mark.anyio

AGGREGATES = {
    ("block_number", "blocks", "block_number"),
    ("timestamp", "blocks", "timestamp"),
    ("tx_count", "transactions", "*"),
    ("success_count", "transactions", "success"),
    ("failed_count", "transactions", "success"),
    ("total_value", "transactions", "value"),
    ("total_gas_used", "transactions", "gas_used"),
    ("max_gas_price", "transactions", "gas_price"),
    ("unique_senders", "transactions", "from_address"),
    # the rows: the input's where (value > 0), the grouping, the join, the order
    ("*", "transactions", "value"),
    ("*", "transactions", "block_number"),
    ("*", "blocks", "block_number"),
}
ALERTS = {
    ("block_number", "range_aggregates", "block_number"),
    ("dedupe_key", "range_aggregates", "block_number"),
    ("value", "range_aggregates", "tx_count"),
    ("value", "range_aggregates", "failed_count"),
    # the rules' thresholds and the input's where (tx_count > 30) pick the rows
    ("*", "range_aggregates", "tx_count"),
    ("*", "range_aggregates", "failed_count"),
}


def expected_alerts_upstream() -> set[tuple[str, str, str, str]]:
    """``(output, column, input, column)`` upstream of ``alerts``: the columns
    alerts read, and what decides their rows, back to the sources."""
    read = {"block_number", "tx_count", "failed_count", "*"}
    expected = {("alerts", *e) for e in ALERTS}
    expected |= {("range_aggregates", *e) for e in AGGREGATES if e[0] in read}
    return expected


async def alerts_upstream(database_url: str) -> list[Any]:
    """The recorded lineage upstream of the default org's ``alerts`` dataset."""
    repo = SqlRepository(database_url)
    try:
        async with repo.read() as tx:
            org = await tx.registry.find_org("default")
            assert org is not None
            (alerts,) = await tx.registry.datasets_named_or_produced_by(org, names=["alerts"])
            return list(await tx.lineage.upstream(alerts.dataset_uuid))
    finally:
        await repo.close()


class _Collector(http.server.BaseHTTPRequestHandler):
    received: list[Any]

    def do_POST(self) -> None:
        length = int(self.headers["Content-Length"])
        self.received.append(json.loads(self.rfile.read(length)))
        self.send_response(201)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def collector() -> Iterator[tuple[str, list[Any]]]:
    """A real HTTP endpoint that keeps what is POSTed to it."""
    received: list[Any] = []
    handler = type("Handler", (_Collector,), {"received": received})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/api/v1/lineage", received
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


async def test_the_chain_pipeline_lineage_is_recorded_read_and_exported(
    tmp_path: Path,
    database_url: str,
    spark_provider: SparkSessionProvider,
    capsys: pytest.CaptureFixture[str],
    collector: tuple[str, list[Any]],
) -> None:
    dag = tmp_path / "chain.yaml"
    dag.write_text(small_dag(400, 200))
    config = _config(tmp_path, database_url)
    options = RunOptions(dag, config, timeout_seconds=240, refresh_seconds=0.2)
    out = io.StringIO()
    assert (await run_pipeline(options, out, spark=spark_provider)).finished, out.getvalue()

    rows = await alerts_upstream(database_url)
    stored = {(r.output_name, r.output_column, r.input_name, r.input_column) for r in rows}
    assert stored == expected_alerts_upstream()
    kinds = {(r.output_name, r.output_column, r.input_name, r.input_column, r.kind) for r in rows}
    assert {
        ("range_aggregates", "tx_count", "transactions", "*", "AGGREGATION"),
        ("range_aggregates", "*", "transactions", "value", "FILTER"),
        ("range_aggregates", "*", "transactions", "block_number", "GROUP_BY"),
        ("range_aggregates", "*", "transactions", "block_number", "JOIN"),
        ("alerts", "value", "range_aggregates", "tx_count", "IDENTITY"),
    } <= kinds
    # each recorded for the version it committed (one per dataset here)
    assert None not in {r.dataset_version for r in rows}

    capsys.readouterr()
    db = ["--db", database_url]
    argv = ["lineage", "range_aggregates", "tx_count", *db]
    assert await anyio.to_thread.run_sync(main, argv) == 0
    text = capsys.readouterr().out
    up, down = text.split("downstream of range_aggregates.tx_count")
    assert "upstream of range_aggregates.tx_count" in up
    assert "range_aggregates.tx_count  transactions.*" in up
    (line,) = [x for x in up.splitlines() if "range_aggregates.tx_count  transactions.*" in x]
    assert line.split()[-1] == "AGGREGATION"  # the kind column
    assert "range_aggregates (rows)    transactions.value" in up
    assert "success" not in up  # another column's source
    assert "alerts.value" in down and "alerts (rows)" in down

    exported = tmp_path / "lineage.jsonl"
    url, received = collector
    for target in (str(exported), url):
        argv = ["lineage", "alerts", "--direction", "up", "--openlineage", target, *db]
        assert await anyio.to_thread.run_sync(main, argv) == 0
    events = [json.loads(line) for line in exported.read_text().splitlines()]
    # the same events (each export stamps its own time)
    assert [{**e, "eventTime": None} for e in received] == [
        {**e, "eventTime": None} for e in events
    ]
    assert [e["outputs"][0]["name"] for e in events] == ["alerts", "range_aggregates"]
    for event in events:
        check_run_event(event)
    facet = events[0]["outputs"][0]["facets"]["columnLineage"]
    assert {f["name"] + "." + f["field"] for f in facet["fields"]["value"]["inputFields"]} == {
        "range_aggregates.tx_count",
        "range_aggregates.failed_count",
    }
    subtypes = {
        t.get("subtype")
        for f in facet["fields"]["value"]["inputFields"]
        for t in f["transformations"]
    }
    assert subtypes == {"IDENTITY"}
    assert events[0]["job"] == {"namespace": "trace://default", "name": "chain.alerts"}

    assert await anyio.to_thread.run_sync(main, ["lineage", "nope", *db]) == 1
