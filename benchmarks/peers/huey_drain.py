"""huey SqliteHuey drain benchmark: N no-op tasks on a file, consumer with W workers.

Run by ``python -m benchmarks.compare`` with the peers' virtualenv, or alone:

    PEERS/bin/python benchmarks/peers/huey_drain.py --jobs 20000 --workers 4 --runs 3

A fresh database file per run; N tasks enqueued (huey has no batch enqueue: one
INSERT+commit each), then huey's own Consumer (the huey_consumer machinery)
runs with W workers of the given type in a child process. The clock runs from
starting the consumer until the task counter (a shared integer the no-op task
increments) reaches N. ``--sync normal`` opens huey's connections with
``synchronous=NORMAL`` (Trace's SQLite setting); the default is huey's own
(``fsync=None`` = SQLite's default, FULL: an fsync per commit).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import tempfile
import time

from _peer_common import family_cpu_s, machine_busy_s, print_runs, print_summary
from huey import SqliteHuey
from huey.storage import SqliteStorage

COUNTER = mp.Value("q", 0, lock=True)  # forked into the consumer's workers


class NormalSyncStorage(SqliteStorage):
    def _create_connection(self):  # type: ignore[no-untyped-def]
        conn = super()._create_connection()
        conn.execute("pragma synchronous=NORMAL")
        return conn


def make_huey(path: str, sync: str) -> SqliteHuey:
    if sync == "normal":
        return SqliteHuey("bench", filename=path, storage_class=NormalSyncStorage)
    return SqliteHuey("bench", filename=path)


HUEY: SqliteHuey | None = None


def build(path: str, sync: str):  # type: ignore[no-untyped-def]
    global HUEY
    HUEY = make_huey(path, sync)

    @HUEY.task()
    def noop() -> None:
        with COUNTER.get_lock():
            COUNTER.value += 1

    return HUEY, noop


def _consume(huey: SqliteHuey, workers: int, worker_type: str) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)
    consumer = huey.create_consumer(
        workers=workers, worker_type=worker_type, periodic=False, check_worker_health=False
    )
    consumer.run()


def run_once(args: argparse.Namespace, run: int, tmp: str) -> dict:
    path = os.path.join(tmp, f"huey-{run}.db")
    huey, noop = build(path, args.sync)
    COUNTER.value = 0
    t0 = time.monotonic()
    for _ in range(args.jobs):
        noop()
    enqueue_s = time.monotonic() - t0
    assert huey.pending_count() == args.jobs
    ctx = mp.get_context("fork")
    load = os.getloadavg()[0]
    proc = ctx.Process(target=_consume, args=(huey, args.workers, args.worker_type))
    b0 = machine_busy_s()
    started = time.monotonic()
    proc.start()
    while COUNTER.value < args.jobs:
        time.sleep(0.002)
        if time.monotonic() - started > 3600:
            raise RuntimeError("timeout")
    seconds = time.monotonic() - started
    b1 = machine_busy_s()
    cpu = family_cpu_s(proc.pid)  # the workers are still alive: their own time
    proc.terminate()
    proc.join(timeout=30)
    left = huey.pending_count()
    cores = os.cpu_count() or 1
    return {
        "peer": "huey",
        "version": __import__("huey").__version__,
        "run": run,
        "jobs": args.jobs,
        "workers": args.workers,
        "worker_type": args.worker_type,
        "sync": args.sync,
        "seconds": round(seconds, 3),
        "jobs_per_s": round(args.jobs / seconds, 1),
        "enqueue_per_s": round(args.jobs / enqueue_s, 1),
        "verified": left == 0 and COUNTER.value == args.jobs,
        "consumer_cpu_us_per_job": round(1e6 * cpu / args.jobs, 1),
        "machine_cpu_busy_pct": round(100 * (b1 - b0) / (seconds * cores), 1),
        "other_cpu_pct": round(100 * max(0.0, b1 - b0 - cpu) / (seconds * cores), 1),
        "load_average_before": round(load, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", type=int, default=20000)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--worker-type", choices=("process", "thread", "greenlet"), default="process")
    p.add_argument("--sync", choices=("default", "normal"), default="default")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="huey-bench-")
    try:
        rows = print_runs(args.runs, lambda run: run_once(args, run, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print_summary(
        "huey",
        rows,
        workers=args.workers,
        worker_type=args.worker_type,
        sync=args.sync,
        jobs=args.jobs,
    )


if __name__ == "__main__":
    main()
