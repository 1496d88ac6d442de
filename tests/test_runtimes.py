"""Starting tasks per runtime, the in-process runner, and explain — both engines."""

from __future__ import annotations

import uuid
from typing import Any

import anyio
import pytest
import sqlalchemy as sa

from tests.factories import claims_locked_first, relay_partition
from trace_core.authoring.context import TaskContext
from trace_core.authoring.events import DatasetEvent
from trace_core.authoring.operators import OperatorRegistry, OperatorSpec
from trace_core.clock import ManualClock
from trace_core.dag import deploy, parse_dag
from trace_core.dispatcher.control import TaskControl
from trace_core.dispatcher.events import Producer
from trace_core.dispatcher.explain import explain_job
from trace_core.dispatcher.inprocess import InProcessLambdaInvoker, InProcessWakeupQueue
from trace_core.dispatcher.launcher import TaskLauncher
from trace_core.dispatcher.routing import EventRouter
from trace_core.dispatcher.runner import UNAVAILABLE, InProcessRunner, RunnerConfig
from trace_core.dispatcher.runtimes import RuntimeRegistry
from trace_core.errors import ConfigurationError
from trace_core.outbox import OutboxRelay
from trace_core.storage import schema
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import TaskQueue

pytestmark = pytest.mark.anyio

DAG = """
dag: runtimes
jobs:
  - name: follow
    activation: source
    runtime: dispatcher
    operator: emit_blocks
    source: { kind: manual }
    outputs: [ { dataset: blocks } ]
  - name: local
    activation: reactive
    runtime: dispatcher
    operator: double
    execution_strategy: PerPartition
    inputs: [ { from: { dataset: blocks } } ]
    outputs: [ { dataset: doubled } ]
  - name: fn
    activation: reactive
    runtime: lambda
    operator: count
    execution_strategy: PerPartition
    inputs: [ { from: { dataset: doubled }, where: "n > 1" } ]
    outputs: [ { dataset: counted } ]
  - name: udf
    activation: reactive
    runtime: ecs_udf
    operator: count
    execution_strategy: PerPartition
    inputs: [ { from: { dataset: blocks } } ]
    outputs: [ { dataset: udf_out } ]
"""


async def _explode(ctx: TaskContext) -> None:
    raise RuntimeError("operator bug")


OPERATORS = OperatorRegistry(
    [
        OperatorSpec("emit_blocks", relay_partition, source=True),
        OperatorSpec("double", relay_partition),
        OperatorSpec("count", relay_partition),
        OperatorSpec("explode", _explode),
    ]
)


class Platform:
    def __init__(self, repo: SqlRepository, clock: ManualClock) -> None:
        self.repo = repo
        self.clock = clock
        self.tasks = TaskQueue(repo, clock=clock)
        self.control = TaskControl(repo, clock=clock, tasks=self.tasks)
        self.runner = InProcessRunner(self.control, OPERATORS, worker_id="in-process")
        self.wakeups = InProcessWakeupQueue()
        self.lambdas = InProcessLambdaInvoker()
        launcher = TaskLauncher(
            repo,
            RuntimeRegistry(),
            wakeups=self.wakeups,
            lambdas=self.lambdas,
            in_process=self.runner.submit,
        )
        router = EventRouter(repo, clock=clock, tasks=self.tasks)
        self.producer: Producer | None = None
        self.relay = OutboxRelay(
            repo, {"route_event": router.handle, "enqueue_task": launcher.handle}, clock=clock
        )

    async def drain(self) -> None:
        while await self.relay.run_once():
            pass


async def _deployed(repo: SqlRepository, clock: ManualClock) -> Any:
    return await deploy(
        repo,
        parse_dag(DAG, file="runtimes.yaml", operators=OPERATORS.names()),
        clock=clock,
        operators=OPERATORS.names(),
    )


async def _emit_blocks(platform: Platform, deployed: Any, ranges: list[tuple[int, int]]) -> None:
    if platform.producer is None:
        job = deployed.jobs["follow"]
        (run,) = await platform.tasks.create([NewTask(job, dedupe_key="manual:run")])
        outcome = await platform.tasks.claim(run.task_id, "source")
        assert outcome.lease is not None
        platform.producer = Producer(run.task_id, outcome.lease.attempt)
    blocks = deployed.datasets["blocks"]
    events = [
        DatasetEvent(
            blocks.dataset_uuid,
            blocks.dataset_version,
            partition_key=f"{s}-{e}",
            start=s,
            end=e,
        )
        for s, e in ranges
    ]
    await platform.control.gateway.accept(events, producer=platform.producer)


async def test_each_runtime_starts_its_tasks(repo: SqlRepository, clock: ManualClock) -> None:
    platform = Platform(repo, clock)
    deployed = await _deployed(repo, clock)
    await _emit_blocks(platform, deployed, [(0, 9), (10, 19)])
    await platform.drain()

    t = schema.tasks
    async with repo.read() as tx:
        rows = (await tx.connection.execute(sa.select(t.c.id, t.c.job_id, t.c.status))).all()
    by_job: dict[uuid.UUID, list[Any]] = {}
    for row in rows:
        by_job.setdefault(row.job_id, []).append(row)
    # dispatcher runtime: run in process, completed, and its events routed on
    assert [r.status for r in by_job[deployed.jobs["local"]]] == ["Completed", "Completed"]
    # ecs_udf: a task-id-only wake-up on the runtime's queue
    udf_ids = {r.id for r in by_job[deployed.jobs["udf"]]}
    assert set(platform.wakeups.pending("trace-ecs-udf")) == udf_ids
    # lambda: invoked with the full task payload (the task-fetch shape), no queue
    fn_ids = {r.id for r in by_job[deployed.jobs["fn"]]}
    assert len(fn_ids) == 2
    invoked = {uuid.UUID(p["task_id"]): (name, p) for name, p in platform.lambdas.invocations}
    assert set(invoked) == fn_ids
    name, payload = next(iter(invoked.values()))
    assert name == "trace-count"
    assert payload["operator"] == "count"
    assert payload["inputs"][0]["where"] == "n > 1"
    assert payload["outputs"][0]["location"].endswith("/")


async def test_failing_operator_fails_the_attempt(repo: SqlRepository, clock: ManualClock) -> None:
    platform = Platform(repo, clock)
    deployed = await _deployed(repo, clock)
    job = deployed.jobs["local"]
    async with repo.transaction() as tx:
        await tx.connection.execute(
            sa.update(schema.jobs).where(schema.jobs.c.id == job).values(operator="explode")
        )
    (task,) = await platform.tasks.create([NewTask(job, dedupe_key="boom")])
    assert await platform.runner.run_task(task.task_id) == "failed"
    state = await platform.tasks.leases.inspect(task.task_id)
    assert state is not None and state.status == "Failed"
    assert state.last_error == "RuntimeError: operator bug"
    assert state.retry_at is not None  # a retry is scheduled


async def test_claim_refusal_runs_nothing(repo: SqlRepository, clock: ManualClock) -> None:
    platform = Platform(repo, clock)
    deployed = await _deployed(repo, clock)
    (task,) = await platform.tasks.create([NewTask(deployed.jobs["local"], dedupe_key="x")])
    await platform.tasks.cancel([task.task_id])
    assert await platform.runner.run_task(task.task_id) == "Canceled"


def test_unknown_runtime_and_operator_are_named() -> None:
    with pytest.raises(ConfigurationError, match="unknown runtime 'k8s'"):
        RuntimeRegistry().get("k8s")
    with pytest.raises(ConfigurationError, match="unknown operator 'nope'"):
        OPERATORS.get("nope")


async def test_explain_says_why(repo: SqlRepository, clock: ManualClock) -> None:
    platform = Platform(repo, clock)
    deployed = await _deployed(repo, clock)
    await _emit_blocks(platform, deployed, [(0, 9), (0, 9), (10, 19)])
    await platform.drain()
    await _emit_blocks(platform, deployed, [(0, 9)])  # a redelivery: counted, not re-routed
    report = await explain_job(repo, "runtimes", "local")
    assert report.tasks_by_status == {"Completed": 2}
    assert [e.decision for e in report.events] == ["created", "created"]
    assert max(e.deliveries for e in report.events) == 3
    assert any("created tasks" in r for r in report.reasons)
    text = report.render()
    assert "runtimes/local" in text and "x3 -> created" in text
    quiet = await explain_job(repo, "runtimes", "fn")
    assert quiet.events and all(e.decision == "created" for e in quiet.events)


async def test_a_restart_starts_in_process_tasks_whose_wakeups_died_with_their_process(
    repo: SqlRepository, clock: ManualClock
) -> None:
    platform = Platform(repo, clock)
    deployed = await _deployed(repo, clock)

    async def died(task_ids: Any) -> None:
        """A runner that took the hand-off and died before claiming."""

    dead = TaskLauncher(
        repo, RuntimeRegistry(), wakeups=platform.wakeups, lambdas=platform.lambdas, in_process=died
    )
    router = EventRouter(repo, clock=clock, tasks=platform.tasks)
    relay = OutboxRelay(
        repo, {"route_event": router.handle, "enqueue_task": dead.handle}, clock=clock
    )
    await _emit_blocks(platform, deployed, [(0, 9), (10, 19), (20, 29)])
    while await relay.run_once():
        pass
    t = schema.tasks
    async with repo.read() as tx:
        rows = (await tx.connection.execute(sa.select(t.c.id, t.c.job_id, t.c.status))).all()
    local = sorted(r.id for r in rows if r.job_id == deployed.jobs["local"])
    udf = [r.id for r in rows if r.job_id == deployed.jobs["udf"]]
    assert len(local) == 3 and len(udf) == 3
    assert {r.status for r in rows if r.id in {*local, *udf}} == {"Queued"}
    assert await platform.runner.run_task(local[0]) == "completed"

    handed: list[uuid.UUID] = []

    async def restarted_runner(task_ids: Any) -> None:
        handed.extend(task_ids)
        await platform.runner.submit(task_ids)

    restarted = TaskLauncher(
        repo,
        RuntimeRegistry(),
        wakeups=InProcessWakeupQueue(),
        lambdas=platform.lambdas,
        in_process=restarted_runner,
    )
    # Pages of one: the keyset paging is walked, and every page is handed over.
    assert await restarted.start_queued_in_process(batch=1) == 2
    assert sorted(handed) == local[1:]
    for task_id in local:
        state = await platform.tasks.leases.inspect(task_id)
        assert state is not None and state.status == "Completed"
    # A queue runtime's wake-ups live in its queue, not in a process: left alone.
    for task_id in udf:
        state = await platform.tasks.leases.inspect(task_id)
        assert state is not None and state.status == "Queued" and state.claim_version == 0
    assert await restarted.start_queued_in_process() == 0


async def test_a_hand_off_whose_claim_met_an_outage_is_tried_again(
    repo: SqlRepository, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The database is unavailable past the client's retry budget (none here):
    # the wake-up is acknowledged already, so the runner itself tries again.
    platform = Platform(repo, clock)
    deployed = await _deployed(repo, clock)
    (task,) = await platform.tasks.create([NewTask(deployed.jobs["local"], dedupe_key="x")])
    failures = claims_locked_first(monkeypatch, platform.control, 2)
    runner = InProcessRunner(
        platform.control,
        OPERATORS,
        worker_id="in-process",
        config=RunnerConfig(retry_seconds=0, again_seconds=0.01),
    )
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await runner.start(tg)
            await runner.submit([task.task_id])
            await runner.drain()
    # relay_partition fails a task without inputs: what matters is that it was claimed.
    assert runner.outcomes == {UNAVAILABLE: 2, "failed": 1}
    state = await platform.tasks.leases.inspect(task.task_id)
    assert state is not None and state.claim_version == 1 and not failures
