"""Event acceptance and routing, on both engines."""

from __future__ import annotations

import random
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import sqlalchemy as sa

from tests.event_fixtures import wait_for_lock_waiter
from trace_core.authoring.events import DatasetEvent, parse_events
from trace_core.clock import ManualClock
from trace_core.dag import DeployResult, deploy, parse_dag
from trace_core.dispatcher.events import EventGateway, Producer
from trace_core.dispatcher.routing import EventRouter
from trace_core.errors import InvalidInput, StaleClaim
from trace_core.limits import MAX_BIGINT, MAX_RANGE_BOUND
from trace_core.model import Fence
from trace_core.outbox import OutboxRelay
from trace_core.storage import schema
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository, SqlTransaction
from trace_core.tasks import TaskQueue

pytestmark = pytest.mark.anyio

DAG = """
dag: routing
jobs:
  - name: follow
    activation: source
    runtime: dispatcher
    operator: block_follower
    source: { kind: always_on }
    outputs:
      - { dataset: blocks, kind: parquet }
      - { dataset: txs, kind: parquet }
    update_strategy: replace
  - name: per_update
    activation: reactive
    runtime: ecs_platform
    operator: range_aggregator
    execution_strategy: PerUpdate
    inputs: [ { from: { dataset: blocks }, where: "number > 10" } ]
    outputs: [ { dataset: pu_out, kind: parquet } ]
    update_strategy: replace
  - name: join
    activation: reactive
    runtime: ecs_platform
    operator: range_aggregator
    execution_strategy: PerPartition
    inputs:
      - from: { job: follow, output_index: 0 }
      - from: { job: follow, output_index: 1 }
    outputs: [ { dataset: join_out, kind: parquet } ]
    update_strategy: replace
"""


class World:
    """A deployed DAG with a running source attempt that emits events."""

    def __init__(self, repo: SqlRepository, clock: ManualClock, deployed: DeployResult) -> None:
        self.repo = repo
        self.clock = clock
        self.deployed = deployed
        self.tasks = TaskQueue(repo, clock=clock)
        self.gateway = EventGateway(repo, clock=clock)
        self.router = EventRouter(repo, clock=clock, tasks=self.tasks)
        self.producer: Producer | None = None
        self.fence: Fence | None = None

    def pointer(self, dataset: str) -> tuple[uuid.UUID, uuid.UUID]:
        p = self.deployed.datasets[dataset]
        return p.dataset_uuid, p.dataset_version

    def partition(self, dataset: str, start: int, end: int) -> DatasetEvent:
        ds, version = self.pointer(dataset)
        return DatasetEvent(ds, version, partition_key=f"{start}-{end}", start=start, end=end)

    def cursor(self, dataset: str, cursor: int) -> DatasetEvent:
        ds, version = self.pointer(dataset)
        return DatasetEvent(ds, version, cursor=cursor)

    async def start_source(self) -> None:
        job = self.deployed.jobs["follow"]
        (run,) = await self.tasks.create([NewTask(job, dedupe_key=f"source-run:{job}")])
        outcome = await self.tasks.claim(run.task_id, "source-worker")
        assert outcome.lease is not None
        self.fence = Fence(run.task_id, outcome.lease.attempt, outcome.lease.lease_token, None)
        self.producer = Producer(run.task_id, outcome.lease.attempt)

    async def emit(self, events: list[DatasetEvent]) -> list[uuid.UUID]:
        result = await self.gateway.accept(events, producer=self.producer)
        return result.event_ids

    async def route_all(self) -> int:
        relay = OutboxRelay(self.repo, {"route_event": self.router.handle}, clock=self.clock)
        relay.handlers["enqueue_task"] = _ignore
        handled = 0
        while n := await relay.run_once():
            handled += n
        return handled

    async def tasks_of(self, job: str) -> list[Any]:
        t = schema.tasks
        async with self.repo.read() as tx:
            rows = await tx.connection.execute(
                sa.select(t.c.id, t.c.dedupe_key, t.c.partitions, t.c.input_versions)
                .where(t.c.job_id == self.deployed.jobs[job])
                .order_by(t.c.dedupe_key)
            )
            return list(rows)


async def _ignore(payload: Any) -> None:
    return None


@pytest.fixture
async def world(repo: SqlRepository, clock: ManualClock) -> World:
    deployed = await deploy(repo, parse_dag(DAG, file="routing.yaml"), clock=clock)
    w = World(repo, clock, deployed)
    await w.start_source()
    return w


async def test_partition_events_create_one_task_per_unit(world: World) -> None:
    ranges = [(s, s + 99) for s in range(0, 1000, 100)]
    events = [world.partition("blocks", s, e) for s, e in ranges]
    events += [world.partition("txs", s, e) for s, e in ranges]
    duplicated = events + random.Random(7).sample(events, 6)
    random.Random(3).shuffle(duplicated)
    await world.emit(duplicated)
    await world.route_all()

    per_update = await world.tasks_of("per_update")
    blocks, v = world.pointer("blocks")
    assert [r.dedupe_key for r in per_update] == sorted(
        f"partition:{blocks}:{v}:{s}-{e}" for s, e in ranges
    )
    # the where filter travels with the task's pinned inputs
    inputs = per_update[0].input_versions["inputs"]
    assert inputs[0]["where"] == "number > 10"
    assert inputs[0]["dataset_version"] == str(v)

    join = await world.tasks_of("join")
    assert len(join) == len(ranges)  # one per partition, not one per input event
    assert {r.dedupe_key for r in join} == {f"partition:{blocks}:{v}:{s}-{e}" for s, e in ranges}
    assert all(len(r.partitions) == 1 for r in join)

    # redelivering everything, in another order, creates nothing new
    random.Random(11).shuffle(duplicated)
    await world.emit(duplicated)
    await world.route_all()
    assert len(await world.tasks_of("per_update")) == len(ranges)
    assert len(await world.tasks_of("join")) == len(ranges)


async def test_join_waits_for_every_input(world: World) -> None:
    await world.emit([world.partition("blocks", 0, 99)])
    await world.route_all()
    assert await world.tasks_of("join") == []  # txs 0-99 is not there yet
    assert len(await world.tasks_of("per_update")) == 1
    await world.emit([world.partition("txs", 0, 99)])
    await world.route_all()
    blocks, v = world.pointer("blocks")
    # the last input to arrive creates the task, keyed by the first input
    assert [r.dedupe_key for r in await world.tasks_of("join")] == [f"partition:{blocks}:{v}:0-99"]


async def test_cursor_events_per_update(world: World) -> None:
    await world.emit([world.cursor("blocks", c) for c in (5, 6, 5, 7)])
    await world.route_all()
    blocks, v = world.pointer("blocks")
    keys = [r.dedupe_key for r in await world.tasks_of("per_update")]
    assert keys == [f"cursor:{blocks}:{v}:{c}" for c in (5, 6, 7)]


async def test_the_largest_cursor_and_range_bound_are_stored_and_routed(world: World) -> None:
    """The limits of :mod:`trace_core.limits` fit the columns and the coverage
    ranges (Postgres keeps ``[start, end + 1)`` as an ``int8range``)."""
    top = MAX_RANGE_BOUND
    await world.emit([world.cursor("blocks", MAX_BIGINT), world.partition("blocks", top, top)])
    await world.emit([world.partition("txs", top, top)])
    await world.route_all()
    blocks, v = world.pointer("blocks")
    assert [r.dedupe_key for r in await world.tasks_of("per_update")] == [
        f"cursor:{blocks}:{v}:{MAX_BIGINT}",
        f"partition:{blocks}:{v}:{top}-{top}",
    ]
    assert f"partition:{blocks}:{v}:{top}-{top}" in {
        r.dedupe_key for r in await world.tasks_of("join")
    }


@pytest.mark.parametrize(
    ("numbers", "field"),
    [
        ({"cursor": MAX_BIGINT + 1}, "event.cursor"),
        ({"cursor": -1}, "event.cursor"),
        ({"partition_key": f"0-{MAX_BIGINT}", "start": 0, "end": MAX_BIGINT}, "event.end"),
        ({"partition_key": "-1-2", "start": -1, "end": 2}, "event.start"),
    ],
    ids=["cursor-too-large", "cursor-negative", "end-too-large", "start-negative"],
)
def test_event_numbers_out_of_their_columns_range_name_the_field(
    numbers: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidInput) as err:
        DatasetEvent(uuid.uuid4(), uuid.uuid4(), **numbers)
    assert err.value.field == field
    doc = {"dataset_uuid": str(uuid.uuid4()), "dataset_version": str(uuid.uuid4()), **numbers}
    with pytest.raises(InvalidInput) as err:
        parse_events([doc])
    assert err.value.field == field.replace("event", "events[0]")


async def test_task_inputs_record_the_input_versions(world: World, repo: SqlRepository) -> None:
    await world.emit([world.partition("blocks", 0, 9), world.partition("txs", 0, 9)])
    await world.route_all()
    ti = schema.task_inputs
    async with repo.read() as tx:
        rows = (
            await tx.connection.execute(
                sa.select(ti.c.task_id, ti.c.input_dataset_uuid, ti.c.input_partition_key)
            )
        ).all()
    join = await world.tasks_of("join")
    blocks, _ = world.pointer("blocks")
    txs, _ = world.pointer("txs")
    assert {(r[1], r[2]) for r in rows if r[0] == join[0].id} == {(blocks, "0-9"), (txs, "0-9")}


async def test_stale_attempt_is_rejected_and_changes_nothing(
    world: World, repo: SqlRepository, clock: ManualClock
) -> None:
    assert world.producer is not None and world.fence is not None
    await world.tasks.fail(world.fence, "boom")
    clock.advance(3600)
    await world.tasks.requeue_due()
    outcome = await world.tasks.claim(world.producer.task_id, "other-worker")
    assert outcome.lease is not None and outcome.lease.attempt == 2
    with pytest.raises(StaleClaim):
        await world.emit([world.partition("blocks", 0, 9)])
    async with repo.read() as tx:
        count = (
            await tx.connection.execute(sa.select(sa.func.count()).select_from(schema.events))
        ).scalar_one()
    assert count == 0


async def test_late_reply_of_current_attempt_is_accepted(world: World) -> None:
    """A timed-out attempt may still report while no newer attempt started."""
    assert world.fence is not None
    await world.tasks.fail(world.fence, "timeout: ran too long", timed_out=True)
    ids = await world.emit([world.partition("blocks", 0, 9)])
    assert len(ids) == 1


async def test_events_must_name_the_producers_outputs(world: World) -> None:
    other, version = world.pointer("pu_out")
    with pytest.raises(InvalidInput) as err:
        await world.emit([DatasetEvent(other, version, cursor=1)])
    assert err.value.field == "events[0].dataset_uuid"
    blocks, _ = world.pointer("blocks")
    with pytest.raises(InvalidInput) as err:
        await world.emit([DatasetEvent(blocks, uuid.uuid4(), cursor=1)])
    assert err.value.field == "events[0].dataset_version"
    # the error names the first bad event of a request, wherever it stands
    good = world.cursor("blocks", 1)
    with pytest.raises(InvalidInput) as err:
        await world.emit([good, good, DatasetEvent(other, version, cursor=2)])
    assert err.value.field == "events[2].dataset_uuid"
    with pytest.raises(InvalidInput) as err:  # another dataset's version
        await world.emit([good, DatasetEvent(blocks, version, cursor=2), good])
    assert err.value.field == "events[1].dataset_version"
    assert "is not a version of dataset" in err.value.reason


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"dataset_version": str(uuid.uuid4()), "cursor": 1}, "events[0].dataset_uuid"),
        (
            {"dataset_uuid": "nope", "dataset_version": str(uuid.uuid4()), "cursor": 1},
            "events[0].dataset_uuid",
        ),
        ({"dataset_uuid": str(uuid.uuid4()), "dataset_version": str(uuid.uuid4())}, "events[0]"),
        (
            {
                "dataset_uuid": str(uuid.uuid4()),
                "dataset_version": str(uuid.uuid4()),
                "partition_key": "1-2",
                "start": 1,
                "end": 3,
            },
            "events[0].partition_key",
        ),
        (
            {
                "dataset_uuid": str(uuid.uuid4()),
                "dataset_version": str(uuid.uuid4()),
                "partition_key": "5-2",
                "start": 5,
                "end": 2,
            },
            "events[0].end",
        ),
        (
            {
                "dataset_uuid": str(uuid.uuid4()),
                "dataset_version": str(uuid.uuid4()),
                "cursor": True,
            },
            "events[0].cursor",
        ),
        (
            {
                "dataset_uuid": str(uuid.uuid4()),
                "dataset_version": str(uuid.uuid4()),
                "cursor": 1,
                "extra": 1,
            },
            "events[0].extra",
        ),
    ],
)
def test_malformed_events_name_the_field(doc: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidInput) as err:
        parse_events([doc])
    assert err.value.field == field


async def test_paused_dependent_defers_without_losing_the_event(
    world: World, repo: SqlRepository, clock: ManualClock
) -> None:
    job = world.deployed.jobs["per_update"]
    async with repo.transaction() as tx:
        await tx.connection.execute(
            sa.insert(schema.job_states).values(job_id=job, paused=True, updated_at=clock.now())
        )
    (event_id,) = await world.emit([world.partition("blocks", 0, 9)])
    await world.route_all()
    assert await world.tasks_of("per_update") == []
    async with repo.transaction() as tx:
        await tx.connection.execute(
            sa.update(schema.job_states)
            .where(schema.job_states.c.job_id == job)
            .values(paused=False)
        )
        status = (
            await tx.connection.execute(
                sa.select(schema.events.c.route_status).where(schema.events.c.id == event_id)
            )
        ).scalar_one()
    assert status == "pending"
    clock.advance(10)  # the deferred outbox row falls due
    await world.route_all()
    assert len(await world.tasks_of("per_update")) == 1


SINGLE_INPUT_DAG = """
dag: single
jobs:
  - name: follow
    activation: source
    runtime: dispatcher
    operator: block_follower
    source: { kind: always_on }
    outputs: [ { dataset: blocks, kind: parquet } ]
    update_strategy: replace
  - name: per_partition
    activation: reactive
    runtime: ecs_platform
    operator: range_aggregator
    execution_strategy: PerPartition
    inputs: [ { from: { dataset: blocks } } ]
    outputs: [ { dataset: pp_out, kind: parquet } ]
    update_strategy: replace
  - name: per_update
    activation: reactive
    runtime: ecs_platform
    operator: range_aggregator
    execution_strategy: PerUpdate
    inputs: [ { from: { dataset: blocks }, where: "number > 10" } ]
    outputs: [ { dataset: pu_out, kind: parquet } ]
    update_strategy: replace
"""


async def test_single_input_routing_records_every_outcome(
    repo: SqlRepository, clock: ManualClock
) -> None:
    """Only single-input dependents: Postgres routes the batch in one set-based
    statement, SQLite through the generic planner; both must store the same."""
    deployed = await deploy(repo, parse_dag(SINGLE_INPUT_DAG, file="single.yaml"), clock=clock)
    world = World(repo, clock, deployed)
    await world.start_source()
    blocks, v = world.pointer("blocks")
    pp = deployed.jobs["per_partition"]
    # a task that already holds one unit: routing finds it instead of making one
    (held,) = await world.tasks.create([NewTask(pp, dedupe_key=f"partition:{blocks}:{v}:0-9")])
    events = [world.partition("blocks", 0, 9), world.partition("blocks", 10, 19)]
    events += [world.cursor("blocks", 7), DatasetEvent(blocks, v, partition_key="tail")]
    ids = await world.emit([*events, events[1]])
    await world.route_all()

    units = ["partition:0-9", "partition:10-19", "cursor:7", "partition:tail"]
    keys = [
        f"partition:{blocks}:{v}:0-9",
        f"partition:{blocks}:{v}:10-19",
        f"cursor:{blocks}:{v}:7",
        f"partition:{blocks}:{v}:tail",
    ]
    entries: list[dict[str, Any]] = [
        {"partition_key": "0-9", "start": 0, "end": 9},
        {"partition_key": "10-19", "start": 10, "end": 19},
        {"cursor": "7"},
        {"partition_key": "tail"},
    ]
    pinned = {"dataset_uuid": str(blocks), "dataset_version": str(v)}
    for job, where in (("per_partition", None), ("per_update", "number > 10")):
        tasks = {r.dedupe_key: r for r in await world.tasks_of(job)}
        assert sorted(tasks) == sorted(keys), job
        for event_id, key, entry in zip(ids, keys, entries, strict=False):
            if job == "per_partition" and key == keys[0]:
                assert tasks[key].id == held.task_id and tasks[key].input_versions is None
                continue
            assert tasks[key].input_versions == {
                "inputs": [{**pinned, "where": where, **entry}],
                "trigger_event_id": str(event_id),
            }, (job, key)
            assert tasks[key].partitions == (
                None if "cursor" in entry else [entry["partition_key"]]
            )

    e, ti, t = schema.events, schema.task_inputs, schema.tasks
    async with repo.read() as tx:
        conn = tx.connection
        stored = {
            r.unit_key: r
            for r in await conn.execute(
                sa.select(
                    e.c.unit_key,
                    e.c.route_status,
                    e.c.routed_at,
                    e.c.tasks_created,
                    e.c.tasks_existing,
                    e.c.route_detail,
                    e.c.received_at,
                )
            )
        }
        inputs = (
            await conn.execute(
                sa.select(t.c.dedupe_key, ti.c.input_dataset_uuid, ti.c.input_partition_key)
                .join(t, t.c.id == ti.c.task_id)
                .where(t.c.job_id == pp)
            )
        ).all()
        versions = set((await conn.execute(sa.select(ti.c.input_version))).scalars())
    # the task that existed before routing has no inputs row: routing did not make it
    assert sorted(inputs) == sorted(
        (key, blocks, unit.split(":", 1)[1] if unit.startswith("partition:") else unit)
        for key, unit in zip(keys[1:], units[1:], strict=True)
    )
    assert versions == {stored[u].received_at for u in units}
    assert stored["partition:0-9"].route_detail == {
        "per_partition": "existing",
        "per_update": "created",
    }
    assert (stored["partition:0-9"].tasks_created, stored["partition:0-9"].tasks_existing) == (1, 1)
    for unit in units[1:]:
        assert stored[unit].route_detail == {"per_partition": "created", "per_update": "created"}
        assert (stored[unit].tasks_created, stored[unit].tasks_existing) == (2, 0)
    assert {(r.route_status, r.routed_at) for r in stored.values()} == {("routed", clock.now())}

    # every created task got its wake-up
    o = schema.outbox
    async with repo.read() as tx:
        payloads = (
            await tx.connection.execute(sa.select(o.c.payload).where(o.c.kind == "enqueue_task"))
        ).scalars()
        woken = {task_id for p in payloads for task_id in p["task_ids"]}
    made = [r.id for job in ("per_partition", "per_update") for r in await world.tasks_of(job)]
    assert {str(i) for i in made} <= woken
    if repo.engine_name == "postgres":  # routed set-based: time-ordered ids (UUIDv7)
        assert {i.version for i in made if i != held.task_id} == {7}


async def test_routing_without_wakeup_rows_writes_none(
    repo: SqlRepository, clock: ManualClock
) -> None:
    """Workers that only poll: routed tasks get no ``enqueue_task`` outbox row."""
    deployed = await deploy(repo, parse_dag(SINGLE_INPUT_DAG, file="single.yaml"), clock=clock)
    world = World(repo, clock, deployed)
    await world.start_source()
    world.router = EventRouter(
        repo, clock=clock, tasks=TaskQueue(repo, clock=clock, wakeup_outbox=False)
    )
    o = schema.outbox
    async with repo.read() as tx:
        before = (
            await tx.connection.execute(
                sa.select(sa.func.count()).where(o.c.kind == "enqueue_task")
            )
        ).scalar_one()
    await world.emit([world.partition("blocks", s, s + 9) for s in range(0, 50, 10)])
    await world.route_all()
    assert len(await world.tasks_of("per_partition")) == 5
    async with repo.read() as tx:
        after = (
            await tx.connection.execute(
                sa.select(sa.func.count()).where(o.c.kind == "enqueue_task")
            )
        ).scalar_one()
    assert after == before  # the source's run task was woken before; routing woke none


# --- lock order between accepting and routing (Postgres row locks) ---------------


@asynccontextmanager
async def _holding(repo: SqlRepository, event_id: uuid.UUID) -> AsyncIterator[SqlTransaction]:
    """A transaction holding ``event_id``'s row lock, as an accept or a routing does."""
    e = schema.events
    async with repo.transaction() as tx:
        await tx.connection.execute(sa.select(e.c.id).where(e.c.id == event_id).with_for_update())
        yield tx


async def _lock_nowait(tx: SqlTransaction, event_id: uuid.UUID) -> None:
    """Take ``event_id``'s row lock at once; raises if another transaction holds it."""
    e = schema.events
    query = sa.select(e.c.id).where(e.c.id == event_id).with_for_update(nowait=True)
    await tx.connection.execute(query)


def _in_key_order(world: World) -> tuple[DatasetEvent, DatasetEvent]:
    a, b = world.partition("blocks", 0, 99), world.partition("blocks", 100, 199)
    first, second = sorted([a, b], key=lambda ev: (ev.dataset_version, ev.unit_key))
    return first, second


async def test_a_redelivery_of_an_event_being_routed_does_not_wait(
    world: World, repo: SqlRepository
) -> None:
    """An accept counts the redeliveries no one holds at once and leaves the
    count of an event being routed (its row lock held) to the router: the
    request does not wait for that routing, and no count is lost."""
    if repo.engine_name != "postgres":
        pytest.skip("row locks: SQLite has one writer at a time")
    first, second = _in_key_order(world)
    first_id, second_id = await world.emit([first, second])
    await world.route_all()
    e = schema.events

    async def deliveries() -> dict[uuid.UUID, int]:
        async with repo.read() as tx:
            rows = await tx.connection.execute(sa.select(e.c.id, e.c.deliveries))
            return {row.id: row.deliveries for row in rows}

    async with _holding(repo, first_id):  # as a routing of the first event would
        with anyio.fail_after(20):  # waiting for the holder would never end
            assert await world.emit([second, first, first]) == [second_id, first_id, first_id]
        assert await deliveries() == {first_id: 1, second_id: 2}
    await world.route_all()  # applies the count left for the first event
    assert await deliveries() == {first_id: 3, second_id: 2}
    assert len(await world.tasks_of("per_update")) == 2  # redeliveries create nothing


async def test_routing_locks_its_events_in_the_accept_order(
    world: World, repo: SqlRepository
) -> None:
    """A routing blocked on the first event (an accept holds it) holds no lock
    on the second: the accept can go on to lock it, as its key order says."""
    if repo.engine_name != "postgres":
        pytest.skip("row locks: SQLite has one writer at a time")
    first, second = _in_key_order(world)
    second_id, first_id = await world.emit([second, first])
    async with anyio.create_task_group() as tg, _holding(repo, first_id) as accept:
        tg.start_soon(world.route_all)
        await wait_for_lock_waiter(repo)
        await _lock_nowait(accept, second_id)
    assert len(await world.tasks_of("per_update")) == 2
