"""The chain pipeline's reference, for tests and benchmarks of the lite platform.

``examples/chain_pipeline.yaml`` scaled down (:func:`small_dag`), and what its
outputs must be, computed with plain pyarrow (no Spark): every Parquet
partition (:func:`reference_partition`, :func:`read_partition`,
:func:`check_outputs`) and every alert (:func:`expected_alerts`,
:func:`stored_alerts`). The pipeline tests assert with these; the ``lite-kill``
chaos benchmark counts what is missing with them.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from contextlib import closing
from pathlib import Path
from typing import Any

import anyio
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from trace_core.storage.sql import SqlRepository
from trace_lite.pipeline.chain import BLOCK_SCHEMA, TRANSACTION_SCHEMA, SyntheticChain, conform
from trace_lite.pipeline.cryo import cryo_file_name, partition_ranges
from trace_lite.pipeline.operators import alert_records, alert_rules
from trace_lite.pipeline.predicate import parse_where
from trace_lite.pipeline.reference import reference_aggregates
from trace_lite.pipeline.transforms import AGGREGATE_SCHEMA
from trace_lite.status import DatasetStatus, dataset_statuses

__all__ = [
    "EXAMPLE",
    "PARQUET_DATASETS",
    "chain_statuses",
    "check_outputs",
    "example_chain",
    "expected_alerts",
    "object_dir",
    "read_partition",
    "reference_partition",
    "small_dag",
    "stored_alerts",
]

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "chain_pipeline.yaml"
"""The example DAG every piece here derives from (in a checkout of the repository)."""

_SCHEMAS = {
    "blocks": BLOCK_SCHEMA,
    "transactions": TRANSACTION_SCHEMA,
    "range_aggregates": AGGREGATE_SCHEMA,
}
PARQUET_DATASETS = tuple(_SCHEMAS)
"""The example's datasets written as Parquet objects, one per partition."""


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


def _job(name: str) -> dict[str, Any]:
    doc = yaml.safe_load(EXAMPLE.read_text())
    return dict(next(j for j in doc["jobs"] if j["name"] == name))


def example_chain() -> SyntheticChain:
    """The chain of the example DAG's follower config."""
    config = _job("follow")["config"]
    return SyntheticChain(
        seed=config["seed"],
        chain_id=config["chain_id"],
        mean_txs_per_block=config["mean_txs_per_block"],
    )


def _aggregate_where() -> str:
    return str(_job("aggregate")["inputs"][1]["where"])


def object_dir(data_dir: Path, status: DatasetStatus) -> Path:
    """Where a dataset version's objects are in the lite object store."""
    bucket, _, prefix = status.location.removeprefix("s3://").partition("/")
    return data_dir / "objects" / bucket / prefix


def reference_partition(chain: SyntheticChain, name: str, start: int, end: int) -> pa.Table:
    """What partition ``start..end`` of the Parquet dataset ``name`` must hold."""
    if name == "range_aggregates":
        return reference_aggregates(chain, start, end, transactions_where=_aggregate_where())
    return chain.blocks(start, end) if name == "blocks" else chain.transactions(start, end)


def read_partition(data_dir: Path, status: DatasetStatus, start: int, end: int) -> pa.Table | None:
    """Partition ``start..end`` of a Parquet dataset version, conformed to its
    schema; ``None`` when its object is missing."""
    path = object_dir(data_dir, status) / cryo_file_name(status.name, start, end)
    if not path.is_file():
        return None
    return conform(pq.read_table(path), _SCHEMAS[status.name])


def check_outputs(data_dir: Path, statuses: list[DatasetStatus], blocks: int, size: int) -> None:
    """Every partition of every Parquet dataset equals the reference, and there
    is exactly one object per partition (named the Cryo way)."""
    chain = example_chain()
    by_name = {s.name: s for s in statuses if s.dag_version_status == "current"}
    ranges = partition_ranges(0, blocks - 1, size)
    for name in PARQUET_DATASETS:
        directory = object_dir(data_dir, by_name[name])
        # Dot-names are writes in progress (or cut off): never visible as objects.
        names = sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))
        assert names == [cryo_file_name(name, a, b) for a, b in ranges], name
    for start, end in ranges:
        for name in PARQUET_DATASETS:
            got = read_partition(data_dir, by_name[name], start, end)
            expected = reference_partition(chain, name, start, end)
            assert got is not None and got.equals(expected), (name, start, end)


def expected_alerts(blocks: int, size: int) -> set[tuple[str, str, int, float]]:
    """``(dedupe_key, severity, block_number, value)`` of every alert the
    example's rules raise over the reference aggregates."""
    chain = example_chain()
    alerts = _job("alerts")
    where = parse_where(alerts["inputs"][0]["where"]).to_arrow()
    rules = alert_rules(alerts["config"])
    found = set()
    for start, end in partition_ranges(0, blocks - 1, size):
        table = reference_partition(chain, "range_aggregates", start, end)
        for record in alert_records(table.filter(where), rules, f"{start}-{end}"):
            found.add(
                (record["dedupe_key"], record["severity"], record["block_number"], record["value"])
            )
    return found


def stored_alerts(data_db: Path, table: str) -> list[tuple[str, str, int, float]]:
    """The rows of a buffered alerts table in the SQLite data database (none
    when the table is missing: the sink creates it with its first row)."""
    exists = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"
    with closing(sqlite3.connect(data_db)) as conn:
        if not conn.execute(exists, (table,)).fetchone():
            return []
        return [
            (key, severity, int(block), float(value))
            for key, severity, block, value in conn.execute(
                f'SELECT dedupe_key, severity, block_number, value FROM "{table}"'
            )
        ]


def chain_statuses(database_url: str) -> list[DatasetStatus]:
    """The statuses of the ``chain`` DAG's datasets in a state database (from
    synchronous code: a test or a benchmark driving ``trace-lite run`` processes)."""

    async def read() -> list[DatasetStatus]:
        repo = SqlRepository(database_url)
        try:
            return await dataset_statuses(repo, "chain")
        finally:
            await repo.close()

    return anyio.run(read)
