"""A ``trace-aws worker`` SIGKILLed mid-task: its wake-up comes back after the
visibility timeout and the lease protocol decides who runs the task.

``serve`` and two ``worker`` processes on moto's server and the throwaway
Postgres. The task's ``gate`` operator blocks until a release file appears
(bounded), so the kill lands while the attempt runs. The killed worker never
deletes its message: once its visibility timeout (2 s here) passes, SQS hands
it to the survivor. Whether the survivor's claim meets the dead attempt's
lease (``AlreadyRunning``: the wake-up is deleted and the reaper's reclaim
wakes the task again) or finds it already reclaimed, attempt 2 runs on the
survivor to completion; attempt 1's late writes are refused as stale.
"""

from __future__ import annotations

import signal
import uuid
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tests.e2e_operators import RELEASE
from tests.test_aws_cli import (
    REGION,
    TOKEN,
    Process,
    _aws_resources,
    _queue_counts,
    _serve_env,
    _spawn_aws,
    moto_endpoint,  # noqa: F401 (a fixture)
)
from tests.test_e2e_http import (
    _deploy,
    _free_port,
    _tasks,
    _until,
    processes,  # noqa: F401 (a fixture)
)

VISIBILITY_SECONDS = 2
"""The workers' message visibility: short, so the dead worker's message reappears soon
(the gate job's lease, its heartbeat timeout, is 2 s as well)."""
OPERATORS = ("--operators", "tests.e2e_operators:OPERATORS")


@pytest.mark.parametrize("engine", ["postgres"])
def test_a_sigkilled_workers_task_is_redelivered_and_finished_by_the_survivor(
    database_url: str,
    tmp_path: Path,
    moto_endpoint: str,  # noqa: F811 (the fixture imported above)
    processes: list[Process],  # noqa: F811 (the fixture imported above)
) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    anyio.run(_deploy, database_url, markers)  # job e2e/work: gate, lease 2 s, 3 attempts
    key, queue = _aws_resources(moto_endpoint)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {
        **_serve_env(moto_endpoint, database_url, key, port),
        "TRACE_AWS_WORKER_QUEUE": queue,
        "TRACE_API_URL": base,
    }
    serve_log = tmp_path / "serve.log"
    server = _spawn_aws(["--log-level", "warning", "serve", *OPERATORS], env, serve_log)
    processes.append(server)
    auth = {"Authorization": f"Bearer {TOKEN}"}

    def ready() -> bool | None:
        assert server[0].poll() is None, "serve exited:\n" + serve_log.read_text()
        try:
            return httpx.get(f"{base}/readyz", headers=auth, timeout=5).status_code == 200 or None
        except httpx.TransportError:
            return None

    _until("the server to be ready", ready, timeout=60)
    workers: dict[int, tuple[Any, Path]] = {}
    for name in ("w-a", "w-b"):
        log = tmp_path / f"{name}.log"
        worker = _spawn_aws(
            [
                *("worker", "--wait-seconds", "1", "--worker-id", name),
                *("--visibility-seconds", str(VISIBILITY_SECONDS), *OPERATORS),
            ],
            env,
            log,
        )
        processes.append(worker)
        workers[worker[0].pid] = (worker[0], log)

    with httpx.Client(base_url=base, headers=auth, timeout=10) as api:
        created = api.post("/internal/trigger", json={"job": "e2e/work", "key": "k1"})
        assert created.status_code == 200, created.text
        task_id = uuid.UUID(created.json()["task_id"])
        started = markers / f"started-{task_id}-1"
        _until("the first attempt to start", lambda: started.exists() or None)
        victim_pid = int(started.read_text())
        assert victim_pid in workers
        [survivor_pid] = [pid for pid in workers if pid != victim_pid]
        held = anyio.run(_tasks, database_url)[task_id]
        assert held["status"] == "Running" and held["attempt"] == 1
        old_token = held["lease_token"]
        # The victim holds the wake-up: received, not deleted, invisible to others.
        assert _queue_counts(moto_endpoint, queue) == (0, 1)

        victim, victim_log = workers[victim_pid]
        victim.send_signal(signal.SIGKILL)
        assert victim.wait(timeout=30) == -signal.SIGKILL
        (markers / RELEASE).touch()  # from now on a gate completes at once

        def completed() -> dict[str, Any] | None:
            survivor = workers[survivor_pid][0]
            assert survivor.poll() is None, workers[survivor_pid][1].read_text()
            task = anyio.run(_tasks, database_url)[task_id]
            return task if task["status"] == "Completed" else None

        done = _until("the survivor to complete the task", completed)
        assert done["attempt"] == 2
        assert int((markers / f"started-{task_id}-2").read_text()) == survivor_pid
        assert int((markers / f"done-{task_id}-2").read_text()) == survivor_pid
        assert not (markers / f"done-{task_id}-1").exists()

        # The dead worker's message came back to the survivor, which handled and
        # deleted it: nothing is left in the queue, nothing was dead-lettered.
        _until(
            "every wake-up to be deleted",
            lambda: _queue_counts(moto_endpoint, queue) == (0, 0) or None,
        )
        sqs_dlq = _dead_letter_url(moto_endpoint)
        assert _queue_counts(moto_endpoint, sqs_dlq) == (0, 0)
        survivor_log = workers[survivor_pid][1].read_text()
        assert f"task {task_id}: completed" in survivor_log
        assert f"task {task_id}" not in victim_log.read_text()  # it never finished anything

        # The killed attempt's late writes are fenced and change nothing.
        fence = {"task_id": str(task_id), "attempt": 1, "lease_token": str(old_token)}
        beat = api.post("/internal/heartbeat", json=fence)
        assert beat.status_code == 409 and beat.json()["error"] == "stale", beat.text
        late = api.post(
            "/internal/task-complete",
            json={**fence, "status": "Completed", "events": [], "error_message": None},
        )
        assert late.status_code == 409 and late.json()["error"] == "stale", late.text
        assert anyio.run(_tasks, database_url)[task_id]["attempt"] == 2

    survivor = workers[survivor_pid][0]
    survivor.send_signal(signal.SIGTERM)
    assert survivor.wait(timeout=30) == 0, survivor_log
    assert TOKEN not in survivor_log + serve_log.read_text()


def _dead_letter_url(endpoint: str) -> str:
    import boto3

    sqs = boto3.client("sqs", region_name=REGION, endpoint_url=endpoint)
    return sqs.get_queue_url(QueueName="trace-dlq")["QueueUrl"]
