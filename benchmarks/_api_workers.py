"""The worker processes of ``benchmarks.api``: claim -> heartbeat -> complete over HTTP.

A module of its own, light to import (no SQLAlchemy, no FastAPI): each worker
is a spawned interpreter, and what it imports is paid before every run. It
is part of the benchmark client that ``benchmarks.compare`` copies into its
baseline tree.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["AUTH", "FLOOR", "STREAM", "TOKEN", "worker_process"]

TOKEN = "benchmark-api-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
STREAM = "trace-ecs-udf"
FLOOR = "floor"

Triple = Callable[[Any, str, str], Awaitable[None]]


async def _internal_triple(client: Any, task_id: str, worker_id: str) -> None:
    claim = await client.post(
        "/internal/task-claim", json={"task_id": task_id, "worker_id": worker_id}
    )
    body = claim.json()
    if body.get("status") != "Claimed":
        raise RuntimeError(f"task {task_id} not claimed: {body}")
    fence = {"task_id": task_id, "attempt": body["attempt"], "lease_token": body["lease_token"]}
    beat = await client.post("/internal/heartbeat", json=fence)
    beat.raise_for_status()
    done = await client.post(
        "/internal/task-complete",
        json={**fence, "status": "Completed", "events": [], "error_message": None},
    )
    done.raise_for_status()


async def _task_triple(client: Any, task_id: str, worker_id: str, *, header: str) -> None:
    claim = await client.post(
        "/internal/task-claim", json={"task_id": task_id, "worker_id": worker_id}
    )
    body = claim.json()
    if body.get("status") != "Claimed":
        raise RuntimeError(f"task {task_id} not claimed: {body}")
    # The task-scoped routes are authorized by the capability token alone (the
    # client's internal token is ignored there).
    headers = {header: body["task"]["capability_token"]}
    fence = {"task_id": task_id, "attempt": body["attempt"], "lease_token": body["lease_token"]}
    beat = await client.post("/v1/task/heartbeat", json=fence, headers=headers)
    beat.raise_for_status()
    done = await client.post(
        "/v1/task/complete", json={**fence, "status": "Completed"}, headers=headers
    )
    done.raise_for_status()


async def _v1_triple(client: Any, _task_id: str, worker_id: str) -> None:
    claim = await client.post(
        "/internal/worker/claim",
        json={"worker_id": worker_id, "streams": [STREAM], "max_wait_ms": 5000},
    )
    body = claim.json()
    if body.get("claimed") is not True:
        raise RuntimeError(f"nothing claimed from {STREAM}: {body}")
    held = {
        "worker_id": worker_id,
        "job_id": body["job_id"],
        "attempt_id": body["attempt_id"],
        "lease_token": body["lease_token"],
    }
    beat = await client.post("/internal/worker/heartbeat", json=held)
    beat.raise_for_status()
    report = {**held, "stream": body["stream"], "message_id": body["message_id"], "result": {}}
    done = await client.post("/internal/worker/complete", json=report)
    done.raise_for_status()


async def _floor_triple(client: Any, _task_id: str, worker_id: str) -> None:
    claim = await client.post("/claim", json={"worker_id": worker_id})
    body = claim.json()
    if body.get("claimed") is not True:
        raise RuntimeError(f"the floor claimed nothing: {body}")
    fence = {"task_id": body["task_id"], "attempt": body["attempt"]}
    fence["lease_token"] = body["lease_token"]
    beat = await client.post("/heartbeat", json=fence)
    beat.raise_for_status()
    done = await client.post("/complete", json=fence)
    done.raise_for_status()


def _triples(capability_header: str) -> dict[str, Triple]:
    return {
        "internal": _internal_triple,
        "task": functools.partial(_task_triple, header=capability_header),
        "v1": _v1_triple,
        FLOOR: _floor_triple,
    }


async def _work(
    base: str, triple: Triple, client_kind: str, task_ids: list[str], worker_id: str
) -> list[float]:
    """``triple`` once per id (``v1`` and the floor claim whichever task
    comes); the seconds of each."""
    import httpx

    from benchmarks._raw_http import RawClient

    timings: list[float] = []
    connection: Any = (
        RawClient(base, headers=AUTH)
        if client_kind == "raw"
        else httpx.AsyncClient(base_url=base, headers=AUTH, timeout=60)
    )
    async with connection as client:
        for task_id in task_ids:
            began = time.perf_counter()
            await triple(client, task_id, worker_id)
            timings.append(time.perf_counter() - began)
    return timings


def worker_process(
    base: str,
    path: str,
    client: str,
    task_ids: list[str],
    index: int,
    capability_header: str,
    signals: tuple[Any, Any, Any],
) -> None:
    """A worker OS process: say it is ready, wait for the start signal, run
    its share on ``path``, report timings and the CPU seconds the share took.
    ``signals``: the ready queue, the start event, the results queue.
    ``capability_header``: the task-scoped routes' header (from the parent,
    whose import of it loads FastAPI)."""
    # The client's modules load before the start signal: their import is not a triple's cost.
    import httpx  # noqa: F401

    import benchmarks._raw_http  # noqa: F401

    ready, start, results = signals
    triple = _triples(capability_header)[path]
    ready.put(index)
    start.wait()
    cpu = time.process_time()
    try:
        timings = asyncio.run(_work(base, triple, client, task_ids, f"bench-{index}"))
        results.put((index, timings, time.process_time() - cpu, None))
    except Exception as exc:  # reported to the parent, which fails the run
        results.put((index, [], 0.0, repr(exc)))
