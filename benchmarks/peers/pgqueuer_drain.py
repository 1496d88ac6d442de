"""PgQueuer drain benchmark: N no-op jobs, W worker processes, default batch size.

Run by ``python -m benchmarks.compare`` with the peers' virtualenv, or alone:

    PEERS/bin/python benchmarks/peers/pgqueuer_drain.py --db postgresql://USER@HOST:PORT/postgres \
        --jobs 20000 --workers 4 --runs 3

A fresh database per run; jobs are enqueued in batches of 1000 (one statement
each), then W processes (spawn) each run a QueueManager in drain mode with a
no-op async entrypoint and PgQueuer's default batch_size (10). The clock runs
from releasing the workers until the last process has exited its run() loop
(queue empty, completions flushed). Prints one JSON line per run + a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import time
import uuid

import asyncpg
from _peer_common import (
    drop_database,
    family_cpu_s,
    machine_busy_s,
    print_runs,
    print_summary,
    proc_stat,
)


def _dsn(server: str, db: str) -> str:
    return server.rsplit("/", 1)[0] + "/" + db


async def _setup(server: str, name: str, jobs: int) -> float:
    from pgqueuer import AsyncpgDriver, Queries

    admin = await asyncpg.connect(server)
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    conn = await asyncpg.connect(_dsn(server, name))
    q = Queries(AsyncpgDriver(conn))
    await q.install()
    t0 = time.monotonic()
    for start in range(0, jobs, 1000):
        n = min(1000, jobs - start)
        await q.enqueue(["noop"] * n, [None] * n, [0] * n)
    took = time.monotonic() - t0
    await conn.close()
    return took


def _worker(dsn: str, batch: int | None, barrier, go, results) -> None:  # type: ignore[no-untyped-def]
    async def main() -> dict:
        from pgqueuer import AsyncpgDriver, Queries, QueueManager
        from pgqueuer.types import QueueExecutionMode

        conn = await asyncpg.connect(dsn)
        qm = QueueManager(Queries(AsyncpgDriver(conn)))
        done = 0
        last = 0.0

        @qm.entrypoint("noop")
        async def noop(job) -> None:  # type: ignore[no-untyped-def]
            nonlocal done, last
            done += 1
            last = time.monotonic()

        await asyncio.to_thread(barrier.wait)
        await asyncio.to_thread(go.wait)
        cpu0 = os.times()
        kwargs = {"mode": QueueExecutionMode.drain}
        if batch is not None:
            kwargs["batch_size"] = batch
        await qm.run(**kwargs)
        finished = time.monotonic()
        cpu1 = os.times()
        await conn.close()
        return {
            "finished": finished,
            "last_job": last,
            "done": done,
            "cpu_s": cpu1.user - cpu0.user + cpu1.system - cpu0.system,
        }

    try:
        results.put(asyncio.run(main()))
    except BaseException as exc:
        results.put({"error": repr(exc)})
        raise


async def _verify(dsn: str) -> tuple[int, int]:
    conn = await asyncpg.connect(dsn)
    left = await conn.fetchval("SELECT count(*) FROM pgqueuer")
    logged = await conn.fetchval("SELECT count(*) FROM pgqueuer_log WHERE status = 'successful'")
    await conn.close()
    return int(left), int(logged)


def _postmaster(server: str) -> int:
    async def q() -> int:
        c = await asyncpg.connect(server)
        pid = await c.fetchval("SELECT pg_backend_pid()")
        stat = proc_stat(int(pid))  # while the backend is alive
        await c.close()
        assert stat is not None
        return stat[0]

    return asyncio.run(q())


def run_once(args: argparse.Namespace, run: int) -> dict:
    name = f"pgq_bench_{uuid.uuid4().hex[:8]}"
    enqueue_s = asyncio.run(_setup(args.db, name, args.jobs))
    dsn = _dsn(args.db, name)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(args.workers + 1)
    go = ctx.Event()
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(dsn, args.batch, barrier, go, results))
        for _ in range(args.workers)
    ]
    for p in procs:
        p.start()
    barrier.wait(timeout=120)
    load = os.getloadavg()[0]
    pm = _postmaster(args.db)
    pg0 = family_cpu_s(pm)
    b0 = machine_busy_s()
    started = time.monotonic()
    go.set()
    outs = [results.get(timeout=3600) for _ in procs]
    b1 = machine_busy_s()
    pg1 = family_cpu_s(pm)
    for p in procs:
        p.join(timeout=60)
    if any("error" in o for o in outs):
        raise RuntimeError(outs)
    seconds = max(o["finished"] for o in outs) - started
    last_job_s = max(o["last_job"] for o in outs) - started
    left, logged = asyncio.run(_verify(dsn))
    asyncio.run(drop_database(args.db, name))
    done = sum(o["done"] for o in outs)
    wcpu = sum(o["cpu_s"] for o in outs)
    cores = os.cpu_count() or 1
    return {
        "peer": "pgqueuer",
        "version": __import__("pgqueuer").__version__,
        "run": run,
        "jobs": args.jobs,
        "workers": args.workers,
        "batch": args.batch or "default(10)",
        "seconds": round(seconds, 3),
        "jobs_per_s": round(args.jobs / seconds, 1),
        "last_job_seconds": round(last_job_s, 3),
        "enqueue_per_s": round(args.jobs / enqueue_s, 1),
        "verified": left == 0 and logged == args.jobs and done == args.jobs,
        "worker_cpu_us_per_job": round(1e6 * wcpu / args.jobs, 1),
        "machine_cpu_busy_pct": round(100 * (b1 - b0) / (seconds * cores), 1),
        "postgres_cpu_us_per_job": round(1e6 * (pg1 - pg0) / args.jobs, 1),
        "other_cpu_pct": round(100 * max(0, b1 - b0 - wcpu - (pg1 - pg0)) / (seconds * cores), 1),
        "cpu_bound_jobs_per_s": round(args.jobs * cores / (wcpu + pg1 - pg0), 1),
        "load_average_before": round(load, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--db", required=True, help="server URL (a new database per run)")
    p.add_argument("--jobs", type=int, default=20000)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch", type=int, default=None, help="default: PgQueuer's own (10)")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    rows = print_runs(args.runs, lambda run: run_once(args, run))
    print_summary("pgqueuer", rows, workers=args.workers, jobs=args.jobs)


if __name__ == "__main__":
    sys.exit(main())
