"""End to end over HTTP: ``trace-lite serve`` + two ``trace-lite worker`` processes.

A worker is SIGKILLed while it holds a task; the lease (``heartbeat_timeout_seconds:
2``) expires, the reaper retries the task and the surviving worker completes
it. The killed attempt's fence is refused afterwards. Every wait is bounded
and waits on a condition (a marker file, a row, a log line), never a fixed sleep.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

import anyio
import httpx
import pytest
import sqlalchemy as sa

from tests.e2e_operators import OPERATORS, RELEASE
from trace_core.dag import parse_dag
from trace_core.dispatcher.service import Dispatcher
from trace_core.storage import schema
from trace_core.storage.sql import SqlRepository

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "e2e-http-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
STREAM = "trace-ecs-platform"
OPERATORS_REF = "tests.e2e_operators:OPERATORS"
DEADLINE_SECONDS = 90.0
T = TypeVar("T")

DAG = """
dag: e2e
jobs:
  - name: work
    activation: source
    runtime: ecs_platform
    operator: gate
    source: {{ kind: manual }}
    heartbeat_timeout_seconds: 2
    max_attempts: 3
    config: {{ marker_dir: "{marker_dir}", max_wait_seconds: 60 }}
    outputs: [ {{ dataset: gated }} ]
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _until(what: str, check: Callable[[], T | None], timeout: float = DEADLINE_SECONDS) -> T:
    """Poll ``check`` until it returns something other than ``None``; fail at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


async def _deploy(url: str, marker_dir: Path) -> None:
    repo = SqlRepository(url)
    try:
        dispatcher = Dispatcher(repo, operators=OPERATORS)
        dag = parse_dag(DAG.format(marker_dir=marker_dir), operators=OPERATORS.names())
        await dispatcher.deploy(dag)
    finally:
        await repo.close()


async def _tasks(url: str) -> dict[uuid.UUID, dict[str, Any]]:
    """Every task: status, attempt, lease token."""
    repo = SqlRepository(url)
    t = schema.tasks
    try:
        async with repo.read() as tx:
            rows = await tx.connection.execute(
                sa.select(t.c.id, t.c.status, t.c.attempt, t.c.lease_token)
            )
            return {row.id: dict(row._mapping) for row in rows}
    finally:
        await repo.close()


def _spawn(args: list[str], log: Path) -> tuple[subprocess.Popen[bytes], IO[bytes]]:
    env = {**os.environ, "TRACE_INTERNAL_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)}
    out = log.open("wb")
    command = [sys.executable, "-m", "trace_lite.cli", *args]
    process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    return process, out


def worker_args(api: str, name: str, operators: str) -> list[str]:
    """``trace-lite worker`` polling the platform stream of ``api`` as ``name``."""
    return [
        *("worker", "--api", api, "--streams", STREAM, "--worker-id", name),
        *("--operators", operators, "--max-wait-ms", "1000"),
    ]


@pytest.fixture
def processes() -> Iterator[list[tuple[subprocess.Popen[bytes], IO[bytes]]]]:
    """Started subprocesses, terminated (then killed) at the end of the test."""
    started: list[tuple[subprocess.Popen[bytes], IO[bytes]]] = []
    yield started
    for process, _ in reversed(started):
        if process.poll() is None:
            process.terminate()
    for process, out in reversed(started):
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
        out.close()


def test_a_killed_workers_task_is_finished_by_the_other(
    database_url: str,
    tmp_path: Path,
    processes: list[tuple[subprocess.Popen[bytes], IO[bytes]]],
) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    anyio.run(_deploy, database_url, markers)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    server_log = tmp_path / "serve.log"
    server = _spawn(
        [
            "serve",
            "--db",
            database_url,
            "--port",
            str(port),
            "--data-dir",
            str(tmp_path / "data"),
            "--operators",
            OPERATORS_REF,
            "--log-level",
            "warning",
        ],
        server_log,
    )
    processes.append(server)

    def listening() -> bool | None:
        assert server[0].poll() is None, "serve exited:\n" + server_log.read_text()
        try:
            return httpx.get(f"{base}/openapi.json", timeout=5).status_code == 200 or None
        except httpx.TransportError:
            return None

    _until("the server to listen", listening)
    workers = {}
    for name in ("w-a", "w-b"):
        log = tmp_path / f"{name}.log"
        worker = _spawn(worker_args(base, name, OPERATORS_REF), log)
        processes.append(worker)
        workers[worker[0].pid] = (worker[0], log)

    with httpx.Client(base_url=base, headers=AUTH, timeout=10) as api:

        def trigger(key: str) -> uuid.UUID:
            created = api.post("/internal/trigger", json={"job": "e2e/work", "key": key})
            assert created.status_code == 200, created.text
            return uuid.UUID(created.json()["task_id"])

        first = trigger("k1")
        started = markers / f"started-{first}-1"
        _until("the first attempt to start", lambda: started.exists() or None)
        victim_pid = int(started.read_text())
        assert victim_pid in workers
        [survivor_pid] = [pid for pid in workers if pid != victim_pid]
        held = anyio.run(_tasks, database_url)[first]
        assert held["status"] == "Running" and held["attempt"] == 1
        old_token = held["lease_token"]

        victim = workers[victim_pid][0]
        victim.send_signal(signal.SIGKILL)
        assert victim.wait(timeout=30) == -signal.SIGKILL
        others = [trigger("k2"), trigger("k3")]
        (markers / RELEASE).touch()

        def all_completed() -> dict[uuid.UUID, dict[str, Any]] | None:
            tasks = anyio.run(_tasks, database_url)
            done = all(row["status"] == "Completed" for row in tasks.values())
            return tasks if len(tasks) == 3 and done else None

        tasks = _until("every task to complete", all_completed)
        assert set(tasks) == {first, *others}
        assert tasks[first]["attempt"] == 2
        # The retry ran on the survivor; the killed attempt never finished.
        assert int((markers / f"started-{first}-2").read_text()) == survivor_pid
        assert int((markers / f"done-{first}-2").read_text()) == survivor_pid
        assert not (markers / f"done-{first}-1").exists()

        # The killed attempt's late writes are refused, and change nothing.
        fence = {"task_id": str(first), "attempt": 1, "lease_token": str(old_token)}
        beat = api.post("/internal/heartbeat", json=fence)
        assert beat.status_code == 409 and beat.json()["error"] == "stale", beat.text
        late = api.post(
            "/internal/task-complete",
            json={**fence, "status": "Completed", "events": [], "error_message": None},
        )
        assert late.status_code == 409 and late.json()["error"] == "stale", late.text
        assert anyio.run(_tasks, database_url)[first]["attempt"] == 2

    # SIGTERM stops the idle survivor cleanly.
    survivor, survivor_log = workers[survivor_pid]
    survivor.terminate()
    assert survivor.wait(timeout=30) == 0, survivor_log.read_text()
    output = survivor_log.read_text()
    assert "completed" in output and "stopped after" in output
    assert TOKEN not in output + server_log.read_text()
