"""The chain pipeline's data work as a plain PySpark script: no orchestration.

:func:`plain_spark_pipeline` does, one block range after another, what the
three operators of ``examples/chain_pipeline.yaml`` do to data: generate the
range with :class:`~trace_lite.pipeline.chain.SyntheticChain`, write blocks
and transactions Parquet with Spark (:func:`write_arrow_parquet`), read them
back with Spark through the aggregator's ``where`` filters, write the per-block
aggregates (:func:`aggregate_blocks`, :func:`commit_parquet`), read them with
pyarrow through the alert job's filter, evaluate its rules
(:func:`alert_records`) and insert the alerts into a SQLite table,
deduplicated on ``dedupe_key`` (the pipeline's sink writes a table of the
data database). Files are named as the pipeline names them
(:func:`cryo_file_name`), under ``out_dir/<dataset>/``.

:class:`PipelineSpec` reads what to do from the DAG YAML, so both sides of
the benchmark run the same configuration.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.parquet as pq
import yaml

from trace_lite.pipeline.chain import SyntheticChain
from trace_lite.pipeline.cryo import cryo_file_name, partition_ranges
from trace_lite.pipeline.operators import AlertRule, alert_records, alert_rules
from trace_lite.pipeline.predicate import parse_where
from trace_lite.pipeline.transforms import aggregate_blocks, commit_parquet, write_arrow_parquet

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = [
    "AGGREGATES",
    "BLOCKS",
    "TRANSACTIONS",
    "PipelineSpec",
    "PlainResult",
    "plain_alert_keys",
    "plain_spark_pipeline",
    "with_partition_size",
]

BLOCKS, TRANSACTIONS, AGGREGATES = "blocks", "transactions", "range_aggregates"
"""The datasets of the example DAG (and the plain script's directories)."""

_FOLLOWER_DEFAULT_PARTITION = 1000  # block_follower's default partition_size


def _jobs(doc: Any) -> list[dict[str, Any]]:
    jobs = doc.get("jobs") if isinstance(doc, dict) else None
    if not isinstance(jobs, list):
        raise ValueError("the DAG has no jobs")
    return [j for j in jobs if isinstance(j, dict)]


def _job(doc: Any, operator: str) -> dict[str, Any]:
    found = [j for j in _jobs(doc) if j.get("operator") == operator]
    if len(found) != 1:
        raise ValueError(f"the DAG needs exactly one {operator} job, has {len(found)}")
    return found[0]


def with_partition_size(text: str, size: int) -> str:
    """The DAG YAML with the ``block_follower`` job's ``config.partition_size`` set."""
    if size < 1:
        raise ValueError("partition size must be >= 1")
    doc = yaml.safe_load(text)
    job = _job(doc, "block_follower")
    config = job.get("config")
    job["config"] = {**(config if isinstance(config, dict) else {}), "partition_size": size}
    return str(yaml.safe_dump(doc, sort_keys=False))


def _where(item: Any) -> str | None:
    where = item.get("where") if isinstance(item, dict) else None
    return str(where) if where else None


@dataclass(frozen=True)
class PipelineSpec:
    """What the example DAG computes, read from its YAML."""

    chain: SyntheticChain
    partition_size: int
    start: int
    end: int
    blocks_where: str | None
    transactions_where: str | None
    aggregates_where: str | None
    rules: tuple[AlertRule, ...]

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """The block ranges the follower writes, in order."""
        return partition_ranges(self.start, self.end, self.partition_size)

    @classmethod
    def from_yaml(cls, text: str) -> PipelineSpec:
        doc = yaml.safe_load(text)
        follower = _job(doc, "block_follower")
        config: Mapping[str, Any] = follower.get("config") or {}
        span = follower["outputs"][0]["range"]
        inputs = _job(doc, "range_aggregator").get("inputs") or []
        if len(inputs) != 2:
            raise ValueError("range_aggregator reads two inputs (blocks, transactions)")
        alerts = _job(doc, "alert_evaluate")
        alert_inputs = alerts.get("inputs") or []
        if len(alert_inputs) != 1:
            raise ValueError("alert_evaluate reads one input")
        return cls(
            chain=SyntheticChain(
                seed=int(config.get("seed", 0)),
                chain_id=int(config.get("chain_id", 1)),
                mean_txs_per_block=int(config.get("mean_txs_per_block", 20)),
            ),
            partition_size=int(config.get("partition_size", _FOLLOWER_DEFAULT_PARTITION)),
            start=int(span["start"]),
            end=int(span["end"]),
            blocks_where=_where(inputs[0]),
            transactions_where=_where(inputs[1]),
            aggregates_where=_where(alert_inputs[0]),
            rules=tuple(alert_rules(alerts.get("config") or {})),
        )


@dataclass
class PlainResult:
    """What :func:`plain_spark_pipeline` did, with seconds per phase."""

    ranges: int = 0
    blocks: int = 0
    transactions: int = 0
    aggregate_rows: int = 0
    alerts: int = 0
    seconds: float = 0.0
    phases: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(
            ("generate", "write_inputs", "aggregate", "alerts"), 0.0
        )
    )


_ALERT_COLUMNS = (
    "dedupe_key",
    "rule",
    "severity",
    "block_number",
    "metric",
    "value",
    "threshold",
    "partition_key",
)


def _alerts_table(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path)
    conn.execute(
        "CREATE TABLE IF NOT EXISTS alerts (dedupe_key TEXT PRIMARY KEY, rule TEXT, "
        "severity TEXT, block_number INTEGER, metric TEXT, value REAL, threshold REAL, "
        "partition_key TEXT)"
    )
    return conn


def plain_spark_pipeline(
    spark: SparkSession,
    chain: SyntheticChain,
    ranges: Sequence[tuple[int, int]],
    out_dir: Path,
    *,
    rules: Sequence[AlertRule],
    blocks_where: str | None = None,
    transactions_where: str | None = None,
    aggregates_where: str | None = None,
) -> PlainResult:
    """The pipeline's data work over ``ranges``, sequentially, into ``out_dir``."""
    result = PlainResult()
    phases = result.phases
    started = time.perf_counter()
    dirs = {name: out_dir / name for name in (BLOCKS, TRANSACTIONS, AGGREGATES)}
    for directory in dirs.values():
        directory.mkdir(parents=True, exist_ok=True)
    filters = [parse_where(w).sql if w else None for w in (blocks_where, transactions_where)]
    alert_filter = parse_where(aggregates_where).to_arrow() if aggregates_where else None
    conn = _alerts_table(out_dir / "alerts.db")
    insert = (
        f"INSERT OR IGNORE INTO alerts ({', '.join(_ALERT_COLUMNS)}) "
        f"VALUES ({', '.join('?' for _ in _ALERT_COLUMNS)})"
    )
    try:
        for start, end in ranges:
            t0 = time.perf_counter()
            tables = (chain.blocks(start, end), chain.transactions(start, end))
            t1 = time.perf_counter()
            paths = [dirs[n] / cryo_file_name(n, start, end) for n in (BLOCKS, TRANSACTIONS)]
            for table, path in zip(tables, paths, strict=True):
                write_arrow_parquet(spark, table, path)
            t2 = time.perf_counter()
            frames = []
            for path, where in zip(paths, filters, strict=True):
                frame = spark.read.parquet(str(path))
                frames.append(frame.where(where) if where else frame)
            destination = dirs[AGGREGATES] / cryo_file_name(AGGREGATES, start, end)
            rows = commit_parquet(aggregate_blocks(frames[0], frames[1]), destination)
            t3 = time.perf_counter()
            aggregates = pq.read_table(destination)
            if alert_filter is not None:
                aggregates = aggregates.filter(alert_filter)
            records = alert_records(aggregates, rules, f"{start}-{end}")
            with conn:
                conn.executemany(insert, [tuple(r[c] for c in _ALERT_COLUMNS) for r in records])
            t4 = time.perf_counter()
            phases["generate"] += t1 - t0
            phases["write_inputs"] += t2 - t1
            phases["aggregate"] += t3 - t2
            phases["alerts"] += t4 - t3
            result.ranges += 1
            result.blocks += tables[0].num_rows
            result.transactions += tables[1].num_rows
            result.aggregate_rows += rows
        result.alerts = int(conn.execute("SELECT count(*) FROM alerts").fetchone()[0])
    finally:
        conn.close()
    result.seconds = time.perf_counter() - started
    return result


def plain_alert_keys(out_dir: Path) -> set[str]:
    """The ``dedupe_key`` of every alert the plain script wrote."""
    conn = sqlite3.connect(out_dir / "alerts.db")
    try:
        return {str(row[0]) for row in conn.execute("SELECT dedupe_key FROM alerts")}
    finally:
        conn.close()
