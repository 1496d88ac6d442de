"""Processes on the Redis transport: ``trace-lite serve --redis-url`` and two
unchanged ``trace-lite worker`` processes. One worker is SIGKILLed while its
stream message is pending; the other finishes every task (the killed one's
retry too), takes the dead consumer's message over, and at the end every task
completed exactly once in the database and no message is pending. And a
control plane SIGKILLed after a completion committed and before its ack: a new
one recognises the redelivered message and acknowledges it without running the
job again. Waits are bounded and on conditions (marker files, rows, Redis
counters, process exits); the control plane is killed by its own fault point
(``--fault-point between-commit-and-ack``), exactly between the two."""

from __future__ import annotations

import signal
import subprocess
import uuid
from pathlib import Path
from typing import IO, Any

import anyio
import httpx

from tests.e2e_operators import RELEASE
from tests.test_e2e_http import (
    AUTH,
    OPERATORS_REF,
    STREAM,
    _deploy,
    _free_port,
    _spawn,
    _tasks,
    _until,
    processes,
    worker_args,
)
from trace_lite.redis_streams import RedisStreams

__all__ = ["processes"]  # the fixture, imported for the test below


async def _redis_state(url: str) -> tuple[int, int, list[str]]:
    """(messages added, pending, consumers) of the platform stream under ``trace:``."""
    streams = RedisStreams.from_url(url)
    try:
        length = await streams.client.xlen(streams.key(STREAM))
        pending = await streams.pending_count(STREAM)
        consumers = await streams.client.xinfo_consumers(streams.key(STREAM), streams.group)
        return length, pending, sorted(c["name"].decode() for c in consumers)
    finally:
        await streams.close()


async def _pending_jobs(url: str, consumer: str) -> list[uuid.UUID | None]:
    """The jobs of ``consumer``'s pending messages on the platform stream."""
    streams = RedisStreams.from_url(url)
    try:
        return [m.job_id for m in await streams.pending(consumer, [STREAM])]
    finally:
        await streams.close()


async def _reset(url: str) -> None:
    """Drop the stream left by another run of this test on the session's server."""
    streams = RedisStreams.from_url(url)
    try:
        await streams.client.delete(streams.key(STREAM))
    finally:
        await streams.close()


def _serve(
    database_url: str,
    redis_url: str,
    tmp_path: Path,
    name: str,
    processes: list[tuple[subprocess.Popen[bytes], IO[bytes]]],
    *extra: str,
) -> str:
    """``trace-lite serve --redis-url`` (and ``extra`` options) on a free port,
    once it answers; its base URL."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    server_log = tmp_path / f"{name}.log"
    serve_args = [
        *("serve", "--db", database_url, "--port", str(port)),
        *("--data-dir", str(tmp_path / "data"), "--operators", OPERATORS_REF),
        *("--log-level", "warning", "--redis-url", redis_url, "--stream-idle-seconds", "1"),
        *extra,
    ]
    server = _spawn(serve_args, server_log)
    processes.append(server)

    def listening() -> bool | None:
        assert server[0].poll() is None, "serve exited:\n" + server_log.read_text()
        try:
            return httpx.get(f"{base}/openapi.json", timeout=5).status_code == 200 or None
        except httpx.TransportError:
            return None

    _until("the server to listen", listening)
    return base


def test_serve_on_redis_survives_a_sigkilled_consumer(
    database_url: str,
    redis_url: str,
    tmp_path: Path,
    processes: list[tuple[subprocess.Popen[bytes], IO[bytes]]],
) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    anyio.run(_deploy, database_url, markers)
    anyio.run(_reset, redis_url)
    base = _serve(database_url, redis_url, tmp_path, "serve", processes)
    workers = {}
    for name in ("w-a", "w-b"):
        worker = _spawn(worker_args(base, name, OPERATORS_REF), tmp_path / f"{name}.log")
        processes.append(worker)
        workers[worker[0].pid] = (name, worker[0])

    with httpx.Client(base_url=base, headers=AUTH, timeout=10) as api:

        def trigger(key: str) -> uuid.UUID:
            created = api.post("/internal/trigger", json={"job": "e2e/work", "key": key})
            assert created.status_code == 200, created.text
            return uuid.UUID(created.json()["task_id"])

        first = trigger("k1")
        started = markers / f"started-{first}-1"
        _until("the first attempt to start", lambda: started.exists() or None)
        victim_pid = int(started.read_text())
        victim_name, victim = workers[victim_pid]
        # The victim holds the stream message of its attempt: pending at its consumer.
        _, pending, consumers = anyio.run(_redis_state, redis_url)
        assert pending >= 1 and victim_name in consumers
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
        assert all(tasks[t]["attempt"] == 1 for t in others)
        # Exactly once: only the retry finished the first task, on the survivor.
        assert not (markers / f"done-{first}-1").exists()
        assert (markers / f"done-{first}-2").exists()

        def nothing_pending() -> tuple[int, int, list[str]] | None:
            state = anyio.run(_redis_state, redis_url)
            return state if state[1] == 0 else None

        added, _, _ = _until("every stream message to be acknowledged", nothing_pending)
        # The three creations went through the stream; the retry either went as
        # a message of its own, or ran on the dead consumer's message that the
        # survivor took over, and its own wake-up then found the task done and
        # was skipped by the launcher (which path depends on timing).
        assert added in (3, 4)


def test_a_control_plane_killed_before_its_ack_runs_nothing_twice(
    database_url: str,
    redis_url: str,
    tmp_path: Path,
    processes: list[tuple[subprocess.Popen[bytes], IO[bytes]]],
) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    (markers / RELEASE).touch()  # the operator finishes at once
    anyio.run(_deploy, database_url, markers)
    anyio.run(_reset, redis_url)
    first_base = _serve(
        database_url,
        redis_url,
        tmp_path,
        "serve-1",
        processes,
        *("--fault-point", "between-commit-and-ack"),
    )
    one_task = ["--max-tasks", "1"]

    def trigger(base: str, key: str) -> uuid.UUID:
        with httpx.Client(base_url=base, headers=AUTH, timeout=10) as api:
            created = api.post("/internal/trigger", json={"job": "e2e/work", "key": key})
            assert created.status_code == 200, created.text
            return uuid.UUID(created.json()["task_id"])

    first = trigger(first_base, "k1")
    worker = _spawn(
        [*worker_args(first_base, "w-1", OPERATORS_REF), *one_task], tmp_path / "w1.log"
    )
    processes.append(worker)
    # The worker's report commits and the armed control plane SIGKILLs itself
    # at the fault point, before the ack.
    server = processes[0][0]
    assert server.wait(timeout=90) == -signal.SIGKILL, (tmp_path / "serve-1.log").read_text()
    assert anyio.run(_tasks, database_url)[first]["status"] == "Completed"
    assert anyio.run(_redis_state, redis_url)[1] == 1  # committed, never acknowledged
    # The worker retries its report against the dead server: it is done for.
    worker[0].send_signal(signal.SIGKILL)
    assert worker[0].wait(timeout=30) == -signal.SIGKILL

    second_base = _serve(database_url, redis_url, tmp_path, "serve-2", processes)
    second = trigger(second_base, "k2")
    again = _spawn(
        [*worker_args(second_base, "w-1", OPERATORS_REF), *one_task], tmp_path / "w2.log"
    )
    processes.append(again)
    assert again[0].wait(timeout=90) == 0, (tmp_path / "w2.log").read_text()

    tasks = anyio.run(_tasks, database_url)
    assert {t: (row["status"], row["attempt"]) for t, row in tasks.items()} == {
        first: ("Completed", 1),
        second: ("Completed", 1),
    }
    # The redelivered message was recognised and acknowledged, not run again;
    # the second task's message was acknowledged right after its completion.
    assert sorted(p.name for p in markers.glob("started-*")) == sorted(
        [f"started-{first}-1", f"started-{second}-1"]
    )
    assert anyio.run(_pending_jobs, redis_url, "w-1") == []
    with httpx.Client(base_url=second_base, headers=AUTH, timeout=10) as api:
        body = {"worker_id": "w-1", "streams": [STREAM], "max_wait_ms": 0}
        assert api.post("/internal/worker/claim", json=body).json()["claimed"] is False
    added, pending, _ = anyio.run(_redis_state, redis_url)
    assert (added, pending) == (2, 0)
