"""Shared helpers of the HTTP API tests: a deployed small DAG and an ASGI client.

The DAG has a manual source ``follow`` (its tasks are started by
``POST /internal/trigger``) feeding ``double`` per partition. ``follow`` runs
on the ``ecs_udf`` runtime (worker queue ``trace-ecs-udf``), ``double`` on
``ecs_platform`` (``trace-ecs-platform``): nothing runs them in-process, the
tests are the workers.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import sqlalchemy as sa

from trace_core.api import ApiConfig, create_app
from trace_core.authoring.operators import OperatorRegistry, OperatorSpec
from trace_core.clock import ManualClock
from trace_core.dag import DeployResult, parse_dag
from trace_core.dispatcher.service import Dispatcher
from trace_core.ports import WakeupQueue
from trace_core.storage import schema
from trace_core.storage.sql import SqlRepository

TOKEN = "test-internal-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
STREAM = "trace-ecs-udf"
"""The worker queue of ``follow``'s tasks."""
DOWNSTREAM = "trace-ecs-platform"
"""The worker queue of ``double``'s tasks."""

DAG = """
dag: api
jobs:
  - name: follow
    activation: source
    runtime: ecs_udf
    operator: follow
    source: { kind: manual }
    outputs: [ { dataset: blocks } ]
  - name: double
    activation: reactive
    runtime: ecs_platform
    operator: double
    execution_strategy: PerPartition
    inputs: [ { from: { dataset: blocks } } ]
    outputs: [ { dataset: doubled } ]
"""


def _not_in_process(ctx: Any) -> None:
    raise AssertionError("ecs_udf tasks are run by the test, not in-process")


OPERATORS = OperatorRegistry(
    [
        OperatorSpec("follow", _not_in_process, source=True),
        OperatorSpec("double", _not_in_process),
    ]
)


def partition(version: Any, start: int, end: int) -> dict[str, Any]:
    """The wire shape of a partition event of ``version`` (a dataset pointer)."""
    return {
        "dataset_uuid": str(version.dataset_uuid),
        "dataset_version": str(version.dataset_version),
        "partition_key": f"{start}-{end}",
        "start": start,
        "end": end,
    }


@dataclass
class Api:
    """A Dispatcher with the DAG deployed, its app, and a client with the token."""

    dispatcher: Dispatcher
    app: Any
    client: httpx.AsyncClient
    deployed: DeployResult
    clock: ManualClock

    @property
    def blocks(self) -> Any:
        """The ``blocks`` dataset version (``follow``'s output)."""
        return self.deployed.datasets["blocks"]

    async def trigger(self, key: str) -> uuid.UUID:
        """A manual task of ``follow`` for ``key``."""
        response = await self.client.post(
            "/internal/trigger", json={"job": "api/follow", "key": key}
        )
        assert response.status_code == 200, response.text
        return uuid.UUID(response.json()["task_id"])

    async def claim(self, task_id: uuid.UUID, worker: str = "worker-1") -> dict[str, Any]:
        """``/internal/task-claim``'s JSON answer."""
        response = await self.client.post(
            "/internal/task-claim", json={"task_id": str(task_id), "worker_id": worker}
        )
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    async def task(self, task_id: uuid.UUID) -> dict[str, Any]:
        """The task's row (status, attempt, lease token, error...)."""
        t = schema.tasks
        async with self.dispatcher.repo.read() as tx:
            row = (await tx.connection.execute(sa.select(t).where(t.c.id == task_id))).mappings()
            return dict(row.one())

    async def tasks_of(self, job: str) -> list[dict[str, Any]]:
        """Every task of ``job`` of the deployed DAG."""
        t = schema.tasks
        async with self.dispatcher.repo.read() as tx:
            rows = await tx.connection.execute(
                sa.select(t).where(t.c.job_id == self.deployed.jobs[job]).order_by(t.c.queued_at)
            )
            return [dict(r) for r in rows.mappings()]


@asynccontextmanager
async def api_platform(
    repo: SqlRepository,
    clock: ManualClock,
    *,
    config: ApiConfig | None = None,
    wakeups: WakeupQueue | None = None,
) -> AsyncIterator[Api]:
    """Deploy :data:`DAG` on ``repo`` and serve the app through an in-process client
    (wake-ups on ``wakeups``, the in-process queue by default)."""
    dispatcher = Dispatcher(repo, operators=OPERATORS, clock=clock, wakeups=wakeups)
    deployed = await dispatcher.deploy(parse_dag(DAG, operators=OPERATORS.names()))
    app = create_app(dispatcher, internal_token=TOKEN, config=config)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://trace.test", headers=AUTH
    ) as client:
        yield Api(dispatcher, app, client, deployed, clock)
