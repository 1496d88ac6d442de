"""Drain mode: enqueue N no-op tasks, then drain them with C processes x K consumers.

Every consumer loops ``claim_batch(B)`` -> ``complete_many(fences)`` through the
public :class:`~trace_core.tasks.TaskQueue` API, with fencing on, until a claim
comes back empty. The clock starts when all worker processes are connected and
released together, and stops when the last one has found the queue empty.
"""

from __future__ import annotations

import cProfile
import logging
import multiprocessing as mp
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.synchronize import Barrier, Event
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import sqlalchemy as sa

from benchmarks._common import (
    Databases,
    count_tasks,
    current_rss_mb,
    load_average,
    log,
    machine_busy_s,
    peak_rss_mb,
    server_cpu_s,
    utcnow,
)
from trace_core.standalone import ensure_standalone_job
from trace_core.storage.engine import EngineSettings
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import TaskQueue

__all__ = ["DrainParams", "run_drain"]

JOB_NAME = "bench"


@dataclass(frozen=True)
class DrainParams:
    """What one drain run does."""

    tasks: int
    workers: int
    consumers: int
    batch: int
    enqueue_batch: int = 1000
    wakeup_outbox: bool = True
    dedupe_keys: bool = False
    profile_dir: str | None = None
    fill: str = "api"
    """``api``: enqueue through ``TaskQueue.create`` (measured); ``sql``: one bulk
    ``INSERT … SELECT`` fixture (for very large drains; enqueue not measured)."""


@dataclass(frozen=True)
class _WorkerConfig:
    url: str
    index: int
    consumers: int
    batch: int
    profile_dir: str | None


# --- the worker process ----------------------------------------------------------


def _worker_main(cfg: _WorkerConfig, barrier: Barrier, go: Event, results: Any) -> None:
    """Entry point of one worker process (spawn start method)."""
    logging.basicConfig(level=logging.WARNING, format=f"[worker {cfg.index}] %(message)s")
    try:
        out = anyio.run(_worker, cfg, barrier, go, backend="asyncio")
    except BaseException as exc:
        results.put({"index": cfg.index, "error": repr(exc)})
        raise
    results.put(out)


async def _worker(cfg: _WorkerConfig, barrier: Barrier, go: Event) -> dict[str, Any]:
    repo = SqlRepository(
        cfg.url, EngineSettings(pool_size=cfg.consumers, max_overflow=cfg.consumers)
    )
    queue = TaskQueue(repo)
    worker_id = f"bench-{cfg.index}-{os.getpid()}"
    stats = {"completed": 0, "stale": 0, "rounds": 0, "claim_s": 0.0, "complete_s": 0.0}

    async def warm() -> None:
        # A long-running worker has a full pool: open one connection per consumer.
        async with repo.read() as tx:
            await tx.connection.execute(sa.text("SELECT 1"))

    async with anyio.create_task_group() as tg:
        for _ in range(cfg.consumers):
            tg.start_soon(warm)

    async def consume() -> None:
        clock = time.monotonic
        while True:
            t0 = clock()
            leases = await queue.claim_batch(worker_id, cfg.batch)
            t1 = clock()
            stats["claim_s"] += t1 - t0
            if not leases:
                return
            done = await queue.complete_many([lease.fence for lease in leases])
            stats["complete_s"] += clock() - t1
            stats["rounds"] += 1
            stats["completed"] += len(done)
            stats["stale"] += len(leases) - len(done)

    rss_start = peak_rss_mb()
    rss_now_start = current_rss_mb()
    await anyio.to_thread.run_sync(barrier.wait)
    await anyio.to_thread.run_sync(go.wait)
    # CPU time, not wall time: on a saturated machine wall time lands on whatever
    # call happened to be running when the scheduler switched away.
    profiler = cProfile.Profile(time.process_time) if cfg.profile_dir else None
    cpu0 = os.times()
    started = time.monotonic()
    if profiler is not None:
        profiler.enable()
    async with anyio.create_task_group() as tg:
        for _ in range(cfg.consumers):
            tg.start_soon(consume)
    if profiler is not None:
        profiler.disable()
        assert cfg.profile_dir is not None
        profiler.dump_stats(str(Path(cfg.profile_dir) / f"drain-w{cfg.index}-{os.getpid()}.prof"))
    finished = time.monotonic()
    cpu1 = os.times()
    await repo.close()
    return {
        "index": cfg.index,
        "started": started,
        "finished": finished,
        "cpu_s": (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system),
        "rss_start_mb": rss_start,
        "rss_end_mb": peak_rss_mb(),
        "rss_now_start_mb": rss_now_start,
        "rss_now_end_mb": current_rss_mb(),
        **stats,
    }


# --- the driver ------------------------------------------------------------------------


async def _job(url: str) -> uuid.UUID:
    repo = SqlRepository(url)
    try:
        return await ensure_standalone_job(repo, JOB_NAME, now=utcnow())
    finally:
        await repo.close()


async def _enqueue(url: str, params: DrainParams) -> float:
    """Create the standalone job and N tasks; the seconds the tasks took."""
    repo = SqlRepository(url)
    try:
        job_id = await ensure_standalone_job(repo, JOB_NAME, now=utcnow())
        queue = TaskQueue(repo, wakeup_outbox=params.wakeup_outbox)
        started = time.monotonic()
        for start in range(0, params.tasks, params.enqueue_batch):
            stop = min(start + params.enqueue_batch, params.tasks)
            await queue.create(
                [
                    NewTask(job_id, dedupe_key=f"t{i}" if params.dedupe_keys else None)
                    for i in range(start, stop)
                ]
            )
        return time.monotonic() - started
    finally:
        await repo.close()


def run_drain(
    dbs: Databases, params: DrainParams, run: int, emit: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """One drain run on a fresh database; emits and returns its result object."""
    url = dbs.fresh(f"drain{run}")
    log.info("run %d: enqueueing %d tasks (%s)", run, params.tasks, params.fill)
    enqueue_s: float | None
    if params.fill == "sql":
        from benchmarks._claim_cost import fill_queued

        fill_queued(url, anyio.run(_job, url, backend="asyncio"), params.tasks)
        enqueue_s = None
    else:
        enqueue_s = anyio.run(_enqueue, url, params, backend="asyncio")

    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(params.workers + 1)
    go = ctx.Event()
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker_main,
            args=(
                _WorkerConfig(url, i, params.consumers, params.batch, params.profile_dir),
                barrier,
                go,
                results,
            ),
            name=f"trace-bench-worker-{i}",
        )
        for i in range(params.workers)
    ]
    for p in procs:
        p.start()
    try:
        barrier.wait(timeout=120)
        pm = dbs.postmaster
        load = load_average()
        pg0 = server_cpu_s(pm) if pm else 0.0
        busy0 = machine_busy_s()
        started = time.monotonic()
        go.set()
        outs = [results.get(timeout=3600) for _ in procs]
        busy1 = machine_busy_s()
        pg1 = server_cpu_s(pm) if pm else 0.0
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    errors = [o for o in outs if "error" in o]
    if errors:
        raise RuntimeError(f"worker failed: {errors}")
    outs.sort(key=lambda o: o["index"])
    seconds = max(o["finished"] for o in outs) - started
    counts = count_tasks(url)
    completed = sum(o["completed"] for o in outs)
    rounds = sum(o["rounds"] for o in outs)
    verified = (
        counts.get("Completed", 0) == params.tasks
        and sum(counts.values()) == params.tasks
        and completed == params.tasks
    )
    worker_cpu = sum(o["cpu_s"] for o in outs)
    cores = os.cpu_count() or 1
    result: dict[str, Any] = {
        "engine": dbs.engine,
        "mode": "drain",
        "run": run,
        "tasks": params.tasks,
        "workers": params.workers,
        "consumers_per_worker": params.consumers,
        "batch": params.batch,
        "seconds": round(seconds, 3),
        "tasks_per_s": round(params.tasks / seconds, 1),
        "fill": params.fill,
        "enqueue_seconds": round(enqueue_s, 3) if enqueue_s else None,
        "enqueue_per_s": round(params.tasks / enqueue_s, 1) if enqueue_s else None,
        "enqueue_batch": params.enqueue_batch,
        "wakeup_outbox": params.wakeup_outbox,
        "dedupe_keys": params.dedupe_keys,
        "verified": verified,
        "status_counts": counts,
        "stale": sum(o["stale"] for o in outs),
        "claim_rounds": rounds,
        "claim_ms_avg": round(1000 * sum(o["claim_s"] for o in outs) / max(rounds, 1), 3),
        "complete_ms_avg": round(1000 * sum(o["complete_s"] for o in outs) / max(rounds, 1), 3),
        "worker_cpu_s": round(worker_cpu, 2),
        "worker_cpu_us_per_task": round(1e6 * worker_cpu / params.tasks, 1),
        "postgres_cpu_s": round(pg1 - pg0, 2) if pm else None,
        "postgres_cpu_us_per_task": round(1e6 * (pg1 - pg0) / params.tasks, 1) if pm else None,
        "machine_cpu_busy_pct": round(100 * (busy1 - busy0) / (seconds * cores), 1),
        # CPU the machine spent on anything but this run (other jobs skew the figures).
        "other_cpu_pct": round(
            100 * max(0.0, busy1 - busy0 - worker_cpu - (pg1 - pg0)) / (seconds * cores), 1
        ),
        "load_average_before": load,
        # What the run would reach if it had the machine to itself and stayed CPU-bound:
        # cores / (worker + server CPU per task). An estimate, for noisy machines.
        "cpu_bound_tasks_per_s": (
            round(params.tasks * cores / (worker_cpu + pg1 - pg0), 1) if pm else None
        ),
        "worker_rss_start_mb": [o["rss_start_mb"] for o in outs],
        "worker_rss_end_mb": [o["rss_end_mb"] for o in outs],
        "worker_rss_now_start_mb": [o["rss_now_start_mb"] for o in outs],
        "worker_rss_now_end_mb": [o["rss_now_end_mb"] for o in outs],
        "params": asdict(params),
    }
    if dbs.server_info:
        result["server"] = dbs.server_info
    emit(result)
    dbs.drop(url)
    return result
