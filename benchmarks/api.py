"""HTTP API benchmark: claim -> heartbeat -> complete round trips through ``trace-lite serve``.

    python -m benchmarks.api --engine postgres --workers 4 --tasks 2000 --runs 3
    python -m benchmarks.api --engine postgres --path all --runs 3

Per run and path: a fresh migrated database gets a one-job DAG (a manual
source on ``runtime: ecs_platform`` for the ``internal`` and ``task`` paths,
on ``runtime: ecs_udf`` for ``v1``, whose worker stream is ``trace-ecs-udf``;
nothing runs either in-process); ``trace-lite serve`` starts in a subprocess
on a free loopback port; ``--tasks`` tasks are created through
``POST /internal/trigger`` (not timed); then ``--workers`` worker OS
processes, each with its own client (one keep-alive connection:
``httpx.AsyncClient``, what ``trace_core.worker`` uses, or with ``--client
raw`` the minimal one of ``benchmarks/_raw_http.py``, which spends a fraction
of httpx's CPU so that the server, not the clients, is what saturates the
machine) and one request in flight, run their share of the triples. The
clock runs from a shared start signal, given once every worker process
has started and imported its client, to the last completion. The three
worker paths (``--path``, ``all`` runs each in turn within every run):

- ``internal``: ``POST /internal/task-claim`` (by id) ->
  ``/internal/heartbeat`` -> ``/internal/task-complete`` (the internal token);
- ``task``: the same claim, then ``/v1/task/heartbeat`` ->
  ``/v1/task/complete`` with the claim's capability token (verified per call);
- ``v1``: ``POST /internal/worker/claim`` (the next job of the stream) ->
  ``/internal/worker/heartbeat`` -> ``/internal/worker/complete``;
- ``floor`` (Postgres): the same workers against the minimal ASGI app of
  :mod:`benchmarks._api_floor` instead of ``serve``: uvicorn served as
  ``serve`` serves, and one fenced statement per route on psycopg directly
  (claim with ``SKIP LOCKED`` and a lease, heartbeat, complete), no auth.
  Its tasks are made with ``TaskQueue.create`` (not timed). It is the cost
  of HTTP plus the SQL a triple needs; when a run measures it, it comes
  first and every other path's row of that run carries ``share_of_floor``
  (its triples/s over the floor's) and ``cpu_over_floor`` (its server CPU
  per triple over the floor's).

``--path`` takes one path, a comma-separated list, or ``all`` (the three
Trace paths: ``all,floor`` adds the floor).

One JSON object per run and path on stdout (``bench, engine, path, workers,
tasks, seconds, round_trips_per_s`` = triples per second, ``p50_ms``/``p99_ms``
per triple, ``server_cpu_ms_per_triple`` = CPU of the ``serve`` process over
the timed part divided by the triples, ``postgres_cpu_ms_per_triple``
likewise for a local Postgres server, ``client_cpu_ms_per_triple`` for the
worker processes, and the 1-minute ``load_average`` before the run), then a
summary per path with medians when ``--runs`` > 1; logs go to stderr.
Without ``--db`` Postgres runs on a throwaway cluster, SQLite on temporary
files.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from benchmarks._api_workers import AUTH, FLOOR, STREAM, TOKEN, worker_process
from benchmarks._common import (
    Databases,
    benchmark_parser,
    configure_logging,
    count_tasks,
    emit,
    load_average,
    log,
    percentile,
    require_positive,
    server_cpu_s,
    summarize,
    utcnow,
)
from trace_core.api.capability import CAPABILITY_HEADER

__all__ = ["AUTH", "STREAM", "TOKEN", "main"]

OPERATORS_REF = "benchmarks.api:OPERATORS_FACTORY"
_KEYS = (
    "seconds",
    "round_trips_per_s",
    "p50_ms",
    "p99_ms",
    "server_cpu_ms_per_triple",
    "postgres_cpu_ms_per_triple",
    "client_cpu_ms_per_triple",
    "share_of_floor",
    "cpu_over_floor",
)
PATHS = ("internal", "task", "v1")
DAG = """
dag: bench
jobs:
  - name: work
    activation: source
    runtime: ecs_platform
    operator: bench
    source: { kind: manual }
    heartbeat_timeout_seconds: 60
    outputs: [ { dataset: benched } ]
"""


V1_DAG = DAG.replace("runtime: ecs_platform", "runtime: ecs_udf")


def OPERATORS_FACTORY() -> Any:
    """The registry of the benchmark DAG: one operator that nothing runs in-process."""
    from trace_core.authoring.operators import OperatorRegistry, OperatorSpec

    def bench(ctx: Any) -> None:
        raise AssertionError("benchmark tasks are run over HTTP, not in-process")

    return OperatorRegistry([OperatorSpec("bench", bench, source=True)])


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = benchmark_parser("python -m benchmarks.api", __doc__)
    p.add_argument("--workers", type=int, default=4, help="worker OS processes")
    p.add_argument("--tasks", type=int, default=2000, help="tasks per run")
    p.add_argument("--runs", type=int, default=3, help="runs; the summary has medians")
    p.add_argument(
        "--path",
        default="internal",
        help=f"the worker routes driven, comma-separated, of {', '.join((*PATHS, FLOOR))} "
        "(module docstring); all: the three Trace paths in turn per run",
    )
    p.add_argument(
        "--client",
        choices=("httpx", "raw"),
        default="httpx",
        help="the workers' HTTP client (module docstring)",
    )
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    require_positive(p, args, "workers", "tasks", "runs")
    args.paths = _paths(p, args.path, args.engine)
    return args


def _paths(p: argparse.ArgumentParser, given: str, engine: str) -> tuple[str, ...]:
    """The paths of ``--path``, the floor first (the others' rows are read against it)."""
    names: list[str] = []
    for name in (x.strip() for x in given.split(",") if x.strip()):
        for path in PATHS if name == "all" else (name,):
            if path not in (*PATHS, FLOOR):
                p.error(
                    f"--path: unknown path {path!r} (choose from {', '.join(PATHS)}, {FLOOR}, all)"
                )
            if path not in names:
                names.append(path)
    if not names:
        p.error("--path: no path given")
    if FLOOR in names and engine != "postgres":
        p.error("--path floor: the floor runs on Postgres only")
    return tuple(sorted(names, key=lambda path: path != FLOOR))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def _deploy(url: str, path: str) -> None:
    from trace_core.dag import parse_dag
    from trace_core.dispatcher.service import Dispatcher
    from trace_core.storage.sql import SqlRepository
    from trace_lite.serve import load_operators

    # As ``serve`` loads them: in an older tree (benchmarks.compare's
    # baseline) the registry is that tree's own class, from its own api.py.
    operators = load_operators(OPERATORS_REF)
    repo = SqlRepository(url)
    try:
        await Dispatcher(repo, operators=operators).deploy(
            parse_dag(V1_DAG if path == "v1" else DAG, operators=operators.names())
        )
    finally:
        await repo.close()


def _start_server(
    url: str, data_dir: Path, log_file: Path, extra: Sequence[str] = ()
) -> tuple[subprocess.Popen[bytes], str]:
    """``trace-lite serve`` (with ``extra`` arguments) on a free port, once it
    answers; its base URL."""
    port = _free_port()
    command = [sys.executable, "-m", "trace_lite.cli", "serve", "--db", url]
    command += ["--port", str(port), "--data-dir", str(data_dir), "--log-level", "warning"]
    command += ["--operators", OPERATORS_REF, *extra]
    # /healthz answers at once; an older tree (benchmarks.compare's baseline)
    # has none, and its /openapi.json answers when the document is built.
    probes = ("/healthz", "/openapi.json")
    return _launch(command, port, probes, log_file, {"TRACE_INTERNAL_TOKEN": TOKEN})


def _start_floor(url: str, log_file: Path, connections: int) -> tuple[subprocess.Popen[bytes], str]:
    """The floor app (:mod:`benchmarks._api_floor`) on a free port, once it answers."""
    port = _free_port()
    command = [sys.executable, "-m", "benchmarks._api_floor", "--db", url, "--port", str(port)]
    command += ["--connections", str(connections)]
    return _launch(command, port, ("/healthz",), log_file, {})


def _launch(
    command: list[str], port: int, probes: Sequence[str], log_file: Path, env: dict[str, str]
) -> tuple[subprocess.Popen[bytes], str]:
    """Start a server process of this tree; wait until a ``GET`` of one of
    ``probes`` answers 200 (the next is asked while one answers 404)."""
    import httpx

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, **env, "PYTHONPATH": str(root)}
    with log_file.open("wb") as out:
        server = subprocess.Popen(command, env=env, cwd=root, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"{command[2]} exited:\n" + log_file.read_text())
        try:
            for probe in probes:
                status = httpx.get(f"{base}{probe}", headers=AUTH, timeout=5).status_code
                if status == 200:
                    return server, base
                if status != 404:
                    break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.kill()
            raise RuntimeError(f"{command[2]} did not start within 60 s")
        time.sleep(0.05)


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one live process (``/proc/<pid>/stat``)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _create_tasks(base: str, count: int) -> list[str]:
    import httpx

    ids: list[str] = [""] * count
    limit = anyio.Semaphore(16)

    async def one(client: httpx.AsyncClient, index: int) -> None:
        async with limit:
            answer = await client.post(
                "/internal/trigger", json={"job": "bench/work", "key": f"k{index}"}
            )
            answer.raise_for_status()
            ids[index] = str(answer.json()["task_id"])

    async with (
        httpx.AsyncClient(base_url=base, headers=AUTH, timeout=60) as client,
        anyio.create_task_group() as group,
    ):
        for index in range(count):
            group.start_soon(one, client, index)
    return ids


async def _create_floor_tasks(url: str, count: int) -> list[str]:
    """``count`` tasks of a standalone job, through the library (the floor has no trigger)."""
    from trace_core.standalone import ensure_standalone_job
    from trace_core.storage.protocol import NewTask
    from trace_core.storage.sql import SqlRepository
    from trace_core.tasks import TaskQueue

    repo = SqlRepository(url)
    try:
        job_id = await ensure_standalone_job(repo, "bench-floor", now=utcnow())
        made = await TaskQueue(repo).create([NewTask(job_id) for _ in range(count)])
        return [str(m.task_id) for m in made]
    finally:
        await repo.close()


def _run(
    args: argparse.Namespace, dbs: Databases, run: int, path: str, scratch: Path
) -> dict[str, Any]:
    log.info("run %d, path %s: a fresh database", run, path)
    url = dbs.fresh(f"api{run}{path}")
    name = f"{path}{run}"
    ids: list[str] = []
    if path == FLOOR:
        ids = anyio.run(_create_floor_tasks, url, args.tasks)
        server, base = _start_floor(url, scratch / f"{name}.log", args.workers)
    else:
        anyio.run(_deploy, url, path)
        server, base = _start_server(url, scratch / f"data{name}", scratch / f"serve{name}.log")
    try:
        log.info("run %d, path %s: server up", run, path)
        ids = ids or anyio.run(_create_tasks, base, args.tasks)
        log.info("run %d, path %s: %d tasks made; the workers start", run, path, len(ids))
        context = mp.get_context("spawn")
        start = context.Event()
        results = context.Queue()
        ready = context.Queue()
        signals = (ready, start, results)
        shares = [ids[i :: args.workers] for i in range(args.workers)]
        workers = [
            context.Process(
                target=worker_process,
                args=(base, path, args.client, share, i, CAPABILITY_HEADER, signals),
            )
            for i, share in enumerate(shares)
        ]
        for worker in workers:
            worker.start()
        # The clock starts once every worker has started its interpreter and
        # imported its client: on a busy machine that takes seconds.
        for _ in workers:
            ready.get(timeout=120)
        load = load_average()
        cpu_before = _process_cpu_s(server.pid)
        pg_before = server_cpu_s(dbs.postmaster) if dbs.postmaster else 0.0
        began = time.perf_counter()
        start.set()
        timings: list[float] = []
        errors: list[str] = []
        client_cpu = 0.0
        for _ in workers:
            _, got, cpu, error = results.get(timeout=600)
            timings += got
            client_cpu += cpu
            if error:
                errors.append(error)
        seconds = time.perf_counter() - began
        server_cpu = _process_cpu_s(server.pid) - cpu_before
        pg_cpu = server_cpu_s(dbs.postmaster) - pg_before if dbs.postmaster else None
        for worker in workers:
            worker.join(timeout=60)
    finally:
        server.terminate()
        server.wait(timeout=60)
    if errors:
        raise RuntimeError(f"workers failed: {errors}")
    statuses = count_tasks(url)
    ms = sorted(t * 1000 for t in timings)
    row = {
        "bench": "api",
        "engine": args.engine,
        "path": path,
        "client": args.client,
        "run": run,
        "workers": args.workers,
        "tasks": args.tasks,
        "seconds": round(seconds, 3),
        "round_trips_per_s": round(len(timings) / seconds, 1),
        "p50_ms": round(percentile(ms, 50), 2),
        "p99_ms": round(percentile(ms, 99), 2),
        "server_cpu_ms_per_triple": round(server_cpu * 1000 / max(len(timings), 1), 2),
        "postgres_cpu_ms_per_triple": (
            None if pg_cpu is None else round(pg_cpu * 1000 / max(len(timings), 1), 2)
        ),
        "client_cpu_ms_per_triple": round(client_cpu * 1000 / max(len(timings), 1), 2),
        "load_average": load,
        "verified": statuses == {"Completed": args.tasks},
    }
    return row


def _against_floor(row: dict[str, Any], floor: dict[str, Any]) -> dict[str, Any]:
    """A Trace path's row read against the floor's row of the same run."""
    cpu = floor["server_cpu_ms_per_triple"]
    return {
        **row,
        "share_of_floor": round(row["round_trips_per_s"] / floor["round_trips_per_s"], 3),
        "cpu_over_floor": round(row["server_cpu_ms_per_triple"] / cpu, 3) if cpu else None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (module docstring); the exit code."""
    args = _parse(argv)
    configure_logging(args.verbose, "httpx")
    with Databases(args.engine, args.db) as dbs, tempfile.TemporaryDirectory() as scratch:
        paths = args.paths
        rows: list[dict[str, Any]] = []
        for run in range(args.runs):
            floor: dict[str, Any] | None = None
            for path in paths:
                row = _run(args, dbs, run, path, Path(scratch))
                if path == FLOOR:
                    floor = row
                elif floor is not None:
                    row = _against_floor(row, floor)
                emit(row)
                rows.append(row)
    for path in paths if args.runs > 1 else ():
        mine = [r for r in rows if r["path"] == path]
        emit(
            {
                "bench": "api",
                "engine": args.engine,
                "path": path,
                "client": args.client,
                "summary": True,
                "runs": args.runs,
                "workers": args.workers,
                "tasks": args.tasks,
                "all_verified": all(r["verified"] for r in mine),
                "round_trips_per_s_all": [r["round_trips_per_s"] for r in mine],
                "load_average_all": [r["load_average"] for r in mine],
                **summarize(mine, _KEYS),
            }
        )
    log.info("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
