"""Batch enqueue: N tasks through ``TaskQueue.create`` in batches, with their wake-ups.

    python -m benchmarks.enqueue --engine postgres --tasks 30000 --batch 1000 \\
        [--dedupe-keys] [--runs 3] [--profile FILE]

The Trace side of ``benchmarks.compare``'s ``postgres-enqueue`` pair (against
PgQueuer's ``enqueue`` with lists). Every run gets a freshly migrated
database with one standalone job; the repository's connections are open
before the clock starts. The clock runs over ``create()`` calls of
``--batch`` tasks each (each its own transaction: the tasks, their
``enqueue_task`` outbox rows, the notify) until all N are in. A run is
verified by reading back the task count and the task ids the outbox rows
carry (each created task exactly once). One JSON object per run, then a
summary with medians when ``--runs`` > 1.

``--floor`` (Postgres) measures in every run, on another fresh database, the
same task rows written bare (:mod:`benchmarks._enqueue_floor`: one
``INSERT … SELECT unnest(…)`` per batch, no wake-up rows), after a
``CHECKPOINT``, before or after Trace's part (alternating by run): a row with
``mode: enqueue-floor``, and Trace's row of the run carries
``floor_tasks_per_s`` and ``share_of_floor`` (its tasks/s over the floor's).
The floor is then measured again without the foreign key on ``jobs``
(``no_fk_tasks_per_s``; Trace's row: ``floor_no_fk_tasks_per_s``): what the
specification's per-row foreign-key check costs.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

import anyio
import sqlalchemy as sa

from benchmarks._common import (
    Databases,
    benchmark_parser,
    checkpoint,
    configure_logging,
    emit,
    load_average,
    log,
    require_positive,
    server_cpu_s,
    summarize,
    utcnow,
)
from benchmarks._enqueue_floor import write_floor
from trace_core.standalone import ensure_standalone_job
from trace_core.storage import schema
from trace_core.storage.protocol import NewTask, TaskCreated
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import ENQUEUE_TASK, TaskQueue

__all__ = ["main"]

_KEYS = (
    "seconds",
    "tasks_per_s",
    "client_cpu_us_per_task",
    "postgres_cpu_us_per_task",
    "share_of_floor",
    "no_fk_tasks_per_s",
)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = benchmark_parser("python -m benchmarks.enqueue", __doc__)
    p.add_argument("--tasks", type=int, default=30_000, help="tasks per run")
    p.add_argument("--batch", type=int, default=1000, help="tasks per create() call")
    p.add_argument("--dedupe-keys", action="store_true", help="give every task a dedupe key")
    p.add_argument("--runs", type=int, default=1, help="runs; the summary has medians")
    p.add_argument("--profile", metavar="FILE", help="cProfile the timed loop into FILE")
    p.add_argument(
        "--floor", action="store_true", help="Postgres: also measure the bare insert per run"
    )
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    require_positive(p, args, "tasks", "batch", "runs")
    if args.floor and args.engine != "postgres":
        p.error("--floor: the floor runs on Postgres only")
    return args


async def _woken(repo: SqlRepository) -> list[str]:
    """Every task id the run's wake-up rows carry, in row order."""
    o = schema.outbox
    async with repo.read() as tx:
        rows = await tx.connection.execute(sa.select(o.c.payload).where(o.c.kind == ENQUEUE_TASK))
        return [task_id for (payload,) in rows for task_id in payload["task_ids"]]


async def _run(url: str, args: argparse.Namespace, postmaster: int | None) -> dict[str, Any]:
    repo = SqlRepository(url)
    try:
        job_id = await ensure_standalone_job(repo, "bench", now=utcnow())
        queue = TaskQueue(repo)
        # Open the connection create() runs on (a claim finds the queue empty):
        # the peer connects before its clock starts too.
        assert await queue.claim_batch("warm-up", 1) == []
        profiler = cProfile.Profile() if args.profile else None
        load = load_average()
        pg0 = server_cpu_s(postmaster) if postmaster else 0.0
        cpu0 = os.times()
        started = time.monotonic()
        if profiler is not None:
            profiler.enable()
        answers: list[list[TaskCreated]] = []
        for start in range(0, args.tasks, args.batch):
            stop = min(start + args.batch, args.tasks)
            answers.append(
                await queue.create(
                    [
                        NewTask(job_id, dedupe_key=f"t{i}" if args.dedupe_keys else None)
                        for i in range(start, stop)
                    ]
                )
            )
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)
        seconds = time.monotonic() - started
        cpu1 = os.times()
        pg1 = server_cpu_s(postmaster) if postmaster else 0.0
        created = [c.task_id for done in answers for c in done if c.created]
        async with repo.read() as tx:
            stored = (
                await tx.connection.execute(sa.select(sa.func.count()).select_from(schema.tasks))
            ).scalar_one()
        woken = await _woken(repo)
    finally:
        await repo.close()
    client_cpu = cpu1.user - cpu0.user + cpu1.system - cpu0.system
    return {
        "seconds": round(seconds, 3),
        "tasks_per_s": round(args.tasks / seconds, 1),
        "verified": (
            len(created) == args.tasks == stored
            and sorted(woken) == sorted(str(i) for i in created)
        ),
        "wakeup_rows_task_ids": len(woken),
        "client_cpu_us_per_task": round(1e6 * client_cpu / args.tasks, 1),
        "postgres_cpu_us_per_task": (
            round(1e6 * (pg1 - pg0) / args.tasks, 1) if postmaster else None
        ),
        "load_average_before": load,
    }


async def _floor_job(url: str) -> uuid.UUID:
    repo = SqlRepository(url)
    try:
        return await ensure_standalone_job(repo, "bench", now=utcnow())
    finally:
        await repo.close()


def _measure_floor(dbs: Databases, args: argparse.Namespace, run: int) -> dict[str, Any]:
    url = dbs.fresh(f"enqueuefloor{run}")
    job_id = anyio.run(_floor_job, url, backend="asyncio")
    checkpoint(url)
    log.info("run %d: the floor, %d tasks", run, args.tasks)
    shape = {"tasks": args.tasks, "batch": args.batch, "dedupe_keys": args.dedupe_keys}
    got = write_floor(url, job_id, **shape, postmaster=dbs.postmaster)
    checkpoint(url)
    bare = write_floor(url, job_id, **shape, postmaster=dbs.postmaster, foreign_key=False)
    dbs.drop(url)
    return {
        **got,
        "verified": got["verified"] and bare["verified"],
        "no_fk_tasks_per_s": bare["tasks_per_s"],
        "no_fk_postgres_cpu_us_per_task": bare["postgres_cpu_us_per_task"],
    }


def _measure(dbs: Databases, args: argparse.Namespace, run: int) -> dict[str, Any]:
    url = dbs.fresh(f"enqueue{run}")
    if args.floor:
        checkpoint(url)
    log.info("run %d: enqueueing %d tasks", run, args.tasks)
    got = anyio.run(_run, url, args, dbs.postmaster, backend="asyncio")
    dbs.drop(url)
    return got


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    configure_logging(args.verbose)
    rows: list[dict[str, Any]] = []
    floors: list[dict[str, Any]] = []
    with Databases(args.engine, args.db) as dbs:
        for run in range(args.runs):
            head = {"engine": args.engine, "run": run, "tasks": args.tasks, "batch": args.batch}
            head["dedupe_keys"] = args.dedupe_keys
            floor: dict[str, Any] | None = None
            if args.floor and run % 2:
                floor = _measure_floor(dbs, args, run)
            got = _measure(dbs, args, run)
            if args.floor and floor is None:
                floor = _measure_floor(dbs, args, run)
            row = {**head, "mode": "enqueue", **got}
            if floor is not None:
                floors.append(
                    {**head, "mode": "enqueue-floor", "floor_first": run % 2 == 1, **floor}
                )
                emit(floors[-1])
                row["floor_tasks_per_s"] = floor["tasks_per_s"]
                row["share_of_floor"] = round(row["tasks_per_s"] / floor["tasks_per_s"], 3)
                row["floor_no_fk_tasks_per_s"] = floor["no_fk_tasks_per_s"]
            emit(row)
            rows.append(row)
    if args.runs > 1:
        for mode, mine in (("enqueue", rows), ("enqueue-floor", floors)):
            if not mine:
                continue
            emit(
                {
                    "engine": args.engine,
                    "mode": mode,
                    "summary": True,
                    "runs": args.runs,
                    "dedupe_keys": args.dedupe_keys,
                    "all_verified": all(r["verified"] for r in mine),
                    **summarize(mine, _KEYS),
                }
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
