"""v1 worker benchmark: claim -> complete over HTTP, on Redis Streams and without.

    python -m benchmarks.streams --engine postgres --workers 4 --tasks 1000 --runs 3

Per run and per transport (``redis``: ``trace-lite serve --redis-url`` on a
throwaway ``redis-server``; ``database``: ``serve`` without Redis, whose
claims take in-process wake-ups and the database fallback), in alternating
order from run to run so neither always goes first:

- **throughput**: a fresh database with a one-job DAG (``runtime:
  ecs_platform``); ``--tasks`` tasks are created through ``POST
  /internal/trigger`` (not timed); ``--workers`` worker OS processes loop
  ``POST /internal/worker/claim`` -> ``POST /internal/worker/complete`` until
  a claim comes back empty. ``tasks_per_s`` = tasks / (last completion -
  start signal).
- **wake-up latency**: one idle long-polling claim (``max_wait_ms`` 5000);
  a task is triggered and the time from the trigger's request to the
  claim's answer is recorded, ``--latency-samples`` times (the task is
  completed before the next sample); ``wakeup_p50_ms`` / ``wakeup_p99_ms``.

- **server CPU per task** (``server_cpu_ms_per_task``): the CPU time the
  ``serve`` process used over the throughput phase (``/proc/<pid>/stat``),
  divided by the tasks: what a claim and its completion cost the control
  plane, whatever else the shared machine runs.
- **Redis commands per task** (``redis_commands_per_task``, and per command
  in ``redis_commands``): the server's ``INFO commandstats`` calls over the
  throughput phase, divided by the tasks: the round trips a claim and its
  completion spend on the transport.

Every task must end ``Completed`` (``verified``). One JSON object per run
holds both transports' figures (``redis_*`` and ``database_*``) and their
ratio; then a summary with medians. Logs go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from benchmarks._common import (
    Databases,
    benchmark_parser,
    configure_logging,
    count_tasks,
    emit,
    load_average,
    log,
    percentile,
    summarize,
)
from benchmarks.api import AUTH, _create_tasks, _deploy, _start_server

__all__ = ["main"]

STREAM = "trace-ecs-platform"
TRANSPORTS = ("redis", "database")
_FIGURES = ("tasks_per_s", "wakeup_p50_ms", "wakeup_p99_ms", "server_cpu_ms_per_task")
_KEYS = (
    *[f"{t}_{k}" for t in TRANSPORTS for k in _FIGURES],
    "redis_over_database",
    "redis_commands_per_task",
)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = benchmark_parser("python -m benchmarks.streams", __doc__)
    p.add_argument("--workers", type=int, default=4, help="worker OS processes")
    p.add_argument("--tasks", type=int, default=1000, help="tasks per run and transport")
    p.add_argument("--latency-samples", type=int, default=20, help="wake-ups timed per run")
    p.add_argument("--runs", type=int, default=3, help="runs; the summary has medians")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    for name in ("workers", "tasks", "latency_samples", "runs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


async def _claim(client: Any, worker_id: str, wait_ms: int) -> dict[str, Any]:
    answer = await client.post(
        "/internal/worker/claim",
        json={"worker_id": worker_id, "streams": [STREAM], "max_wait_ms": wait_ms},
    )
    answer.raise_for_status()
    body: dict[str, Any] = answer.json()
    return body


async def _complete(client: Any, worker_id: str, claimed: dict[str, Any]) -> None:
    report = {
        "worker_id": worker_id,
        **{k: claimed[k] for k in ("job_id", "attempt_id", "lease_token")},
        "stream": claimed["stream"],
        "message_id": claimed["message_id"],
        "result": {"events": []},
    }
    answer = await client.post("/internal/worker/complete", json=report)
    answer.raise_for_status()


async def _work(base: str, worker_id: str) -> tuple[int, float]:
    """Claim and complete until a claim comes back empty: (tasks, last completion)."""
    import httpx

    done, last = 0, time.perf_counter()
    async with httpx.AsyncClient(base_url=base, headers=AUTH, timeout=60) as client:
        while (claimed := await _claim(client, worker_id, 200))["claimed"]:
            await _complete(client, worker_id, claimed)
            done, last = done + 1, time.perf_counter()
    return done, last


def _worker_process(base: str, index: int, start: Any, results: Any) -> None:
    """A worker OS process: wait for the start signal, drain, report."""
    start.wait()
    try:
        results.put((*asyncio.run(_work(base, f"bench-{index}")), None))
    except Exception as exc:  # reported to the parent, which fails the run
        results.put((0, 0.0, repr(exc)))


def _throughput(base: str, workers: int, tasks: int) -> float:
    context = mp.get_context("spawn")
    start = context.Event()
    results = context.Queue()
    procs = [
        context.Process(target=_worker_process, args=(base, i, start, results))
        for i in range(workers)
    ]
    for proc in procs:
        proc.start()
    time.sleep(0.5)  # let the interpreters start: setup, not synchronization of results
    began = time.perf_counter()
    start.set()
    done, last, errors = 0, began, []
    for _ in procs:
        count, finished, error = results.get(timeout=600)
        done, last = done + count, max(last, finished)
        if error:
            errors.append(error)
    for proc in procs:
        proc.join(timeout=60)
    if errors or done != tasks:
        raise RuntimeError(f"workers failed ({done}/{tasks} tasks): {errors}")
    return tasks / (last - began)


async def _latency(base: str, samples: int) -> list[float]:
    """Milliseconds from a trigger's request to the waiting claim's answer."""
    import httpx

    out: list[float] = []
    async with httpx.AsyncClient(base_url=base, headers=AUTH, timeout=60) as client:
        for index in range(samples):
            answers: list[tuple[float, dict[str, Any]]] = []

            async def wait(
                client: httpx.AsyncClient = client,
                answers: list[tuple[float, dict[str, Any]]] = answers,
            ) -> None:
                claimed = await _claim(client, "latency", 5000)
                answers.append((time.perf_counter(), claimed))

            async with anyio.create_task_group() as group:
                group.start_soon(wait)
                await anyio.sleep(0.05)  # pacing: the claim is in its long-poll
                sent = time.perf_counter()
                created = await client.post(
                    "/internal/trigger", json={"job": "bench/work", "key": f"lat{index}"}
                )
                created.raise_for_status()
            [(answered, claimed)] = answers
            if not claimed["claimed"]:
                raise RuntimeError("a wake-up was not claimed within 5 s")
            await _complete(client, "latency", claimed)
            out.append((answered - sent) * 1000)
    return out


def _one(
    args: argparse.Namespace, dbs: Databases, run: int, transport: str, scratch: Path, redis: Any
) -> dict[str, Any]:
    url = dbs.fresh(f"streams{run}{transport}")
    anyio.run(_deploy, url, "internal")  # the ecs_platform DAG: its stream is STREAM
    extra: list[str] = []
    if transport == "redis":
        redis.restart()  # empty streams for each run
        extra = ["--redis-url", redis.url]
    server, base = _start_server(
        url, scratch / f"data{run}{transport}", scratch / f"serve{run}{transport}.log", extra
    )
    try:
        anyio.run(_create_tasks, base, args.tasks)
        before = _command_calls(redis.url) if transport == "redis" else {}
        cpu_before = _cpu_seconds(server.pid)
        tasks_per_s = _throughput(base, args.workers, args.tasks)
        cpu_after = _cpu_seconds(server.pid)
        after = _command_calls(redis.url) if transport == "redis" else {}
        latencies = anyio.run(_latency, base, args.latency_samples)
    finally:
        server.terminate()
        server.wait(timeout=60)
    statuses = count_tasks(url)
    figures: dict[str, Any] = {
        "tasks_per_s": round(tasks_per_s, 1),
        "wakeup_p50_ms": round(percentile(latencies, 50), 2),
        "wakeup_p99_ms": round(percentile(latencies, 99), 2),
        "verified": statuses == {"Completed": args.tasks + args.latency_samples},
    }
    if cpu_before is not None and cpu_after is not None:
        figures["server_cpu_ms_per_task"] = round((cpu_after - cpu_before) * 1000 / args.tasks, 2)
    if transport == "redis":
        per_task = {
            name: round((calls - before.get(name, 0)) / args.tasks, 2)
            for name, calls in sorted(after.items())
            if calls > before.get(name, 0) and name != "info"
        }
        figures["commands_per_task"] = round(sum(per_task.values()), 2)
        figures["commands"] = per_task
    return figures


def _cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) the process has used so far; ``None`` where
    ``/proc`` does not say (not Linux). CPU time, unlike wall time, hardly
    depends on what else the shared machine runs."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    # utime and stime: fields 14 and 15 of stat(5), counted after the ")".
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _command_calls(url: str) -> dict[str, int]:
    """Calls per command the Redis server served so far (``INFO commandstats``)."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        stats: Any = client.info("commandstats")
    finally:
        client.close()
    return {
        name.removeprefix("cmdstat_"): int(value["calls"])
        for name, value in stats.items()
        if name.startswith("cmdstat_")
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (module docstring); the exit code."""
    from trace_lite.redis_server import RedisServer

    args = _parse(argv)
    configure_logging(args.verbose, "httpx")
    rows = []
    with (
        Databases(args.engine, args.db) as dbs,
        tempfile.TemporaryDirectory() as scratch,
        RedisServer() as redis,
    ):
        for run in range(args.runs):
            load = load_average()
            order = TRANSPORTS if run % 2 == 0 else TRANSPORTS[::-1]
            figures = {t: _one(args, dbs, run, t, Path(scratch), redis) for t in order}
            row: dict[str, Any] = {
                "bench": "streams",
                "engine": args.engine,
                "run": run,
                "workers": args.workers,
                "tasks": args.tasks,
                "order": list(order),
                "load_average": load,
            }
            for transport in TRANSPORTS:
                for key, value in figures[transport].items():
                    row[f"{transport}_{key}"] = value
            row["redis_over_database"] = round(
                row["redis_tasks_per_s"] / row["database_tasks_per_s"], 3
            )
            emit(row)
            rows.append(row)
    if args.runs > 1:
        emit(
            {
                "bench": "streams",
                "engine": args.engine,
                "summary": True,
                "runs": args.runs,
                "workers": args.workers,
                "tasks": args.tasks,
                "all_verified": all(r["redis_verified"] and r["database_verified"] for r in rows),
                **summarize(rows, _KEYS),
            }
        )
    log.info("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
