"""Pipeline benchmark: the chain pipeline under Trace vs the same work as a plain PySpark script.

    python -m benchmarks.pipeline --blocks 100000 --runs 3 [--partition-size 10000] \\
        [--engine sqlite|postgres] [--db URL] [--workers 4]

In one process with one Spark session (started, and warmed up on a small
range by both sides, before anything is timed), each run times

- ``pipeline``: ``run_pipeline`` (what ``trace-lite run --blocks N`` does) over
  ``examples/chain_pipeline.yaml`` in a fresh data directory, from starting
  TraceLite until every dataset covers the range and nothing is left to do
  (``RunSummary.seconds``; ``pipeline_wall_seconds`` adds the stop);
- ``plain``: :func:`~benchmarks._plain_pipeline.plain_spark_pipeline`, the same
  data work with no orchestration, sequentially, into a second directory.

The two alternate which goes first. ``overhead_ratio`` is the median of the
per-run ratios pipeline / plain (the machine is noisy; the per-run lists are
in the output too). ``outputs_equal`` is true when both sides wrote the same
partition files with the same row counts for blocks and transactions, equal
contents for every aggregates file, and the same set of alerts. Each entry
of ``per_run`` also says where the time went: ``plain_phases`` (seconds per
phase of the script) and ``pipeline_timeline`` (from the run's state
database, see :func:`pipeline_timeline`).

One JSON object on stdout; logs (and with ``-v`` the pipeline's progress) go
to stderr. Exit status 1 if a pipeline run did not finish or the outputs
differ. Without ``--db`` the state and data databases are SQLite files in each
run's data directory (``--engine postgres`` starts a throwaway cluster).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import itertools
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pyarrow.parquet as pq
import sqlalchemy as sa

from benchmarks._common import (
    Databases,
    benchmark_parser,
    configure_logging,
    emit,
    load_average,
    log,
    median,
    peak_rss_mb,
)
from benchmarks._plain_pipeline import (
    AGGREGATES,
    BLOCKS,
    TRANSACTIONS,
    PipelineSpec,
    PlainResult,
    plain_alert_keys,
    plain_spark_pipeline,
    with_partition_size,
)
from trace_core.storage import schema
from trace_core.storage.url import create_sync_engine, parse_database_url
from trace_lite.platform import LiteConfig
from trace_lite.run_command import RunOptions, RunSummary, run_pipeline, with_block_count
from trace_lite.spark import DEFAULT_SPARK_CONF, SparkConfig, SparkSessionProvider

__all__ = ["DEFAULT_DAG", "main", "run_benchmark"]

DEFAULT_DAG = Path(__file__).resolve().parent.parent / "examples" / "chain_pipeline.yaml"


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = benchmark_parser("python -m benchmarks.pipeline", __doc__)
    for action in p._actions:  # the pipeline runs on SQLite unless told otherwise
        if action.dest == "engine":
            action.required, action.default = False, "sqlite"
    p.add_argument("--blocks", type=int, default=100_000, help="blocks from the range start")
    p.add_argument("--runs", type=int, default=3, help="timed runs (each side once per run)")
    p.add_argument(
        "--partition-size", type=int, help="block_follower's partition_size (default: the DAG's)"
    )
    p.add_argument("--workers", type=int, default=4, help="LiteConfig.workers (runner threads)")
    p.add_argument("--dag", type=Path, default=DEFAULT_DAG, help="the pipeline DAG file")
    p.add_argument(
        "--refresh",
        type=float,
        default=0.25,
        help="RunOptions.refresh_seconds: how often run_pipeline checks for the end",
    )
    p.add_argument(
        "--warmup-blocks",
        type=int,
        default=1000,
        help="blocks both sides process once, untimed, before the runs (0: no warm-up)",
    )
    p.add_argument("--spark-master", default="local[*]", help="the shared session's master")
    p.add_argument(
        "--spark-conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="added to the session's configuration (DEFAULT_SPARK_CONF), e.g. "
        "spark.driver.memory=3g; repeatable",
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="per pipeline run, seconds")
    p.add_argument("--keep", action="store_true", help="keep the data directories (logged)")
    p.add_argument("-v", "--verbose", action="store_true", help="pipeline progress to stderr")
    args = p.parse_args(argv)
    for name in ("blocks", "runs", "workers"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.partition_size is not None and args.partition_size < 1:
        p.error("--partition-size must be >= 1")
    if args.refresh <= 0:
        p.error("--refresh must be > 0")
    if args.warmup_blocks < 0:
        p.error("--warmup-blocks must be >= 0")
    for item in args.spark_conf:
        if "=" not in item or not item.partition("=")[0]:
            p.error(f"--spark-conf {item!r}: expected KEY=VALUE")
    return args


# --- the pipeline side -----------------------------------------------------------


@dataclasses.dataclass
class _PipelineRun:
    summary: RunSummary
    wall_seconds: float
    data_dir: Path
    data_url: str
    timeline: dict[str, Any]


async def _pipeline_once(
    args: argparse.Namespace,
    spark: SparkSessionProvider,
    dag_text: str,
    blocks: int,
    work: Path,
    dbs: Databases | None,
) -> _PipelineRun:
    data_dir = work / "lite"
    dag_file = work / "dag.yaml"
    dag_file.write_text(dag_text, encoding="utf-8")
    state_url = data_url = None
    if dbs is not None:
        state_url = dbs.fresh("state")
        data_url = dbs.fresh("data") if args.engine == "postgres" else None
    config = LiteConfig(
        data_dir=data_dir,
        database_url=state_url,
        data_database_url=data_url,
        workers=args.workers,
        spark=spark.config,
    )
    options = RunOptions(
        dag_file, config, blocks=blocks, timeout_seconds=args.timeout, refresh_seconds=args.refresh
    )
    out: Any = sys.stderr if args.verbose else io.StringIO()
    started_at = datetime.now(UTC)
    started = time.perf_counter()
    summary = await run_pipeline(options, out, spark=spark)
    wall = time.perf_counter() - started
    if not spark.started:
        raise RuntimeError("the pipeline stopped the shared Spark session")
    timeline = await anyio.to_thread.run_sync(
        pipeline_timeline, config.state_url, started_at, summary.seconds
    )
    return _PipelineRun(summary, wall, data_dir, config.data_url, timeline)


def _span(a: datetime | None, b: datetime | None) -> float | None:
    return round((b - a).total_seconds(), 3) if a is not None and b is not None else None


def _med(values: Sequence[float | None]) -> float | None:
    found = [v for v in values if v is not None]
    return round(median(found), 3) if found else None


def pipeline_timeline(state_url: str, started_at: datetime, seconds: float) -> dict[str, Any]:
    """Where a pipeline run's time went, from its state database (seconds).

    ``startup``: TraceLite start and deploy (to the DAG version's creation);
    ``source_start``: deploy to the follower task's start; ``follower``: its
    start to its last partition event; ``follower_gap_median``: between its
    partition events; per reactive job ``<job>_queue_median`` (task created to
    started), ``<job>_run_median`` and ``<job>_run_sum`` (started to
    completed); ``route_median``: event received to routed; ``after_follower``:
    the follower's last event to the end of the run (the last partition's
    aggregate and alerts, plus noticing the end); ``end_detect``: the last
    reactive task's completion to the end of the run (sink flush, polling).
    """
    tasks, jobs, events, versions = schema.tasks, schema.jobs, schema.events, schema.dag_versions
    finished_at = started_at + timedelta(seconds=seconds)
    engine = create_sync_engine(parse_database_url(state_url))
    try:
        with engine.connect() as conn:
            deployed = conn.scalar(sa.select(sa.func.min(versions.c.created_at)))
            rows = conn.execute(
                sa.select(
                    jobs.c.name,
                    jobs.c.activation,
                    tasks.c.created_at,
                    tasks.c.started_at,
                    tasks.c.completed_at,
                ).join(jobs, jobs.c.id == tasks.c.job_id)
            ).all()
            event_rows = conn.execute(
                sa.select(
                    events.c.received_at, events.c.routed_at, events.c.producer_task_id
                ).order_by(events.c.received_at)
            ).all()
            follower_ids = set(
                conn.scalars(
                    sa.select(tasks.c.id)
                    .join(jobs, jobs.c.id == tasks.c.job_id)
                    .where(jobs.c.activation == "source")
                )
            )
    finally:
        engine.dispose()
    deployed_at = deployed if isinstance(deployed, datetime) else None
    source = [r for r in rows if r.activation == "source"]
    follower_start = min((r.started_at for r in source if r.started_at), default=None)
    follower_events = sorted(
        {e.received_at for e in event_rows if e.producer_task_id in follower_ids}
    )
    gaps = [_span(a, b) for a, b in itertools.pairwise(follower_events)]
    out: dict[str, Any] = {
        "startup": _span(started_at, deployed_at),
        "source_start": _span(deployed_at, follower_start),
        "follower": _span(follower_start, follower_events[-1] if follower_events else None),
        "follower_gap_median": _med(gaps),
        "route_median": _med([_span(e.received_at, e.routed_at) for e in event_rows]),
        "after_follower": _span(follower_events[-1], finished_at) if follower_events else None,
    }
    reactive = [r for r in rows if r.activation != "source"]
    for name in sorted({r.name for r in reactive}):
        mine = [r for r in reactive if r.name == name]
        runs = [_span(r.started_at, r.completed_at) for r in mine]
        out[f"{name}_tasks"] = len(mine)
        out[f"{name}_queue_median"] = _med([_span(r.created_at, r.started_at) for r in mine])
        out[f"{name}_run_median"] = _med(runs)
        out[f"{name}_run_sum"] = round(sum(r for r in runs if r is not None), 3)
    last = max((r.completed_at for r in reactive if r.completed_at), default=None)
    out["end_detect"] = _span(last, finished_at)
    return out


# --- comparing the two sides' outputs ----------------------------------------------------


def _files(root: Path, dataset: str) -> dict[str, Path]:
    """``{file name: path}`` of one dataset's partition files under ``root``."""
    found: dict[str, Path] = {}
    for path in sorted(root.rglob(f"{dataset}_*.parquet")):
        if path.name.startswith(".") or not path.is_file():
            continue
        if path.name in found:
            raise RuntimeError(f"two {path.name} under {root} (more than one dataset version)")
        found[path.name] = path
    return found


def _pipeline_alert_keys(data_url: str) -> set[str]:
    """The ``dedupe_key`` of every row of the alerts table the sink wrote."""
    engine = create_sync_engine(parse_database_url(data_url))
    try:
        with engine.connect() as conn:
            inspector = sa.inspect(conn)
            keys: set[str] = set()
            for name in inspector.get_table_names():
                columns = {c["name"] for c in inspector.get_columns(name)}
                if "dedupe_key" in columns and "rule" in columns:
                    table = sa.table(name, sa.column("dedupe_key"))
                    keys |= {str(k) for k in conn.scalars(sa.select(table.c.dedupe_key))}
            return keys
    finally:
        engine.dispose()


def compare_outputs(
    pipeline_objects: Path, pipeline_data_url: str, plain_dir: Path
) -> dict[str, Any]:
    """Whether both sides wrote the same data (see the module docstring), with details."""
    report: dict[str, Any] = {}
    equal = True
    for dataset in (BLOCKS, TRANSACTIONS, AGGREGATES):
        ours, theirs = _files(pipeline_objects, dataset), _files(plain_dir / dataset, dataset)
        same_names = sorted(ours) == sorted(theirs) and bool(ours)
        rows = sum(pq.read_metadata(p).num_rows for p in ours.values())
        plain_rows = sum(pq.read_metadata(p).num_rows for p in theirs.values())
        same = same_names and rows == plain_rows
        if dataset == AGGREGATES and same:
            same = all(pq.read_table(ours[n]).equals(pq.read_table(theirs[n])) for n in ours)
        report[dataset] = {
            "files": len(ours),
            "rows": rows,
            "plain_rows": plain_rows,
            "equal": same,
        }
        equal = equal and same
    ours_alerts = _pipeline_alert_keys(pipeline_data_url)
    theirs_alerts = plain_alert_keys(plain_dir)
    same_alerts = ours_alerts == theirs_alerts
    report["alerts"] = {"rows": len(ours_alerts), "plain_rows": len(theirs_alerts)}
    report["alerts"]["equal"] = same_alerts
    return {"outputs_equal": equal and same_alerts, "outputs": report}


# --- one run of both sides ---------------------------------------------------------------


def _plain_once(spark: SparkSessionProvider, spec: PipelineSpec, out_dir: Path) -> PlainResult:
    return plain_spark_pipeline(
        spark.get(),
        spec.chain,
        spec.ranges,
        out_dir,
        rules=spec.rules,
        blocks_where=spec.blocks_where,
        transactions_where=spec.transactions_where,
        aggregates_where=spec.aggregates_where,
    )


def _one_run(
    args: argparse.Namespace,
    spark: SparkSessionProvider,
    dag_text: str,
    blocks: int,
    plain_first: bool,
    dbs: Databases | None,
    label: str,
) -> dict[str, Any]:
    spec = PipelineSpec.from_yaml(with_block_count(dag_text, blocks))
    work = Path(tempfile.mkdtemp(prefix=f"trace-bench-pipeline-{label}-"))
    try:
        plain_dir = work / "plain"
        plain: PlainResult | None = None
        if plain_first:
            plain = _plain_once(spark, spec, plain_dir)
        piped = anyio.run(_pipeline_once, args, spark, dag_text, blocks, work, dbs)
        if plain is None:
            plain = _plain_once(spark, spec, plain_dir)
        checked = compare_outputs(piped.data_dir / "objects", piped.data_url, plain_dir)
    finally:
        if args.keep:
            log.info("%s: kept %s", label, work)
        else:
            shutil.rmtree(work, ignore_errors=True)
    seconds = piped.summary.seconds
    row = {
        "run": label,
        "order": "plain,pipeline" if plain_first else "pipeline,plain",
        "finished": piped.summary.finished,
        "blocks": piped.summary.blocks,
        "seconds": round(seconds, 3),
        "pipeline_wall_seconds": round(piped.wall_seconds, 3),
        "plain_spark_seconds": round(plain.seconds, 3),
        "overhead_ratio": round(seconds / plain.seconds, 4) if plain.seconds > 0 else None,
        "partitions": plain.ranges,
        "transactions": plain.transactions,
        "alerts": plain.alerts,
        "pipeline_tasks": piped.summary.tasks,
        "pipeline_timeline": piped.timeline,
        "plain_phases": {k: round(v, 3) for k, v in plain.phases.items()},
        **checked,
    }
    log.info(
        "%s: pipeline %.2f s (wall %.2f s), plain %.2f s, ratio %s, outputs_equal %s",
        label,
        seconds,
        piped.wall_seconds,
        plain.seconds,
        row["overhead_ratio"],
        row["outputs_equal"],
    )
    return row


def run_benchmark(args: argparse.Namespace, spark: SparkSessionProvider) -> dict[str, Any]:
    """Warm up, then ``args.runs`` runs of both sides; the summary object."""
    text = args.dag.read_text(encoding="utf-8")
    if args.partition_size is not None:
        text = with_partition_size(text, args.partition_size)
    spec = PipelineSpec.from_yaml(with_block_count(text, args.blocks))
    t0 = time.perf_counter()
    spark.get()
    spark_start = time.perf_counter() - t0
    log.info("Spark session up in %.1f s (%s)", spark_start, spark.config.master)
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        dbs = None
        if args.engine == "postgres" or args.db is not None:
            dbs = stack.enter_context(Databases(args.engine, args.db, keep=args.keep))
        warmup = None
        if args.warmup_blocks:
            t0 = time.perf_counter()
            row = _one_run(args, spark, text, args.warmup_blocks, False, dbs, "warmup")
            warmup = {
                "blocks": args.warmup_blocks,
                "seconds": round(time.perf_counter() - t0, 3),
                "outputs_equal": row["outputs_equal"],
            }
        for run in range(args.runs):
            rows.append(_one_run(args, spark, text, args.blocks, run % 2 == 1, dbs, f"run{run}"))
    pipeline_s = median([r["seconds"] for r in rows])
    plain_s = median([r["plain_spark_seconds"] for r in rows])
    ratios = [r["overhead_ratio"] for r in rows if r["overhead_ratio"] is not None]
    return {
        "bench": "pipeline",
        "engine": args.engine,
        "blocks": args.blocks,
        "runs": args.runs,
        "partition_size": spec.partition_size,
        "partitions": len(spec.ranges),
        "workers": args.workers,
        "spark_master": spark.config.master,
        "spark_conf_changes": {
            k: v for k, v in spark.config.conf.items() if DEFAULT_SPARK_CONF.get(k) != v
        },
        "refresh_seconds": args.refresh,
        "seconds": round(pipeline_s, 3),
        "blocks_per_s": round(args.blocks / pipeline_s, 1) if pipeline_s > 0 else 0.0,
        "plain_spark_seconds": round(plain_s, 3),
        "plain_blocks_per_s": round(args.blocks / plain_s, 1) if plain_s > 0 else 0.0,
        "overhead_ratio": round(median(ratios), 4) if ratios else None,
        "pipeline_wall_seconds": round(median([r["pipeline_wall_seconds"] for r in rows]), 3),
        "seconds_all": [r["seconds"] for r in rows],
        "plain_spark_seconds_all": [r["plain_spark_seconds"] for r in rows],
        "overhead_ratio_all": [r["overhead_ratio"] for r in rows],
        "finished": all(r["finished"] for r in rows),
        "outputs_equal": all(r["outputs_equal"] for r in rows),
        "transactions": rows[0]["transactions"],
        "alerts": rows[0]["alerts"],
        "spark_start_seconds": round(spark_start, 3),
        "warmup": warmup,
        "per_run": rows,
        "load_average": load_average(),
        "peak_rss_mb": peak_rss_mb(),
    }


def main(argv: Sequence[str] | None = None, *, spark: SparkSessionProvider | None = None) -> int:
    """Run the benchmark and print its JSON; 0 if every run finished with equal outputs.

    ``spark`` shares a session provider the caller owns (``--spark-master`` and
    ``--spark-conf`` are then ignored); otherwise one is made here and stopped at the end.
    """
    args = _parse(argv)
    configure_logging(False, "py4j", "trace_core", "trace_lite")
    extra = dict(item.split("=", 1) for item in args.spark_conf)
    conf = {**DEFAULT_SPARK_CONF, **extra}
    provider = spark or SparkSessionProvider(SparkConfig(master=args.spark_master, conf=conf))
    try:
        result = run_benchmark(args, provider)
    finally:
        if spark is None:
            provider.stop()
    emit(result)
    if not result["finished"] or not result["outputs_equal"]:
        sys.stderr.write(
            f"pipeline benchmark FAILED: finished {result['finished']}, "
            f"outputs_equal {result['outputs_equal']}\n"
        )
        return 1
    log.info("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
