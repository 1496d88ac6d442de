"""The Dispatcher end to end, on both engines: events flow through in-process
operators; a changed producer rematerializes while readers keep the current
version, then the pointers swap; a rollback cancels the abandoned work."""

from __future__ import annotations

import time
import uuid
from typing import Any

import anyio
import pytest
import sqlalchemy as sa

from tests.factories import relay_partition, wait_until
from trace_core.authoring.context import OperatorResult, TaskContext
from trace_core.authoring.events import DatasetEvent
from trace_core.authoring.operators import OperatorRegistry, OperatorSpec
from trace_core.clock import ManualClock
from trace_core.dag import parse_dag
from trace_core.dispatcher.runner import RunnerConfig
from trace_core.dispatcher.service import Dispatcher, DispatcherConfig
from trace_core.storage import schema
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio


def dag(factor: int) -> str:
    return f"""
dag: remat
jobs:
  - name: follow
    activation: source
    runtime: dispatcher
    operator: relay
    source: {{ kind: manual }}
    outputs: [ {{ dataset: blocks }} ]
  - name: scale
    activation: reactive
    runtime: dispatcher
    operator: relay
    execution_strategy: PerPartition
    config: {{ factor: {factor} }}
    inputs: [ {{ from: {{ dataset: blocks }} }} ]
    outputs: [ {{ dataset: scaled }} ]
  - name: reader
    activation: reactive
    runtime: dispatcher
    operator: relay
    execution_strategy: PerPartition
    inputs: [ {{ from: {{ dataset: scaled }} }} ]
    outputs: [ {{ dataset: read }} ]
"""


OPERATORS = OperatorRegistry([OperatorSpec("relay", relay_partition)])


async def _blocks(dispatcher: Dispatcher, version: Any, ranges: list[tuple[int, int]]) -> None:
    await dispatcher.manual.emit(
        [
            DatasetEvent(
                version.dataset_uuid,
                version.dataset_version,
                partition_key=f"{s}-{e}",
                start=s,
                end=e,
            )
            for s, e in ranges
        ]
    )


async def _tasks(repo: SqlRepository, job_id: uuid.UUID) -> list[Any]:
    t = schema.tasks
    async with repo.read() as tx:
        rows = await tx.connection.execute(
            sa.select(t.c.status, t.c.input_versions, t.c.partitions).where(t.c.job_id == job_id)
        )
        return list(rows)


async def _current(repo: SqlRepository) -> uuid.UUID:
    c = schema.dag_current_versions
    async with repo.read() as tx:
        return uuid.UUID(
            str(
                (
                    await tx.connection.execute(
                        sa.select(c.c.dag_version_id).where(c.c.dag_name == "remat")
                    )
                ).scalar_one()
            )
        )


async def test_events_flow_through_in_process_operators(
    repo: SqlRepository, clock: ManualClock
) -> None:
    dispatcher = Dispatcher(repo, operators=OPERATORS, clock=clock)
    v1 = await dispatcher.deploy(parse_dag(dag(1), operators=OPERATORS.names()))
    await _blocks(dispatcher, v1.datasets["blocks"], [(0, 9), (10, 19), (0, 9)])
    await dispatcher.run_once()
    for job in ("scale", "reader"):
        rows = await _tasks(repo, v1.jobs[job])
        assert sorted(r.partitions[0] for r in rows) == ["0-9", "10-19"]
        assert {r.status for r in rows} == {"Completed"}


async def test_rematerialize_swaps_when_caught_up_and_readers_keep_reading(
    repo: SqlRepository, clock: ManualClock
) -> None:
    dispatcher = Dispatcher(repo, operators=OPERATORS, clock=clock)
    v1 = await dispatcher.deploy(parse_dag(dag(1), operators=OPERATORS.names()))
    await _blocks(dispatcher, v1.datasets["blocks"], [(0, 9), (10, 19)])
    await dispatcher.run_once()

    v2 = await dispatcher.deploy(parse_dag(dag(2), operators=OPERATORS.names()))
    assert v2.status == "building"
    assert not v2.datasets["blocks"].new_version  # the source did not change
    assert v2.datasets["scaled"].new_version and v2.datasets["read"].new_version
    assert await _current(repo) == v1.dag_version_id

    # while v2 builds, a new block range reaches both generations
    await _blocks(dispatcher, v1.datasets["blocks"], [(20, 29)])
    await dispatcher.run_once()
    await dispatcher.run_once()  # the promoter sees the coverage written last round

    assert await _current(repo) == v2.dag_version_id
    new_scale = await _tasks(repo, v2.jobs["scale"])
    assert sorted(r.partitions[0] for r in new_scale) == ["0-9", "10-19", "20-29"]  # backfilled
    # the old reader only ever read the old generation of `scaled`
    old_reader = await _tasks(repo, v1.jobs["reader"])
    assert {r.input_versions["inputs"][0]["dataset_version"] for r in old_reader} == {
        str(v1.datasets["scaled"].dataset_version)
    }
    new_reader = await _tasks(repo, v2.jobs["reader"])
    assert {r.input_versions["inputs"][0]["dataset_version"] for r in new_reader} == {
        str(v2.datasets["scaled"].dataset_version)
    }
    assert all(r.status == "Completed" for r in new_scale + new_reader)


async def test_rollback_cancels_the_abandoned_versions_tasks(
    repo: SqlRepository, clock: ManualClock
) -> None:
    dispatcher = Dispatcher(repo, operators=OPERATORS, clock=clock)
    v1 = await dispatcher.deploy(parse_dag(dag(1), operators=OPERATORS.names()))
    await _blocks(dispatcher, v1.datasets["blocks"], [(0, 9), (10, 19)])
    await dispatcher.run_once()
    v2 = await dispatcher.deploy(parse_dag(dag(3), operators=OPERATORS.names()))
    await dispatcher.backfill.run_once()  # v2's tasks exist but have not run
    assert {r.status for r in await _tasks(repo, v2.jobs["scale"])} == {"Queued"}

    result = await dispatcher.rollback("remat")
    assert v2.dag_version_id in result.abandoned_version_ids
    assert {r.status for r in await _tasks(repo, v2.jobs["scale"])} == {"Canceled"}
    assert {r.status for r in await _tasks(repo, v1.jobs["scale"])} == {"Completed"}
    assert await _current(repo) == v1.dag_version_id


async def test_always_on_source_runs_in_process_and_feeds_the_dag(
    repo: SqlRepository, clock: ManualClock
) -> None:
    seen: list[str] = []

    async def pulse(ctx: TaskContext) -> OperatorResult:
        """A finite source: asks for its directive, emits one block range, returns."""
        seen.append(await ctx.directive())
        out = ctx.outputs[0]
        await ctx.emit(
            [
                DatasetEvent(
                    uuid.UUID(out["dataset_uuid"]),
                    uuid.UUID(out["dataset_version"]),
                    partition_key="0-9",
                    start=0,
                    end=9,
                )
            ]
        )
        return OperatorResult()

    operators = OperatorRegistry(
        [OperatorSpec("relay", relay_partition), OperatorSpec("pulse", pulse)]
    )
    text = dag(1).replace(
        "operator: relay\n    source: { kind: manual }",
        "operator: pulse\n    source: { kind: always_on }",
    )
    dispatcher = Dispatcher(repo, operators=operators, clock=clock)
    deployed = await dispatcher.deploy(parse_dag(text, operators=operators.names()))
    await dispatcher.run_once()
    assert seen == ["run"]
    runs = await _tasks(repo, deployed.jobs["follow"])
    assert [r.status for r in runs] == ["Completed"]
    scaled = await _tasks(repo, deployed.jobs["scale"])
    assert [(r.partitions, r.status) for r in scaled] == [(["0-9"], "Completed")]


async def test_redeploying_an_abandoned_yaml_builds_afresh(
    repo: SqlRepository, clock: ManualClock
) -> None:
    dispatcher = Dispatcher(repo, operators=OPERATORS, clock=clock)
    v1 = await dispatcher.deploy(parse_dag(dag(1), operators=OPERATORS.names()))
    await _blocks(dispatcher, v1.datasets["blocks"], [(0, 9)])
    await dispatcher.run_once()
    v2 = await dispatcher.deploy(parse_dag(dag(2), operators=OPERATORS.names()))
    await dispatcher.backfill.run_once()
    await dispatcher.rollback("remat")
    assert {r.status for r in await _tasks(repo, v2.jobs["scale"])} == {"Canceled"}

    again = await dispatcher.deploy(parse_dag(dag(2), operators=OPERATORS.names()))
    assert again.changed and again.status == "building"
    assert again.dag_version_id != v2.dag_version_id  # not the abandoned one
    assert again.datasets["scaled"].dataset_version == v2.datasets["scaled"].dataset_version
    await dispatcher.run_once()
    await dispatcher.run_once()
    assert {r.status for r in await _tasks(repo, again.jobs["scale"])} == {"Completed"}
    assert await _current(repo) == again.dag_version_id
    # deploying it once more changes nothing
    assert not (await dispatcher.deploy(parse_dag(dag(2), operators=OPERATORS.names()))).changed


async def test_a_wakeup_held_in_memory_when_its_process_died_is_started_by_the_next(
    repo: SqlRepository, clock: ManualClock
) -> None:
    # The runner of the first process has one slot, taken by a task that
    # blocks; the relay hands it the second task's wake-up (and acknowledges
    # it), which waits for that slot in memory. The process then dies.
    holding = anyio.Event()

    async def hold(ctx: TaskContext) -> OperatorResult:
        holding.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    config = DispatcherConfig(runner=RunnerConfig(concurrency=1))
    first = Dispatcher(
        repo, operators=OperatorRegistry([OperatorSpec("relay", hold)]), clock=clock, config=config
    )
    deployed = await first.deploy(parse_dag(dag(1), operators=OPERATORS.names()))
    await _blocks(first, deployed.datasets["blocks"], [(0, 9), (10, 19)])
    with anyio.fail_after(30):
        async with anyio.create_task_group() as died:
            await first.runner.start(died)
            while await first.relay.run_once():
                pass
            await holding.wait()
            assert first.runner.in_flight == 2
            died.cancel_scope.cancel()
    statuses = sorted(r.status for r in await _tasks(repo, deployed.jobs["scale"]))
    assert statuses == ["Queued", "Running"]
    async with repo.read() as tx:
        assert await tx.status.open_outbox_count() == 0  # no wake-up left for it

    second = Dispatcher(repo, operators=OPERATORS, clock=clock)

    async def started() -> bool:
        return "Completed" in {r.status for r in await _tasks(repo, deployed.jobs["scale"])}

    async def describe() -> str:
        return str([r.status for r in await _tasks(repo, deployed.jobs["scale"])])

    async with anyio.create_task_group() as tg:
        await second.start(tg)
        await wait_until(
            "the stranded task started", started, time.monotonic() + 30, describe=describe
        )
        await second.stop()
        tg.cancel_scope.cancel()
    # The held task's lease is still the dead process's (its lease expires later).
    statuses = sorted(r.status for r in await _tasks(repo, deployed.jobs["scale"]))
    assert statuses == ["Completed", "Running"]
