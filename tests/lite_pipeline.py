"""Helpers of the lite pipeline tests: a small copy of the example DAG, and the
reference every output is checked against (plain pyarrow, no Spark)."""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from trace_lite.pipeline.chain import BLOCK_SCHEMA, TRANSACTION_SCHEMA, SyntheticChain, conform
from trace_lite.pipeline.cryo import cryo_file_name, partition_ranges
from trace_lite.pipeline.operators import alert_records, alert_rules
from trace_lite.pipeline.predicate import parse_where
from trace_lite.pipeline.reference import reference_aggregates
from trace_lite.pipeline.transforms import AGGREGATE_SCHEMA
from trace_lite.status import DatasetStatus

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "chain_pipeline.yaml"


def small_dag(
    blocks: int = 1200,
    partition_size: int = 400,
    *,
    aggregate_config: Mapping[str, Any] | None = None,
    operators: Mapping[str, str] | None = None,
    heartbeat: str | None = None,
) -> str:
    """The example DAG over ``blocks`` blocks in ``partition_size`` ranges;
    ``operators`` renames job operators, ``heartbeat`` shortens every job's
    heartbeat timeout (and so its leases)."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    for job in doc["jobs"]:
        if job["name"] == "follow":
            job["config"]["partition_size"] = partition_size
            for output in job["outputs"]:
                output["range"] = {"start": 0, "end": blocks - 1}
        if job["name"] == "aggregate" and aggregate_config is not None:
            job["config"] = dict(aggregate_config)
        if operators and job["name"] in operators:
            job["operator"] = operators[job["name"]]
        if heartbeat is not None:
            job["heartbeat_timeout_seconds"] = heartbeat
    return str(yaml.safe_dump(doc, sort_keys=False))


def example_chain() -> SyntheticChain:
    """The chain of the example DAG's follower config."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    config = next(j for j in doc["jobs"] if j["name"] == "follow")["config"]
    return SyntheticChain(
        seed=config["seed"],
        chain_id=config["chain_id"],
        mean_txs_per_block=config["mean_txs_per_block"],
    )


def _job(name: str) -> dict[str, Any]:
    doc = yaml.safe_load(EXAMPLE.read_text())
    return dict(next(j for j in doc["jobs"] if j["name"] == name))


def object_dir(data_dir: Path, status: DatasetStatus) -> Path:
    """Where a dataset version's objects are in the lite object store."""
    bucket, _, prefix = status.location.removeprefix("s3://").partition("/")
    return data_dir / "objects" / bucket / prefix


def check_outputs(data_dir: Path, statuses: list[DatasetStatus], blocks: int, size: int) -> None:
    """Every partition of every Parquet dataset equals the reference, and there
    is exactly one object per partition (named the Cryo way)."""
    chain = example_chain()
    where = _job("aggregate")["inputs"][1]["where"]
    by_name = {s.name: s for s in statuses if s.dag_version_status == "current"}
    ranges = partition_ranges(0, blocks - 1, size)
    for name in ("blocks", "transactions", "range_aggregates"):
        directory = object_dir(data_dir, by_name[name])
        # Dot-names are writes in progress (or cut off): never visible as objects.
        names = sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))
        assert names == [cryo_file_name(name, a, b) for a, b in ranges], name

    def read(name: str, schema: pa.Schema, start: int, end: int) -> pa.Table:
        path = object_dir(data_dir, by_name[name]) / cryo_file_name(name, start, end)
        return conform(pq.read_table(path), schema)

    for start, end in ranges:
        assert read("blocks", BLOCK_SCHEMA, start, end).equals(chain.blocks(start, end))
        txs = read("transactions", TRANSACTION_SCHEMA, start, end)
        assert txs.equals(chain.transactions(start, end))
        expected = reference_aggregates(chain, start, end, transactions_where=where)
        got = read("range_aggregates", AGGREGATE_SCHEMA, start, end)
        assert got.equals(expected), (start, end)


def expected_alerts(blocks: int, size: int) -> set[tuple[str, str, int, float]]:
    """``(dedupe_key, severity, block_number, value)`` of every alert the
    example's rules raise over the reference aggregates."""
    chain = example_chain()
    aggregate_where = _job("aggregate")["inputs"][1]["where"]
    alerts = _job("alerts")
    where = parse_where(alerts["inputs"][0]["where"]).to_arrow()
    rules = alert_rules(alerts["config"])
    found = set()
    for start, end in partition_ranges(0, blocks - 1, size):
        table = reference_aggregates(chain, start, end, transactions_where=aggregate_where)
        for record in alert_records(table.filter(where), rules, f"{start}-{end}"):
            found.add(
                (record["dedupe_key"], record["severity"], record["block_number"], record["value"])
            )
    return found


def stored_alerts(data_db: Path, table: str) -> list[tuple[str, str, int, float]]:
    """The rows of a buffered alerts table in the SQLite data database."""
    with sqlite3.connect(data_db) as conn:
        return [
            (key, severity, int(block), float(value))
            for key, severity, block, value in conn.execute(
                f'SELECT dedupe_key, severity, block_number, value FROM "{table}"'
            )
        ]
