"""PgQueuer batch enqueue benchmark: N jobs through ``Queries.enqueue`` with lists.

Run by ``python -m benchmarks.compare`` with the peers' virtualenv, or alone:

    PEERS/bin/python benchmarks/peers/pgqueuer_enqueue.py \
        --db postgresql://USER@HOST:PORT/postgres \
        --jobs 30000 --batch 1000 --runs 3

A fresh database per run with PgQueuer's schema installed; the connection is
open before the clock starts. The clock runs over ``enqueue(entrypoints,
payloads, priorities)`` calls of ``--batch`` jobs each (one statement per call
in autocommit: the jobs, their ``queued`` log rows and PgQueuer's notify
trigger) until all N are in. The run is verified by counting the queued jobs.
``--dedupe-keys`` gives every job a dedupe key (``dedupe_key`` list,
``on_conflict="skip"``: a taken key answers ``None``, as Trace's ``create``
answers the task that holds it), for the pair's dedupe row.
Prints one JSON line per run + a summary (``median_jobs_per_s``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid

import asyncpg
from _peer_common import drop_database, family_cpu_s, print_runs, print_summary, proc_stat


def _dsn(server: str, db: str) -> str:
    return server.rsplit("/", 1)[0] + "/" + db


async def _run(server: str, name: str, jobs: int, batch: int, dedupe_keys: bool) -> dict:
    from pgqueuer import AsyncpgDriver, Queries

    admin = await asyncpg.connect(server)
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    conn = await asyncpg.connect(_dsn(server, name))
    try:
        q = Queries(AsyncpgDriver(conn))
        await q.install()
        backend = await conn.fetchval("SELECT pg_backend_pid()")
        stat = proc_stat(int(backend))
        assert stat is not None
        postmaster = stat[0]
        load = os.getloadavg()[0]
        pg0, cpu0 = family_cpu_s(postmaster), os.times()
        t0 = time.monotonic()
        for start in range(0, jobs, batch):
            n = min(batch, jobs - start)
            if dedupe_keys:
                keys: list[str | None] = [f"t{i}" for i in range(start, start + n)]
                await q.enqueue(["noop"] * n, [None] * n, [0] * n, None, keys, on_conflict="skip")
            else:
                await q.enqueue(["noop"] * n, [None] * n, [0] * n)
        seconds = time.monotonic() - t0
        cpu1, pg1 = os.times(), family_cpu_s(postmaster)
        queued = await conn.fetchval("SELECT count(*) FROM pgqueuer WHERE status = 'queued'")
    finally:
        await conn.close()
    return {
        "seconds": seconds,
        "queued": int(queued),
        "client_cpu_s": cpu1.user - cpu0.user + cpu1.system - cpu0.system,
        "postgres_cpu_s": pg1 - pg0,
        "load": load,
    }


def run_once(args: argparse.Namespace, run: int) -> dict:
    name = f"pgq_enq_{uuid.uuid4().hex[:8]}"
    try:
        got = asyncio.run(_run(args.db, name, args.jobs, args.batch, args.dedupe_keys))
    finally:
        asyncio.run(drop_database(args.db, name))
    return {
        "peer": "pgqueuer",
        "version": __import__("pgqueuer").__version__,
        "run": run,
        "jobs": args.jobs,
        "batch": args.batch,
        "dedupe_keys": args.dedupe_keys,
        "seconds": round(got["seconds"], 3),
        "jobs_per_s": round(args.jobs / got["seconds"], 1),
        "verified": got["queued"] == args.jobs,
        "client_cpu_us_per_job": round(1e6 * got["client_cpu_s"] / args.jobs, 1),
        "postgres_cpu_us_per_job": round(1e6 * got["postgres_cpu_s"] / args.jobs, 1),
        "load_average_before": round(got["load"], 2),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--db", required=True, help="server URL (a new database per run)")
    p.add_argument("--jobs", type=int, default=30000)
    p.add_argument("--batch", type=int, default=1000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dedupe-keys", action="store_true", help="give every job a dedupe key")
    args = p.parse_args()
    rows = print_runs(args.runs, lambda run: run_once(args, run))
    print_summary(
        "pgqueuer",
        rows,
        jobs=args.jobs,
        batch=args.batch,
        dedupe_keys=args.dedupe_keys,
        median_client_cpu_us_per_job=statistics.median(r["client_cpu_us_per_job"] for r in rows),
        median_postgres_cpu_us_per_job=statistics.median(
            r["postgres_cpu_us_per_job"] for r in rows
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
