"""Task-queue benchmark: drain throughput, claim cost by depth, wake-up latency.

    python -m benchmarks.queue --engine postgres --tasks 50000 --workers 4 \\
        --consumers 2 --batch 50 --runs 3 --mode drain

One JSON object per run on stdout (one line each), then a summary object with
medians when ``--runs`` > 1 (or per mode for ``claim-cost`` / ``latency``);
logs go to stderr. Without ``--db`` a Postgres run starts a throwaway cluster
(:class:`trace_lite.pgcluster.PostgresCluster`, default durability) and a
SQLite run uses files in a temporary directory. Every run gets a freshly
migrated database.
"""

from __future__ import annotations

import argparse
import pstats
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._common import Databases, benchmark_parser, configure_logging, emit, log, summarize

__all__ = ["main"]

_DRAIN_KEYS = (
    "seconds",
    "tasks_per_s",
    "enqueue_per_s",
    "claim_ms_avg",
    "complete_ms_avg",
    "worker_cpu_s",
    "machine_cpu_busy_pct",
)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = benchmark_parser("python -m benchmarks.queue", __doc__)
    p.add_argument("--mode", choices=("drain", "claim-cost", "latency", "all"), default="drain")
    p.add_argument("--tasks", type=int, default=20_000, help="drain: tasks per run")
    p.add_argument("--workers", type=int, default=4, help="drain: worker OS processes")
    p.add_argument("--consumers", type=int, default=2, help="drain: consumers per process")
    p.add_argument("--batch", type=int, default=50, help="claim_batch size")
    p.add_argument("--runs", type=int, default=1, help="repeat drain runs; summary has medians")
    p.add_argument("--enqueue-batch", type=int, default=1000, help="tasks per create() call")
    p.add_argument(
        "--no-wakeup-outbox",
        action="store_true",
        help="enqueue with TaskQueue(wakeup_outbox=False) (poll-only deployments)",
    )
    p.add_argument("--dedupe-keys", action="store_true", help="give every task a dedupe key")
    p.add_argument(
        "--fill",
        choices=("api", "sql"),
        default="api",
        help="drain: enqueue through TaskQueue.create (api, measured) or one bulk SQL "
        "INSERT fixture (sql: for 10^6-task memory runs; enqueue_per_s is then null)",
    )
    p.add_argument(
        "--depths",
        help="claim-cost: comma-separated queue depths "
        "(default 1000,100000,1000000 on Postgres; 1000,100000 on SQLite)",
    )
    p.add_argument("--rounds", type=int, default=200, help="claim-cost: measured rounds per depth")
    p.add_argument(
        "--history",
        type=int,
        default=0,
        help="claim-cost: also insert this many Completed tasks (finished rows piling up)",
    )
    p.add_argument("--samples", type=int, default=300, help="latency: samples per scenario")
    p.add_argument(
        "--scenarios",
        help="latency: comma-separated scenarios to run after the floor row "
        "(default: every one the engine supports)",
    )
    p.add_argument("--pause", type=float, default=0.02, help="latency: seconds between enqueues")
    p.add_argument(
        "--wait-timeout",
        type=float,
        default=1.0,
        help="latency: the worker's wake-up wait timeout (a lost wake-up costs this)",
    )
    p.add_argument("--profile", metavar="DIR", help="drain: cProfile each worker into DIR")
    p.add_argument("--keep", action="store_true", help="keep the databases made")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    for name in ("tasks", "workers", "consumers", "batch", "runs", "enqueue_batch", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.depths is None:
        args.depths = "1000,100000,1000000" if args.engine == "postgres" else "1000,100000"
    args.depth_list = [int(float(d)) for d in args.depths.split(",") if d.strip()]
    args.scenario_list = None
    if args.scenarios is not None:
        from benchmarks._latency import SCENARIOS

        args.scenario_list = tuple(x.strip() for x in args.scenarios.split(",") if x.strip())
        unknown = sorted(set(args.scenario_list) - set(SCENARIOS))
        if unknown or not args.scenario_list:
            p.error(
                f"--scenarios: unknown {', '.join(unknown)} (choose from {', '.join(SCENARIOS)})"
            )
        if args.engine == "sqlite" and "cross-process" in args.scenario_list:
            p.error("--scenarios: cross-process runs on Postgres only")
    return args


def _print_profile(directory: str, top: int = 40) -> None:
    files = sorted(str(f) for f in Path(directory).glob("drain-w*.prof"))
    if not files:
        return
    stats = pstats.Stats(files[0], stream=sys.stderr)
    for f in files[1:]:
        stats.add(f)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)


def _drain(args: argparse.Namespace, dbs: Databases) -> None:
    from benchmarks._drain import DrainParams, run_drain

    params = DrainParams(
        tasks=args.tasks,
        workers=args.workers,
        consumers=args.consumers,
        batch=args.batch,
        enqueue_batch=args.enqueue_batch,
        wakeup_outbox=not args.no_wakeup_outbox,
        dedupe_keys=args.dedupe_keys,
        profile_dir=args.profile,
        fill=args.fill,
    )
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = [run_drain(dbs, params, run, emit) for run in range(args.runs)]
    if args.runs > 1:
        emit(
            {
                "engine": args.engine,
                "mode": "drain",
                "summary": True,
                "runs": args.runs,
                "tasks": args.tasks,
                "workers": args.workers,
                "consumers_per_worker": args.consumers,
                "batch": args.batch,
                "all_verified": all(r["verified"] for r in rows),
                "tasks_per_s_all": [r["tasks_per_s"] for r in rows],
                **summarize(rows, _DRAIN_KEYS),
            }
        )
    if args.profile:
        _print_profile(args.profile)


def _claim_cost(args: argparse.Namespace, dbs: Databases) -> None:
    from benchmarks._claim_cost import run_claim_cost

    run_claim_cost(dbs, args.depth_list, args.batch, args.rounds, emit, history=args.history)


def _latency(args: argparse.Namespace, dbs: Databases) -> None:
    from benchmarks._latency import LatencyParams, run_latency

    run_latency(
        dbs,
        LatencyParams(
            samples=args.samples,
            pause=args.pause,
            wait_timeout=args.wait_timeout,
            wakeup_outbox=not args.no_wakeup_outbox,
            scenarios=args.scenario_list,
        ),
        emit,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    configure_logging(args.verbose)
    with Databases(args.engine, args.db, keep=args.keep) as dbs:
        if args.mode in ("drain", "all"):
            _drain(args, dbs)
        if args.mode in ("claim-cost", "all"):
            _claim_cost(args, dbs)
        if args.mode in ("latency", "all"):
            _latency(args, dbs)
    log.info("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
