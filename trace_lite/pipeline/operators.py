"""The pipeline's operators: ``block_follower``, ``range_aggregator``, ``alert_evaluate``.

All three are synchronous (run in the in-process runner's worker threads)
and touch data only through a :class:`~trace_lite.object_store.ScopedObjectStore`
built from the attempt's minted credentials, so they read their pinned
inputs and write their own output prefixes and nothing else, as a worker on
AWS would with STS credentials.

``block_follower`` (source)
    Follows a :class:`~trace_lite.pipeline.chain.SyntheticChain` over the
    block range of its first output, one fixed-size range at a time, and
    only ranges at least ``confirmations`` blocks below the head. Each range
    is written by Spark as one Parquet object per output with the Cryo name
    (``blocks_…``, ``transactions_…``), then one partition event per output is
    emitted. Its position (``next_block``) is kept in ``operator_state``, so
    a restarted run resumes where the last one stopped; ranges its output
    versions already hold (the payload's ``coverage``, e.g. written by the
    source of the DAG version before a redeploy) are not written again.
``range_aggregator`` (Spark, PerPartition)
    Joins a partition of blocks (input 0) and transactions (input 1, with its
    ``where`` filter) into per-block aggregates, written as one Parquet
    object, and records the ranges it has done in ``operator_state``.
``alert_evaluate`` (threads, pyarrow)
    Reads a partition of aggregates through its ``where`` filter, evaluates
    the configured rules, and publishes one alert record per (rule, block)
    to its buffered Postgres-table output; the sink writes the table.

Every output is committed atomically under a deterministic object key, so a
rerun of a partition (a retry, a duplicate wake-up, a new attempt after a
killed worker) replaces the same object and never duplicates rows.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio.from_thread

from trace_core.authoring.context import OperatorError, OperatorResult, TaskContext
from trace_core.authoring.events import DatasetEvent
from trace_core.authoring.operators import OperatorSpec
from trace_core.authoring.state import OperatorStateAccess, StateConflict
from trace_core.dag.coverage import Coverage, covers
from trace_core.dag.lineage import DATASET_WIDE, ColumnEdge, merge_edges
from trace_core.dispatcher.buffer import DatasetBuffer
from trace_core.errors import InvalidInput
from trace_lite.buffered import RecordSchema
from trace_lite.lineage import declared_output_lineage, spark_output_lineage
from trace_lite.object_store import LocalObjectStore, ScopedObjectStore
from trace_lite.pipeline.chain import SyntheticChain
from trace_lite.pipeline.cryo import partition_ranges, partition_uri
from trace_lite.pipeline.predicate import parse_where
from trace_lite.spark import SparkSessionProvider

__all__ = [
    "ALERT_SCHEMA",
    "AlertRule",
    "PipelineRuntime",
    "alert_lineage",
    "alert_rules",
    "pipeline_operators",
]

ALERT_SCHEMA = RecordSchema(
    "alerts",
    {
        "rule": "text",
        "severity": "text",
        "block_number": "int",
        "metric": "text",
        "value": "float",
        "threshold": "float",
        "partition_key": "text",
    },
)
"""The records ``alert_evaluate`` publishes (the alert table's columns)."""

FOLLOWER_STATE = "follower"
AGGREGATOR_STATE = "ranges"
_PAUSE_POLL_SECONDS = 0.5
_STATE_RETRIES = 20


@dataclass(frozen=True)
class PipelineRuntime:
    """What the pipeline operators need from the platform."""

    store: LocalObjectStore
    spark: SparkSessionProvider
    buffer: DatasetBuffer
    state: OperatorStateAccess
    """The job's operator state: the Dispatcher's store in-process, the
    control plane's ``/v1/task/state`` for a worker without database credentials."""


@dataclass(frozen=True)
class AlertRule:
    """``metric > above`` on a block's aggregates raises an alert of ``severity``."""

    name: str
    metric: str
    above: float
    severity: str = "warning"


_METRICS = frozenset(
    {
        "tx_count",
        "success_count",
        "failed_count",
        "total_value",
        "total_gas_used",
        "max_gas_price",
        "unique_senders",
    }
)


def alert_rules(config: Mapping[str, Any]) -> list[AlertRule]:
    """The rules of an ``alert_evaluate`` job: ``config.rules`` (a list of
    ``{name, metric, above, severity}``) or the short form ``{threshold,
    severity[, metric]}`` (one rule on ``tx_count`` by default)."""
    raw = config.get("rules")
    if raw is None:
        if "threshold" not in config:
            raise InvalidInput("config.rules", "give rules or a threshold")
        raw = [
            {
                "name": "threshold",
                "metric": config.get("metric", "tx_count"),
                "above": config["threshold"],
                "severity": config.get("severity", "warning"),
            }
        ]
    if not isinstance(raw, list) or not raw:
        raise InvalidInput("config.rules", "must be a non-empty list")
    rules = []
    for i, item in enumerate(raw):
        at = f"config.rules[{i}]"
        if not isinstance(item, Mapping):
            raise InvalidInput(at, "must be an object")
        name, metric, above = item.get("name"), item.get("metric"), item.get("above")
        if not isinstance(name, str) or not name:
            raise InvalidInput(f"{at}.name", "must be a non-empty string")
        if metric not in _METRICS:
            raise InvalidInput(f"{at}.metric", f"must be one of {', '.join(sorted(_METRICS))}")
        if isinstance(above, bool) or not isinstance(above, int | float):
            raise InvalidInput(f"{at}.above", "must be a number")
        severity = item.get("severity", "warning")
        if not isinstance(severity, str) or not severity:
            raise InvalidInput(f"{at}.severity", "must be a non-empty string")
        rules.append(AlertRule(name, str(metric), float(above), severity))
    return rules


def _int(config: Mapping[str, Any], name: str, default: int, minimum: int = 0) -> int:
    value = config.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidInput(f"config.{name}", f"must be an integer >= {minimum}")
    return value


def _uuid(item: Mapping[str, Any], key: str) -> uuid.UUID:
    return uuid.UUID(str(item[key]))


def _scoped(runtime: PipelineRuntime, ctx: TaskContext) -> ScopedObjectStore:
    if not ctx.credentials:
        raise OperatorError("no object-store credentials for this attempt", retryable=False)
    return runtime.store.handle_for(ctx.credentials)


def _named(item: Mapping[str, Any], what: str) -> tuple[str, str]:
    """The dataset name and location of a payload input/output entry."""
    name, location = item.get("dataset"), item.get("location")
    if not isinstance(name, str) or not isinstance(location, str):
        raise OperatorError(f"{what} has no dataset name or location", retryable=False)
    return name, location


def _update_state(
    runtime: PipelineRuntime,
    ctx: TaskContext,
    key: str,
    change: Callable[[dict[str, Any]], dict[str, Any]],
) -> dict[str, Any]:
    """Apply ``change`` to the job's state ``key`` with compare-and-swap (from a thread)."""
    org, job = _uuid(ctx.job, "org_id"), _uuid(ctx.job, "id")
    for _ in range(_STATE_RETRIES):
        ctx.check()
        snapshot = anyio.from_thread.run(runtime.state.get, org, job, key)
        current = dict(snapshot.state) if snapshot else {}
        put = functools.partial(
            runtime.state.put,
            org,
            job,
            change(current),
            state_key=key,
            expected_version=snapshot.version if snapshot else None,
        )
        try:
            anyio.from_thread.run(put)
        except StateConflict:
            continue  # another task of the job wrote in between: read again
        return current
    raise OperatorError(f"operator_state {key!r} kept changing under this task")


def _read_state(runtime: PipelineRuntime, ctx: TaskContext, key: str) -> dict[str, Any]:
    org, job = _uuid(ctx.job, "org_id"), _uuid(ctx.job, "id")
    snapshot = anyio.from_thread.run(runtime.state.get, org, job, key)
    return dict(snapshot.state) if snapshot else {}


# --- block_follower -----------------------------------------------------------


def _follower_range(ctx: TaskContext) -> tuple[int, int]:
    span = ctx.outputs[0].get("range") if ctx.outputs else None
    config = ctx.config
    if span is not None:
        return int(span["start"]), int(span["end"])
    if "start_block" in config and "end_block" in config:
        start, end = _int(config, "start_block", 0), _int(config, "end_block", 0)
        if start > end:
            raise InvalidInput("config.end_block", "must be >= start_block")
        return start, end
    raise InvalidInput("outputs[0].range", "block_follower needs a block range")


def _chain_head(config: Mapping[str, Any], first: int, last: int, elapsed: float) -> int:
    """The synthetic chain's head: past ``last`` already (a chain with history),
    or, with ``blocks_per_second``, growing from ``first`` as the source runs
    (a live chain, where the confirmation depth makes the follower wait)."""
    rate = config.get("blocks_per_second")
    if rate is None:
        return last + _int(config, "confirmations", 12)
    if isinstance(rate, bool) or not isinstance(rate, int | float) or rate <= 0:
        raise InvalidInput("config.blocks_per_second", "must be a positive number")
    return first + int(elapsed * float(rate))


def block_follower(runtime: PipelineRuntime, ctx: TaskContext) -> OperatorResult:
    """The source (see the module docstring)."""
    config = ctx.config
    chain = SyntheticChain(
        seed=_int(config, "seed", 0),
        chain_id=_int(config, "chain_id", 1),
        mean_txs_per_block=_int(config, "mean_txs_per_block", 20, minimum=1),
    )
    size = _int(config, "partition_size", 1000, minimum=1)
    confirmations = _int(config, "confirmations", 12)
    if len(ctx.outputs) != 2:
        raise OperatorError(
            "block_follower writes two outputs: blocks, transactions", retryable=False
        )
    first, last = _follower_range(ctx)
    outputs = [(_named(o, f"outputs[{i}]"), o) for i, o in enumerate(ctx.outputs)]
    resume = int(_read_state(runtime, ctx, FOLLOWER_STATE).get("next_block", first))
    started = time.monotonic()
    from trace_lite.pipeline.transforms import write_arrow_parquet

    done = [Coverage.of(o.get("coverage") or [], None) for o in ctx.outputs]
    for start, end in partition_ranges(first, last, size):
        wanted = Coverage(((start, end),))
        if end < resume or all(covers(have, wanted) for have in done):
            continue  # written before (by this job, or by the run of an older DAG version)
        while True:
            directive = ctx.directive_blocking()
            if directive == "stop":
                return OperatorResult()
            head = _chain_head(config, first, last, time.monotonic() - started)
            if directive == "run" and end <= head - confirmations:
                break
            _wait(ctx, _PAUSE_POLL_SECONDS)
        # Per range, not once: a follower outlives its first credentials, and
        # the wrapper renews them (with the capability token) in ctx.credentials.
        store = _scoped(runtime, ctx)
        spark = runtime.spark.get()
        tables = (chain.blocks(start, end), chain.transactions(start, end))
        events = []
        for ((name, location), output), table in zip(outputs, tables, strict=True):
            path = store.local_path(partition_uri(location, name, start, end), "write")
            ctx.check()
            write_arrow_parquet(spark, table, path)
            events.append(
                DatasetEvent(
                    _uuid(output, "dataset_uuid"),
                    _uuid(output, "dataset_version"),
                    partition_key=f"{start}-{end}",
                    start=start,
                    end=end,
                )
            )
        ctx.emit_blocking(events)
        _update_state(runtime, ctx, FOLLOWER_STATE, functools.partial(_merged, next_block=end + 1))
    # The range is done. A follower of a live chain would wait for new blocks;
    # this one stays up (heartbeating) until the platform drains it.
    while ctx.directive_blocking() != "stop":
        _wait(ctx, _PAUSE_POLL_SECONDS)
    return OperatorResult()


def _merged(state: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**state, **changes}


def _wait(ctx: TaskContext, seconds: float) -> None:
    """Wait for the chain head (or a resume) in the operator's thread; a lost
    lease ends the wait with :class:`~trace_core.errors.StaleClaim`."""
    time.sleep(seconds)
    ctx.check()


# --- range_aggregator ---------------------------------------------------------


def _unit(item: Mapping[str, Any], what: str) -> tuple[int, int]:
    try:
        return int(item["start"]), int(item["end"])
    except (KeyError, TypeError, ValueError):
        raise OperatorError(f"{what} has no block range", retryable=False) from None


def range_aggregator(runtime: PipelineRuntime, ctx: TaskContext) -> OperatorResult:
    """Per-block aggregates of one block range (see the module docstring)."""
    from trace_lite.pipeline.transforms import aggregate_blocks, commit_parquet

    if len(ctx.inputs) != 2 or len(ctx.outputs) != 1:
        raise OperatorError(
            "range_aggregator reads blocks and transactions and writes one output",
            retryable=False,
        )
    store = _scoped(runtime, ctx)
    start, end = _unit(ctx.inputs[0], "inputs[0]")
    spark = runtime.spark.get()
    frames, read = [], {}
    for i, item in enumerate(ctx.inputs):
        if _unit(item, f"inputs[{i}]") != (start, end):
            raise OperatorError("inputs cover different block ranges", retryable=False)
        name, location = _named(item, f"inputs[{i}]")
        path = store.local_path(partition_uri(location, name, start, end), "read")
        frame = read[name] = spark.read.parquet(str(path))
        if where := item.get("where"):
            frame = frame.where(parse_where(where, field=f"inputs[{i}].where").sql)
        frames.append(frame)
    (name, location), output = _named(ctx.outputs[0], "outputs[0]"), ctx.outputs[0]
    destination = store.local_path(partition_uri(location, name, start, end), "write")
    ctx.check()
    aggregates = aggregate_blocks(frames[0], frames[1])
    rows = commit_parquet(aggregates, destination)
    lineage = spark_output_lineage(
        aggregates, read, job=ctx.job, output_entry=output, inputs=ctx.inputs
    )
    _update_state(runtime, ctx, AGGREGATOR_STATE, lambda s: _record_range(s, start, end, rows))
    event = DatasetEvent(
        _uuid(output, "dataset_uuid"),
        _uuid(output, "dataset_version"),
        partition_key=f"{start}-{end}",
        start=start,
        end=end,
    )
    result: dict[str, Any] = {"rows": rows, "range": [start, end]}
    if lineage is not None:
        result["lineage"] = lineage
    return OperatorResult(events=[event], outputs=[result])


def _record_range(state: dict[str, Any], start: int, end: int, rows: int) -> dict[str, Any]:
    """The bookkeeping after ``[start, end]`` was (re)written: merged ranges,
    rows per range, the highest block done (the cursor)."""
    ranges = sorted([*([list(r) for r in state.get("ranges", [])]), [start, end]])
    merged: list[list[int]] = []
    for lo, hi in ranges:
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    counts = dict(state.get("rows", {}))
    counts[f"{start}-{end}"] = rows
    cursor = max(int(state.get("cursor", -1)), end)
    return {"ranges": merged, "rows": counts, "cursor": cursor}


# --- alert_evaluate -----------------------------------------------------------


def alert_records(
    aggregates: Any, rules: Sequence[AlertRule], partition_key: str
) -> list[dict[str, Any]]:
    """One record per (rule, block) whose metric is above the rule's threshold;
    ``aggregates`` is a pyarrow table of per-block aggregates."""
    records = []
    columns = aggregates.to_pydict()
    blocks = columns.get("block_number", [])
    for rule in rules:
        if rule.metric not in columns:
            raise OperatorError(f"rule {rule.name}: no column {rule.metric}", retryable=False)
        for block, value in zip(blocks, columns[rule.metric], strict=True):
            if value is not None and value > rule.above:
                records.append(
                    {
                        "dedupe_key": f"{rule.name}:{block}",
                        "rule": rule.name,
                        "severity": rule.severity,
                        "block_number": int(block),
                        "metric": rule.metric,
                        "value": float(value),
                        "threshold": rule.above,
                        "partition_key": partition_key,
                    }
                )
    return records


_PUBLISH_CHUNK = 1000


def alert_evaluate(runtime: PipelineRuntime, ctx: TaskContext) -> OperatorResult:
    """Evaluate the rules over one partition of aggregates (module docstring)."""
    import pyarrow.parquet as pq

    if len(ctx.inputs) != 1 or len(ctx.outputs) != 1:
        raise OperatorError("alert_evaluate reads one input and writes one output", retryable=False)
    rules = alert_rules(ctx.config)
    store = _scoped(runtime, ctx)
    item = ctx.inputs[0]
    start, end = _unit(item, "inputs[0]")
    name, location = _named(item, "inputs[0]")
    table = pq.read_table(store.local_path(partition_uri(location, name, start, end), "read"))
    where = item.get("where")
    if where:
        table = table.filter(parse_where(where, field="inputs[0].where").to_arrow())
    records = alert_records(table, rules, f"{start}-{end}")
    lineage = declared_output_lineage(ctx.config, ctx.inputs, alert_lineage(name, rules, where))
    dataset = _uuid(ctx.outputs[0], "dataset_uuid")
    for k in range(0, len(records), _PUBLISH_CHUNK):
        ctx.check()
        publish = functools.partial(
            runtime.buffer.publish,
            dataset,
            records[k : k + _PUBLISH_CHUNK],
            producer_task_id=ctx.task_id,
            attempt=ctx.attempt,
            schema_hash=ALERT_SCHEMA.schema_hash,
        )
        anyio.from_thread.run(publish)
    return OperatorResult(outputs=[{"alerts": len(records), "lineage": lineage}])


def alert_lineage(
    source: str, rules: Sequence[AlertRule], where: str | None = None
) -> list[ColumnEdge]:
    """What ``alert_evaluate`` computes each alert column from (declared in
    code: the operator is not Spark): ``value`` is the rule's metric, the
    block and the dedupe key come from ``block_number``; which rows exist is
    decided by the metrics against their thresholds and by the input's
    ``where``. The other columns are constants of the rules."""
    edges = [
        ColumnEdge("block_number", source, "block_number", "IDENTITY"),
        ColumnEdge("dedupe_key", source, "block_number", "TRANSFORMATION"),
    ]
    for rule in rules:
        edges.append(ColumnEdge("value", source, rule.metric, "IDENTITY"))
        edges.append(ColumnEdge(DATASET_WIDE, source, rule.metric, "FILTER"))
    if where:
        for column in parse_where(where, field="inputs[0].where").columns:
            edges.append(ColumnEdge(DATASET_WIDE, source, column, "FILTER"))
    return merge_edges(edges)


def pipeline_operators(runtime: PipelineRuntime) -> list[OperatorSpec]:
    """The three operators, bound to ``runtime``."""

    def bind(run: Callable[[PipelineRuntime, TaskContext], OperatorResult]) -> Any:
        def operator(ctx: TaskContext) -> OperatorResult:
            try:
                return run(runtime, ctx)
            except InvalidInput as exc:
                # A bad job config or payload: another attempt fails the same way.
                raise OperatorError(str(exc), retryable=False) from exc

        operator.__name__ = operator.__qualname__ = run.__name__
        return operator

    return [
        OperatorSpec(
            "block_follower",
            bind(block_follower),
            source=True,
            description="follows a synthetic chain; writes block-range Parquet with Spark",
        ),
        OperatorSpec(
            "range_aggregator",
            bind(range_aggregator),
            description="per-block aggregates of a block range (Spark)",
        ),
        OperatorSpec(
            "alert_evaluate",
            bind(alert_evaluate),
            description="alert rules over aggregates, published to a buffered table",
        ),
    ]
