"""A Dispatcher process that dies at an exact point, run by ``tests/test_dispatcher_crash.py``.

    python tests/crash_dispatcher.py '<JSON config>'

It opens its own repository on ``config["url"]``, does one thing, and at the
crash point kills itself with ``SIGKILL``: no ``finally``, no rollback, no
connection close, no flush — what a power cut or the OOM killer leaves. The
parent sees exit status ``-SIGKILL`` only if the point was reached (any error
before it exits 1 with a traceback on stderr).

Modes (``config["mode"]``):

- ``accept_then_die``: accept the events (commit), die before any routing;
- ``route_then_die``: a relay claims one ``route_event`` row, the router
  commits its tasks, die before the row is marked done;
- ``create_then_die``: create tasks with ``TaskQueue.create`` (commit), die
  before any wake-up is delivered;
- ``wake_then_die``: a relay routes the ``route_event`` rows (tasks and
  wake-up rows commit), then claims the ``enqueue_task`` rows and dies inside
  the wake-up handler, before delivering;
- ``drain``: a fresh process routes and wakes everything, appends every task
  id it wakes to ``config["woken_path"]`` and exits 0.

Time is a ``ManualClock`` fixed at ``config["now"]``, so the parent decides
when this process's leases expire by advancing its own clock.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any, NoReturn

import anyio

from trace_core.authoring.events import DatasetEvent
from trace_core.clock import ManualClock
from trace_core.dispatcher.events import ROUTE_EVENT, EventGateway, Producer
from trace_core.dispatcher.routing import EventRouter
from trace_core.outbox import OutboxHandler, OutboxRelay, RelayConfig
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import ENQUEUE_TASK, TaskQueue

__all__ = ["die", "main"]


def die(point: str) -> NoReturn:
    """Kill this process with SIGKILL at ``point`` (never returns)."""
    sys.stderr.write(f"crash point reached: {point}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
    # SIGKILL to oneself is delivered before kill() returns to user code.
    raise AssertionError("unreachable: SIGKILL did not stop the process")


def _events(config: Mapping[str, Any]) -> list[DatasetEvent]:
    ds, version = uuid.UUID(config["dataset_uuid"]), uuid.UUID(config["dataset_version"])
    return [
        DatasetEvent(ds, version, partition_key=f"{start}-{end}", start=start, end=end)
        for start, end in config["partitions"]
    ]


async def _run(config: Mapping[str, Any]) -> list[str]:
    """Do ``config["mode"]``; only ``drain`` returns (the task ids it woke)."""
    mode = config["mode"]
    clock = ManualClock(datetime.fromisoformat(config["now"]))
    repo = SqlRepository(config["url"])
    tasks = TaskQueue(repo, clock=clock)
    router = EventRouter(repo, clock=clock, tasks=tasks)
    worker = f"crash-{mode}-{os.getpid()}"

    if mode == "accept_then_die":
        producer = Producer(uuid.UUID(config["producer_task_id"]), int(config["producer_attempt"]))
        await EventGateway(repo, clock=clock).accept(_events(config), producer=producer)
        die("events accepted and committed, nothing routed")

    elif mode == "route_then_die":

        async def route_then_die(payload: Mapping[str, Any]) -> None:
            await router.handle(payload)
            die("tasks committed by the router, outbox row not marked done")

        # One row per batch: exactly one route_event row is in flight at the kill.
        relay = OutboxRelay(
            repo,
            {ROUTE_EVENT: route_then_die},
            clock=clock,
            config=RelayConfig(batch_size=1),
            worker_id=worker,
        )
        await relay.run_once()
        raise AssertionError("the relay's batch ended without reaching the crash point")

    elif mode == "create_then_die":
        job = uuid.UUID(config["job_id"])
        await tasks.create(
            [NewTask(job, dedupe_key=f"crash:{i}") for i in range(int(config["tasks"]))]
        )
        die("tasks and their wake-up rows committed, no wake-up delivered")

    elif mode == "wake_then_die":

        async def wake_then_die(payload: Mapping[str, Any]) -> None:
            die("enqueue_task row claimed, wake-up not delivered")

        relay = OutboxRelay(
            repo,
            {ROUTE_EVENT: router.handle, ENQUEUE_TASK: wake_then_die},
            clock=clock,
            worker_id=worker,
        )
        while await relay.run_once():
            pass
        raise AssertionError("the outbox drained without reaching the crash point")

    elif mode == "drain":
        woken: list[str] = []

        async def record(payload: Mapping[str, Any]) -> None:
            woken.extend(str(t) for t in payload["task_ids"])

        handlers: dict[str, OutboxHandler] = {ROUTE_EVENT: router.handle, ENQUEUE_TASK: record}
        relay = OutboxRelay(repo, handlers, clock=clock, worker_id=worker)
        while await relay.run_once():
            pass
        await repo.close()
        return woken

    raise ValueError(f"unknown mode {mode!r}")


def main(argv: list[str]) -> int:
    """Entry point: ``argv[1]`` is the JSON config."""
    config = json.loads(argv[1])
    woken = anyio.run(_run, config, backend="asyncio")
    with open(config["woken_path"], "a", encoding="utf-8") as fh:
        fh.write("".join(f"{t}\n" for t in woken))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
