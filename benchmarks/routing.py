"""Routing benchmark: events accepted and routed to reactive dependents, per second.

    python -m benchmarks.routing --engine postgres --events 10000 --dependents 10 \\
        --duplicates 0.3 --batch 500 --runs 3

Each run deploys a DAG (one source job producing the partitioned dataset
``blocks``, ``--dependents`` reactive PerPartition jobs reading it) on a
fresh database, claims the source's run task, and times accepting the
events (``--events`` distinct ``{start}-{end}`` partitions of 100 blocks plus
``--duplicates`` x as many resampled duplicates, shuffled with a fixed seed)
through ``EventGateway.accept`` in requests of ``--batch``, and draining the
outbox through ``OutboxRelay`` with the router's ``route_event`` handler (and
a no-op ``enqueue_task`` handler, unless ``--leave-wakeups``). ``events`` and
``events_per_s`` count the duplicates; ``seconds`` runs from the first
request to the last task written. By default every event is accepted, then
routed; ``--overlap`` routes while the requests come in, as in a running
Dispatcher. A run also checks that the stored ``deliveries`` add up to the
events sent (redeliveries of events being routed are counted later, by the
router: :mod:`trace_core.dispatcher.redeliveries`).

Each run is followed by its floor: the same task and ``task_inputs`` rows
written bare, by ``INSERT ... SELECT`` in the database (no events, no
routing); ``events_per_s_ceiling`` = events / that time is what no routing
code can pass on this machine, and ``share_of_ceiling`` the run's share of it.
A second floor (both engines) writes every row the specification requires (the
events with their deliveries, their outcomes, the tasks and ``task_inputs``,
the outbox rows and progress row) bare, with no logic:
``events_per_s_required_ceiling`` and ``share_of_required_ceiling``
(``--no-floor`` skips both).

One JSON object per run on stdout (one line each), then a summary object
with medians; logs go to stderr. The run fails (exit status 1) unless the
tasks table holds exactly ``distinct_events x dependents`` tasks. Without
``--db`` a Postgres run starts a throwaway cluster and a SQLite run uses
files in a temporary directory.
"""

from __future__ import annotations

import argparse
import pstats
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks._common import Databases, benchmark_parser, configure_logging, emit, log, summarize

__all__ = ["main"]

_KEYS = (
    "seconds",
    "events_per_s",
    "distinct_events_per_s",
    "tasks_per_s",
    "accept_seconds",
    "route_seconds",
    "accept_ms_p50",
    "accept_ms_p95",
    "client_cpu_s",
    "server_cpu_s",
    "floor_seconds",
    "events_per_s_ceiling",
    "share_of_ceiling",
    "required_floor_seconds",
    "events_per_s_required_ceiling",
    "share_of_required_ceiling",
)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = benchmark_parser("python -m benchmarks.routing", __doc__)
    p.add_argument("--events", type=int, default=10_000, help="distinct partition events")
    p.add_argument("--dependents", type=int, default=10, help="reactive PerPartition jobs")
    p.add_argument(
        "--duplicates",
        type=float,
        default=0.3,
        help="duplicates added, as a fraction of --events (resampled)",
    )
    p.add_argument("--batch", type=int, default=500, help="events per accept request")
    p.add_argument("--runs", type=int, default=3, help="runs (fresh database each)")
    p.add_argument("--seed", type=int, default=20_260_101, help="duplicates and shuffle seed")
    p.add_argument(
        "--leave-wakeups",
        action="store_true",
        help="register no enqueue_task handler: wake-up rows stay Pending (not timed)",
    )
    p.add_argument("--relay-batch", type=int, default=10, help="RelayConfig.batch_size")
    p.add_argument("--relay-concurrency", type=int, default=5, help="RelayConfig.concurrency")
    p.add_argument(
        "--overlap",
        action="store_true",
        help="route while accepting, as a running Dispatcher does (default: accept, then route)",
    )
    p.add_argument("--no-floor", action="store_true", help="skip the floors (bare writes)")
    p.add_argument("--profile", metavar="FILE", help="cProfile the timed phases of run 0")
    p.add_argument(
        "--trace-sql",
        action="store_true",
        help="count and time statements per phase (adds overhead; for diagnosis)",
    )
    p.add_argument("--keep", action="store_true", help="keep the databases made")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    for name in ("events", "dependents", "batch", "runs", "relay_batch", "relay_concurrency"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.duplicates < 0:
        p.error("--duplicates must be >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0 if every run created exactly the expected tasks, else 1."""
    from benchmarks._routing import RoutingParams, run_routing

    args = _parse(argv)
    configure_logging(args.verbose)
    rows: list[dict[str, Any]] = []
    with Databases(args.engine, args.db, keep=args.keep) as dbs:
        for run in range(args.runs):
            params = RoutingParams(
                events=args.events,
                dependents=args.dependents,
                duplicates=args.duplicates,
                batch=args.batch,
                seed=args.seed,
                drain_wakeups=not args.leave_wakeups,
                relay_batch=args.relay_batch,
                relay_concurrency=args.relay_concurrency,
                profile_path=args.profile if run == 0 else None,
                trace_sql=args.trace_sql,
                overlap=args.overlap,
                floor=not args.no_floor,
            )
            rows.append(run_routing(dbs, params, run, emit))
    emit(
        {
            "bench": "routing",
            "engine": args.engine,
            "summary": True,
            "runs": args.runs,
            "events": rows[0]["events"],
            "distinct_events": args.events,
            "dependents": args.dependents,
            "batch": args.batch,
            "all_verified": all(r["verified"] for r in rows),
            "events_per_s_all": [r["events_per_s"] for r in rows],
            **summarize(rows, _KEYS),
        }
    )
    if args.profile:
        stats = pstats.Stats(args.profile, stream=sys.stderr)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(40)
    failed = [r for r in rows if not r["verified"]]
    if failed:
        sys.stderr.write(
            f"routing benchmark FAILED: {len(failed)} of {len(rows)} runs did not create "
            f"exactly {args.events * args.dependents} tasks "
            f"(got {[r['tasks_created'] for r in failed]})\n"
        )
        return 1
    log.info("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
