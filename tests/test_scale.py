"""Scale to zero on both engines: Idle/Running transitions of reactive jobs."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import sqlalchemy as sa

from trace_core.clock import ManualClock
from trace_core.dag import DeployResult, deploy, parse_dag
from trace_core.dispatcher.journal import read_journal
from trace_core.dispatcher.scale import IdleScaler, ScaleConfig, idle_timeout_seconds
from trace_core.errors import ConfigurationError
from trace_core.storage import schema
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import TaskQueue

pytestmark = pytest.mark.anyio


def reactive(name: str, idle_timeout: str | None) -> str:
    line = f"\n    idle_timeout: {idle_timeout!r}" if idle_timeout is not None else ""
    return f"""
  - name: {name}
    activation: reactive
    runtime: dispatcher
    operator: noop
    execution_strategy: PerUpdate{line}
    inputs: [{{from: {{job: src}}}}]
    outputs: [{{dataset: {name}_out}}]"""


DAG = (
    """
dag: scaled
jobs:
  - name: src
    activation: source
    runtime: dispatcher
    operator: noop
    source: {kind: manual}
    outputs: [{dataset: src_out}]"""
    + reactive("five", "5m")
    + reactive("zero", "0")
    + reactive("never", "never")
    + reactive("unset", None)
)


@pytest.fixture
async def dag(repo: SqlRepository, clock: ManualClock) -> DeployResult:
    return await deploy(repo, parse_dag(DAG), clock=clock)


async def add_task(repo: SqlRepository, clock: ManualClock, job: uuid.UUID) -> uuid.UUID:
    [created] = await TaskQueue(repo, clock=clock).create([NewTask(job)])
    return created.task_id


async def finish(repo: SqlRepository, clock: ManualClock, task: uuid.UUID) -> None:
    tq = TaskQueue(repo, clock=clock)
    outcome = await tq.claim(task, "worker")
    assert outcome.lease is not None
    await tq.complete(outcome.lease.fence)


async def state(repo: SqlRepository, job: uuid.UUID) -> Any:
    s = schema.job_states
    async with repo.read() as t:
        return (await t.connection.execute(sa.select(s).where(s.c.job_id == job))).one()


async def kinds(repo: SqlRepository, job: uuid.UUID) -> list[str]:
    async with repo.read() as t:
        return [e["kind"] for e in reversed(await read_journal(t, job))]


async def test_idle_timeout_scales_to_zero(
    repo: SqlRepository, clock: ManualClock, dag: DeployResult
) -> None:
    job = dag.jobs["five"]
    scaler = IdleScaler(repo, clock=clock)
    assert (await scaler.run_once()).scaled_up == []
    assert (await scaler.scale_states())[job] == "Idle"

    task = await add_task(repo, clock, job)
    report = await scaler.run_once()
    assert report.scaled_up == [job]
    assert (await state(repo, job)).last_activity_at == clock.now()
    clock.advance(120)
    tq = TaskQueue(repo, clock=clock)
    lease = (await tq.claim(task, "worker")).lease
    assert lease is not None
    assert await scaler.run_once() == type(report)()  # Running, still busy
    assert (await state(repo, job)).last_activity_at == clock.now()

    await tq.complete(lease.fence)
    clock.advance(299)
    assert (await scaler.run_once()).scaled_down == []
    assert (await scaler.scale_states())[job] == "Running"
    clock.advance(1)
    assert (await scaler.run_once()).scaled_down == [job]
    assert (await scaler.scale_states())[job] == "Idle"
    assert await kinds(repo, job) == ["scale_up", "scale_to_zero"]

    # New work wakes it again.
    await add_task(repo, clock, job)
    assert (await scaler.run_once()).scaled_up == [job]


async def test_zero_never_and_default(
    repo: SqlRepository, clock: ManualClock, dag: DeployResult
) -> None:
    zero, never, unset = dag.jobs["zero"], dag.jobs["never"], dag.jobs["unset"]
    tasks = {job: await add_task(repo, clock, job) for job in (zero, never, unset)}
    scaler = IdleScaler(repo, clock=clock)
    assert sorted((await scaler.run_once()).scaled_up) == sorted(tasks)
    for task in tasks.values():
        await finish(repo, clock, task)
    assert (await scaler.run_once()).scaled_down == [zero]  # '0': at once
    clock.advance(days=30)
    assert (await scaler.run_once()).scaled_down == []  # 'never', and unset = 'never'
    states = await scaler.scale_states()
    assert (states[zero], states[never], states[unset]) == ("Idle", "Running", "Running")

    # A deployment may default unset jobs to a timeout instead.
    short = IdleScaler(repo, clock=clock, config=ScaleConfig(default_idle_timeout="30s"))
    assert (await short.run_once()).scaled_down == [unset]
    assert (await kinds(repo, unset))[-1] == "scale_to_zero"


async def test_concurrent_scalers_journal_once(
    repo: SqlRepository, clock: ManualClock, dag: DeployResult
) -> None:
    job = dag.jobs["zero"]
    task = await add_task(repo, clock, job)
    a, b = IdleScaler(repo, clock=clock), IdleScaler(repo, clock=clock)
    assert (await a.run_once()).scaled_up == [job]
    assert (await b.run_once()).scaled_up == []
    await finish(repo, clock, task)
    assert (await b.run_once()).scaled_down == [job]
    assert (await a.run_once()).scaled_down == []
    assert await kinds(repo, job) == ["scale_up", "scale_to_zero"]


async def test_idle_timeout_parsing() -> None:
    assert idle_timeout_seconds("never") is None
    assert idle_timeout_seconds(None) is None
    assert idle_timeout_seconds(None, "5m") == 300
    assert idle_timeout_seconds("0") == 0
    assert idle_timeout_seconds("30s") == 30
    assert idle_timeout_seconds("2h") == 7200
    with pytest.raises(ConfigurationError, match="idle_timeout"):
        idle_timeout_seconds("soon")
    with pytest.raises(ConfigurationError):
        ScaleConfig(default_idle_timeout="later")
    with pytest.raises(ConfigurationError):
        ScaleConfig(interval_seconds=0)
