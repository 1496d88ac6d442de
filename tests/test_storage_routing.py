"""The routing area of the port (``tx.routing``), on both engines.

Each test states one guarantee of :class:`trace_core.storage.ports.RoutingOps`
as its docstring says it. The router's decisions are in test_routing.py.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

import pytest
import sqlalchemy as sa

from tests.event_fixtures import World, make_world
from trace_core.clock import ManualClock
from trace_core.storage import schema
from trace_core.storage.ports import (
    LockedRoute,
    NewEvent,
    RouteOutcome,
    SetRoute,
    SingleInputJob,
    StoredEvent,
    TaskInput,
)
from trace_core.storage.protocol import NewTask, TaskWakeup
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio


@pytest.fixture
async def world(repo: SqlRepository, clock: ManualClock) -> World:
    return await make_world(repo, clock)


async def store(
    repo: SqlRepository, clock: ManualClock, w: World, *units: str, version: str = "a1"
) -> list[uuid.UUID]:
    """Store one cursor event per unit, each received a second after the last."""
    ids = []
    for unit in units:
        async with repo.transaction() as tx:
            new = NewEvent(
                w.dataset, w.versions[version], f"cursor:{unit}", unit, None, None, None, 1
            )
            done = await tx.events.store_events([new], producer=None, now=clock.now())
        ids.append(done.ids[(w.versions[version], f"cursor:{unit}")])
        clock.advance(1)
    return ids


async def event_row(repo: SqlRepository, event_id: uuid.UUID) -> dict[str, Any]:
    e = schema.events
    async with repo.read() as tx:
        row = (await tx.connection.execute(sa.select(e).where(e.c.id == event_id))).one()
    return dict(row._mapping)


async def test_a_repeated_id_finds_its_pending_event_once(
    repo: SqlRepository, clock: ManualClock, world: World
) -> None:
    first, second = await store(repo, clock, world, "1", "2")
    async with repo.transaction() as tx:
        found = await tx.routing.lock_pending_events([second, first, second, first, first])
    assert [e.id for e in found] == [first, second]


async def test_pending_events_oldest_first(
    repo: SqlRepository, clock: ManualClock, world: World
) -> None:
    first, second, routed = await store(repo, clock, world, "1", "2", "3")
    async with repo.transaction() as tx:
        await tx.routing.store_route_outcomes(
            [RouteOutcome(routed, "routed", clock.now(), 0, 0, None)]
        )
        found = await tx.routing.lock_pending_events([routed, second, uuid.uuid4(), first])
        empty = await tx.routing.lock_pending_events([])
    assert [e.id for e in found] == [first, second]
    assert found[0] == StoredEvent(
        first,
        world.dataset,
        world.versions["a1"],
        "cursor:1",
        "1",
        None,
        None,
        None,
        found[0].received_at,
    )
    assert found[0].received_at < found[1].received_at
    assert empty == []


async def test_pending_events_stay_locked_until_the_transaction_ends(
    repo: SqlRepository, clock: ManualClock, world: World, engine: str
) -> None:
    if engine != "postgres":
        pytest.skip("SQLite serializes write transactions: there is no row lock to hold")
    (event_id,) = await store(repo, clock, world, "1")
    e = schema.events
    grab = sa.select(e.c.id).where(e.c.id == event_id).with_for_update(nowait=True)
    async with repo.transaction() as router:
        await router.routing.lock_pending_events([event_id])
        with pytest.raises(Exception, match="lock"):
            async with repo.transaction() as other:
                await other.connection.execute(grab)
    async with repo.transaction() as other:
        assert (await other.connection.execute(grab)).scalar_one() == event_id


async def test_history_in_receipt_order_after_a_mark(
    repo: SqlRepository, clock: ManualClock, world: World
) -> None:
    a, b, c = await store(repo, clock, world, "1", "2", "3")
    (other,) = await store(repo, clock, world, "1", version="a2")
    async with repo.transaction() as tx:  # any status
        await tx.routing.store_route_outcomes([RouteOutcome(b, "routed", clock.now(), 0, 0, None)])
    async with repo.read() as tx:
        everything = await tx.routing.event_history([world.versions["a1"]], after=None, limit=10)
        page = await tx.routing.event_history([world.versions["a1"]], after=None, limit=2)
        mark = (page[-1].received_at, page[-1].id)
        rest = await tx.routing.event_history([world.versions["a1"]], after=mark, limit=10)
        none = await tx.routing.event_history([], after=None, limit=10)
    assert [e.id for e in everything] == [a, b, c]  # a2's event left out
    assert other not in {e.id for e in everything}
    assert [e.id for e in page] == [a, b]
    assert [e.id for e in rest] == [c]
    assert none == []


async def test_task_inputs_are_inserted_once(
    repo: SqlRepository, clock: ManualClock, world: World
) -> None:
    ti = schema.task_inputs
    at = clock.now()
    async with repo.transaction() as tx:
        [task] = await tx.create_tasks([NewTask(world.jobs["read"])], now=at)
        row = TaskInput(task.task_id, world.dataset, "cursor:1", at)
        await tx.routing.insert_task_inputs_if_absent([row])
        later = TaskInput(task.task_id, world.dataset, "cursor:1", clock.advance(5))
        await tx.routing.insert_task_inputs_if_absent(
            [later, TaskInput(task.task_id, world.dataset, "p7", at)]
        )
        await tx.routing.insert_task_inputs_if_absent([])
        rows = (
            await tx.connection.execute(
                sa.select(ti.c.input_partition_key, ti.c.input_version).order_by(
                    ti.c.input_partition_key
                )
            )
        ).all()
    assert [tuple(r) for r in rows] == [("cursor:1", at), ("p7", at)]  # the first one kept


async def test_route_outcomes_replace_the_status_and_add_the_counts(
    repo: SqlRepository, clock: ManualClock, world: World
) -> None:
    one, two = await store(repo, clock, world, "1", "2")
    routed_at = clock.now()
    async with repo.transaction() as tx:
        await tx.routing.store_route_outcomes(
            [RouteOutcome(one, "pending", None, 1, 0, {"read": "paused"})]
        )
        await tx.routing.store_route_outcomes(
            [RouteOutcome(one, "routed", routed_at, 2, 1, {"read": "created"})]
        )
        await tx.routing.store_route_outcomes([])
    row = await event_row(repo, one)
    assert (row["route_status"], row["routed_at"]) == ("routed", routed_at)
    assert (row["tasks_created"], row["tasks_existing"]) == (3, 1)
    assert row["route_detail"] == {"read": "created"}
    untouched = await event_row(repo, two)
    assert (untouched["route_status"], untouched["tasks_created"]) == ("pending", 0)


def reader_job(world: World, now: datetime) -> SingleInputJob:
    """The world's single-input reader of version a1, as set-based routing takes it."""
    return SingleInputJob(
        world.jobs["read"],
        "read",
        world.versions["a1"],
        {"dataset_uuid": str(world.dataset), "dataset_version": str(world.versions["a1"])}
        | {"where": None},
        3,
        now,
    )


async def test_single_input_events_are_routed_set_based(
    repo: SqlRepository, clock: ManualClock, world: World
) -> None:
    """One statement on Postgres, a few in the transaction on SQLite: same rows."""
    one, two = await store(repo, clock, world, "1", "2")
    now = clock.now()
    job = reader_job(world, now)
    wakeup = TaskWakeup("enqueue_task", ("tasks",))
    async with repo.transaction() as tx:
        assert tx.routing.routes_in_one_statement
        done = await tx.routing.route_single_input_events(
            [one, two], [two], [job], now=now, wakeup=wakeup
        )
        again = await tx.routing.route_single_input_events([one], [], [job], now=now, wakeup=wakeup)
    assert done == SetRoute(created=2, decisions=2)
    assert again == SetRoute(created=0, decisions=1)  # the task exists: nothing new
    t, ti, o = schema.tasks, schema.task_inputs, schema.outbox
    async with repo.read() as tx:
        tasks = (
            await tx.connection.execute(
                sa.select(t.c.dedupe_key, t.c.status, t.c.input_versions, t.c.max_attempts)
                .where(t.c.job_id == world.jobs["read"])
                .order_by(t.c.dedupe_key)
            )
        ).all()
        inputs = (await tx.connection.execute(sa.select(sa.func.count()).select_from(ti))).scalar()
        wakes = (
            await tx.connection.execute(sa.select(o.c.payload).where(o.c.kind == "enqueue_task"))
        ).all()
    key = f"cursor:{world.dataset}:{world.versions['a1']}:1"
    assert [r[0] for r in tasks] == [key, key[:-1] + "2"]
    assert tasks[0][1:] == (
        "Queued",
        {"inputs": [dict(job.pinned) | {"cursor": "1"}], "trigger_event_id": str(one)},
        3,
    )
    assert inputs == 2
    assert [len(w[0]["task_ids"]) for w in wakes] == [2]
    first, second = await event_row(repo, one), await event_row(repo, two)
    assert (first["route_status"], first["tasks_created"], first["tasks_existing"]) == (
        "routed",
        1,
        1,
    )
    assert second["route_status"] == "not_current"
    # made by the first statement, which made all it decided: the version's one detail
    assert (second["tasks_created"], second["tasks_existing"]) == (1, 0)
    assert second["route_detail"] == {"read": "created"}
    assert first["route_detail"] == {"read": "existing"}
    assert isinstance(first["routed_at"], datetime)


async def test_set_based_routing_builds_range_units_merges_edges_and_chunks_wakeups(
    repo: SqlRepository, clock: ManualClock, world: World
) -> None:
    """Range partitions carry start and end; an edge naming a unit member is
    replaced by the unit's (``{**pinned, **unit}``); wake-ups hold ``chunk``
    ids each, in id order; an event no job pins is routed with no detail."""
    async with repo.transaction() as tx:
        units = [
            NewEvent(world.dataset, world.versions["a1"], f"partition:{k}", None, k, s, s + 9, 1)
            for k, s in (("0-9", 0), ("10-19", 10), ("20-29", 20))
        ]
        other = NewEvent(world.dataset, world.versions["a2"], "cursor:9", "9", None, None, None, 1)
        done = await tx.events.store_events([*units, other], producer=None, now=clock.now())
    ids = [done.ids[(world.versions["a1"], u.unit_key)] for u in units]
    unpinned = done.ids[(world.versions["a2"], "cursor:9")]
    now = clock.now()
    edge = {"dataset_uuid": str(world.dataset), "start": -1, "where": "x > 1"}
    job = SingleInputJob(world.jobs["read"], "read", world.versions["a1"], edge, 2, now)
    async with repo.transaction() as tx:
        routed = await tx.routing.route_single_input_events(
            [*ids, unpinned], [], [job], now=now, wakeup=TaskWakeup("enqueue_task", (), chunk=2)
        )
    assert routed == SetRoute(created=3, decisions=3)
    t, o = schema.tasks, schema.outbox
    async with repo.read() as tx:
        tasks = (
            await tx.connection.execute(
                sa.select(t.c.id, t.c.partitions, t.c.input_versions)
                .where(t.c.job_id == world.jobs["read"])
                .order_by(t.c.id)
            )
        ).all()
        wakes = (
            await tx.connection.execute(
                sa.select(o.c.payload).where(o.c.kind == "enqueue_task").order_by(o.c.id)
            )
        ).all()
    by_partition = {r.partitions[0]: r.input_versions for r in tasks}
    assert by_partition["10-19"] == {
        "inputs": [edge | {"partition_key": "10-19", "start": 10, "end": 19}],
        "trigger_event_id": str(ids[1]),
    }
    assert [w.payload["task_ids"] for w in wakes] == [
        [str(tasks[0].id), str(tasks[1].id)],
        [str(tasks[2].id)],
    ]
    skipped = await event_row(repo, unpinned)
    assert (skipped["route_status"], skipped["tasks_created"], skipped["route_detail"]) == (
        "routed",
        0,
        None,
    )


async def test_set_based_routing_notifies_in_its_statement_and_wakes_other_processes(
    repo: SqlRepository, clock: ManualClock, world: World, engine: str, database_url: str
) -> None:
    """The statement notifies the wake-up channel itself (no pg_notify trip at
    commit); another process's listener and this one's are woken at commit."""
    if engine != "postgres":
        pytest.skip("set-based routing and LISTEN/NOTIFY are Postgres's")
    (one,) = await store(repo, clock, world, "1")
    other = SqlRepository(database_url)
    try:
        remote = await other.subscribe("tasks")
        local = repo.hub.subscribe("tasks")
        async with repo.transaction() as tx:
            done = await tx.routing.route_single_input_events(
                [one],
                [],
                [reader_job(world, clock.now())],
                now=clock.now(),
                wakeup=TaskWakeup("enqueue_task", ("tasks",)),
            )
            assert tx.notified == {"tasks"}  # nothing left to notify at commit
        assert done == SetRoute(created=1, decisions=1)
        assert await remote.wait(20)
        assert await local.wait(0)
    finally:
        await other.close()


async def test_lock_and_route_routes_the_pending_events_only_and_holds_their_locks(
    repo: SqlRepository, clock: ManualClock, world: World, engine: str
) -> None:
    """One statement locks the events among the ids (each once), routes the
    pending ones (unknown and routed ones left out), and holds the row locks
    until the transaction ends; versions outside the live ones become
    not_current."""
    one, two, routed = await store(repo, clock, world, "1", "2", "3")
    (old,) = await store(repo, clock, world, "1", version="a2")
    wakeup = TaskWakeup("enqueue_task", ("tasks",))
    job = reader_job(world, clock.now())
    if engine != "postgres":
        async with repo.transaction() as tx:
            assert not tx.routing.locks_and_routes_in_one_statement
            with pytest.raises(NotImplementedError):
                await tx.routing.lock_and_route_single_input_events(
                    [one], [world.versions["a1"]], [job], now=clock.now(), wakeup=wakeup
                )
        return
    async with repo.transaction() as tx:
        await tx.routing.store_route_outcomes(
            [RouteOutcome(routed, "routed", clock.now(), 0, 0, None)]
        )
    e = schema.events
    grab = sa.select(e.c.id).where(e.c.id == one).with_for_update(nowait=True)
    async with repo.transaction() as router:
        done = await router.routing.lock_and_route_single_input_events(
            [two, one, routed, uuid.uuid4(), one, old],
            [world.versions["a1"]],
            [job],
            now=clock.now(),
            wakeup=wakeup,
        )
        with pytest.raises(Exception, match="lock"):
            async with repo.transaction() as other:
                await other.connection.execute(grab)
        again = await router.routing.lock_and_route_single_input_events(
            [one, two], [world.versions["a1"]], [job], now=clock.now(), wakeup=wakeup
        )
    # one and two made a task each for the reader of a1; old (a2, not live) none
    assert done == LockedRoute(created=2, decisions=2, events=3, not_current=1)
    assert again == LockedRoute(created=0, decisions=0, events=0, not_current=0)
    rows = {i: await event_row(repo, i) for i in (one, two, old, routed)}
    assert [rows[i]["route_status"] for i in (one, two, old)] == ["routed", "routed", "not_current"]
    assert rows[one]["route_detail"] == {"read": "created"}
    assert (rows[old]["tasks_created"], rows[old]["route_detail"]) == (0, None)
    assert (rows[routed]["tasks_created"], rows[routed]["route_detail"]) == (0, None)
    async with repo.transaction() as other:
        assert (await other.connection.execute(grab)).scalar_one() == one
