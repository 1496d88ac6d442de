"""The events area of the port (``tx.events``), on both engines.

Each test states one guarantee of :class:`trace_core.storage.ports.EventOps`
as its docstring says it. The end-to-end behaviour (accepting, fencing,
routing) is in test_routing.py and the API tests.
"""

from __future__ import annotations

import uuid
from typing import Any

import anyio
import pytest
import sqlalchemy as sa

from tests.event_fixtures import World, make_world, wait_for_lock_waiter
from trace_core.clock import ManualClock
from trace_core.storage import schema
from trace_core.storage.ports import NewEvent, ProducerAttempt, ProgressFold, VersionProgress
from trace_core.storage.ports.events import RouteRows
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio


@pytest.fixture
async def world(repo: SqlRepository, clock: ManualClock) -> World:
    return await make_world(repo, clock)


def event(w: World, unit: str, copies: int = 1, version: str = "a1") -> NewEvent:
    return NewEvent(
        w.dataset, w.versions[version], f"cursor:{unit}", unit, None, None, None, copies
    )


async def stored(repo: SqlRepository, event_id: uuid.UUID) -> dict[str, Any]:
    e = schema.events
    async with repo.read() as tx:
        row = (await tx.connection.execute(sa.select(e).where(e.c.id == event_id))).one()
    return dict(row._mapping)


async def test_the_producer_attempt_its_status_test_and_its_jobs_outputs(
    repo: SqlRepository, clock: ManualClock, world: World
) -> None:
    async with repo.transaction() as tx:
        [task] = await tx.create_tasks([NewTask(world.jobs["make"])], now=clock.now())
        assert await tx.events.lock_producer_attempt(uuid.uuid4()) is None
        queued = await tx.events.lock_producer_attempt(task.task_id)
        t = schema.tasks
        await tx.connection.execute(
            sa.update(t).where(t.c.id == task.task_id).values(status="Running", attempt=2)
        )
        running = await tx.events.lock_producer_attempt(task.task_id)
    assert queued == ProducerAttempt("Queued", 1, False, (world.dataset,))
    assert running == ProducerAttempt("Running", 2, True, (world.dataset,))


async def test_the_producer_row_stays_locked_until_the_transaction_ends(
    repo: SqlRepository, clock: ManualClock, world: World, engine: str
) -> None:
    if engine != "postgres":
        pytest.skip("SQLite serializes write transactions: there is no row lock to hold")
    async with repo.transaction() as tx:
        [task] = await tx.create_tasks([NewTask(world.jobs["make"])], now=clock.now())
    t = schema.tasks
    claim = sa.select(t.c.id).where(t.c.id == task.task_id).with_for_update(nowait=True)
    async with repo.transaction() as holder:
        await holder.events.lock_producer_attempt(task.task_id)
        with pytest.raises(Exception, match="lock"):
            async with repo.transaction() as other:
                await other.connection.execute(claim)
    async with repo.transaction() as other:  # released with the transaction
        assert (await other.connection.execute(claim)).scalar_one() == task.task_id


async def test_the_dataset_of_each_known_version(repo: SqlRepository, world: World) -> None:
    unknown = uuid.uuid4()
    async with repo.read() as tx:
        found = await tx.events.datasets_of_versions([world.versions["a1"], unknown])
        empty = await tx.events.datasets_of_versions([])
    assert found == {world.versions["a1"]: world.dataset}
    assert empty == {}


async def test_the_producer_and_the_datasets_of_versions_together(
    repo: SqlRepository, clock: ManualClock, world: World
) -> None:
    """The same answers as the two operations apart (one round trip on Postgres)."""
    a1, unknown = world.versions["a1"], uuid.uuid4()
    async with repo.transaction() as tx:
        [task] = await tx.create_tasks([NewTask(world.jobs["make"])], now=clock.now())
        both = await tx.events.lock_producer_and_versions(task.task_id, [a1, unknown])
        apart = (
            await tx.events.lock_producer_attempt(task.task_id),
            await tx.events.datasets_of_versions([a1, unknown]),
        )
        no_versions = await tx.events.lock_producer_and_versions(task.task_id, [])
        no_task = await tx.events.lock_producer_and_versions(uuid.uuid4(), [a1])
    assert (
        both
        == apart
        == (ProducerAttempt("Queued", 1, False, (world.dataset,)), {a1: world.dataset})
    )
    assert no_versions == (both[0], {})
    assert no_task[0] is None


async def test_new_events_are_stored_pending_with_their_copies_and_origin(
    repo: SqlRepository, clock: ManualClock, world: World
) -> None:
    async with repo.transaction() as tx:
        [task] = await tx.create_tasks([NewTask(world.jobs["make"])], now=clock.now())
        manual = await tx.events.store_events([event(world, "1")], producer=None, now=clock.now())
        by_task = await tx.events.store_events(
            [event(world, "2", copies=3), event(world, "3")],
            producer=(task.task_id, 1),
            now=clock.now(),
        )
        empty = await tx.events.store_events([], producer=None, now=clock.now())
    one = manual.ids[(world.versions["a1"], "cursor:1")]
    two = by_task.ids[(world.versions["a1"], "cursor:2")]
    three = by_task.ids[(world.versions["a1"], "cursor:3")]
    assert manual.fresh == {one} and manual.later == {}
    assert by_task.fresh == {two, three} and by_task.later == {}
    assert two < three  # time-ordered ids, in the order given
    assert empty.ids == {} and empty.fresh == set()
    row = await stored(repo, one)
    assert (row["origin"], row["producer_task_id"], row["deliveries"]) == ("manual", None, 1)
    assert (row["route_status"], row["received_at"]) == ("pending", clock.now())
    row = await stored(repo, two)
    assert (row["origin"], row["producer_task_id"], row["producer_attempt"]) == (
        "task",
        task.task_id,
        1,
    )
    assert (row["deliveries"], row["cursor"], row["unit_key"]) == (3, "2", "cursor:2")


async def test_each_column_of_a_mixed_request_is_stored_as_given(
    repo: SqlRepository, clock: ManualClock, world: World
) -> None:
    """Ranges, partitions without a range, cursors, two versions and keys that
    need quoting (the Postgres insert sends the request as columns)."""
    a1, a2 = world.versions["a1"], world.versions["a2"]
    events = [
        NewEvent(world.dataset, a1, "partition:0-99", None, "0-99", 0, 99, 1),
        NewEvent(world.dataset, a1, 'partition:é"{,}\\', None, 'é"{,}\\', None, None, 2),
        NewEvent(world.dataset, a2, "cursor:7", "7", None, None, None, 1),
        NewEvent(world.dataset, a2, "partition:-5-9007199254740993", None, "x", -5, 2**53 + 1, 1),
    ]
    async with repo.transaction() as tx:
        done = await tx.events.store_events(events, producer=None, now=clock.now())
    assert set(done.ids) == {(e.dataset_version, e.unit_key) for e in events}
    assert done.fresh == set(done.ids.values())
    for e in events:
        row = await stored(repo, done.ids[(e.dataset_version, e.unit_key)])
        assert (
            row["dataset_uuid"],
            row["dataset_version"],
            row["unit_key"],
            row["cursor"],
            row["partition_key"],
            row["range_start"],
            row["range_end"],
            row["deliveries"],
        ) == (
            e.dataset_uuid,
            e.dataset_version,
            e.unit_key,
            e.cursor,
            e.partition_key,
            e.start,
            e.end,
            e.copies,
        )


async def test_a_redelivery_only_counts(
    repo: SqlRepository, clock: ManualClock, world: World
) -> None:
    async with repo.transaction() as tx:
        first = await tx.events.store_events([event(world, "1")], producer=None, now=clock.now())
    received = clock.now()
    clock.advance(5)
    async with repo.transaction() as tx:
        again = await tx.events.store_events(
            [event(world, "1", copies=2), event(world, "1", version="a2")],
            producer=None,
            now=clock.now(),
        )
    key = (world.versions["a1"], "cursor:1")
    assert again.ids[key] == first.ids[key]
    assert first.ids[key] not in again.fresh
    assert again.fresh == {again.ids[(world.versions["a2"], "cursor:1")]}  # another version
    row = await stored(repo, first.ids[key])
    assert (row["deliveries"], row["received_at"]) == (3, received)
    assert row["last_received_at"] == clock.now()


async def test_a_redelivery_of_a_held_event_is_left_for_later_on_postgres(
    repo: SqlRepository, clock: ManualClock, world: World, engine: str
) -> None:
    if engine != "postgres":
        pytest.skip("SQLite serializes write transactions: no row is ever held by another")
    async with repo.transaction() as tx:
        first = await tx.events.store_events([event(world, "1")], producer=None, now=clock.now())
    key = (world.versions["a1"], "cursor:1")
    event_id = first.ids[key]
    async with repo.transaction() as router:
        await router.routing.lock_pending_events([event_id])
        async with repo.transaction() as tx:  # does not wait for the router
            again = await tx.events.store_events(
                [event(world, "1", copies=2)], producer=None, now=clock.now()
            )
    assert again.ids == {key: event_id}
    assert again.later == {event_id: 2}
    assert (await stored(repo, event_id))["deliveries"] == 1  # not counted yet


async def test_deferred_deliveries_add_up_and_keep_the_latest_time(
    repo: SqlRepository, clock: ManualClock, world: World
) -> None:
    async with repo.transaction() as tx:
        first = await tx.events.store_events(
            [event(world, "1"), event(world, "2")], producer=None, now=clock.now()
        )
    one, two = (first.ids[(world.versions["a1"], f"cursor:{n}")] for n in (1, 2))
    older = clock.now()
    received = clock.advance(10)
    async with repo.transaction() as tx:
        await tx.events.apply_deferred_deliveries({one: 2, uuid.uuid4(): 5}, at=received)
        await tx.events.apply_deferred_deliveries({one: 1}, at=older)  # an older count
        await tx.events.apply_deferred_deliveries({}, at=clock.now())
    row = await stored(repo, one)
    assert (row["deliveries"], row["last_received_at"]) == (4, received)
    assert (await stored(repo, two))["deliveries"] == 1  # left alone


async def test_progress_is_created_then_merged(
    repo: SqlRepository, clock: ManualClock, world: World
) -> None:
    a1, a2 = world.versions["a1"], world.versions["a2"]
    async with repo.transaction() as tx:
        await tx.events.advance_progress(
            [
                ProgressFold(a1, world.dataset, [(0, 9), (20, 29)], None, 2),
                ProgressFold(a2, world.dataset, [], 7, 1),
            ],
            now=clock.now(),
        )
        await tx.events.advance_progress(
            [ProgressFold(a1, world.dataset, [(10, 19), (40, 49)], 3, 2)], now=clock.now()
        )
        await tx.events.advance_progress(
            [ProgressFold(a2, world.dataset, [], 5, 1)], now=clock.now()
        )
        await tx.events.advance_progress([], now=clock.now())
    async with repo.read() as tx:
        progress = await tx.registry.dataset_version_progress([a1, a2])
        p = schema.dataset_version_progress
        counts = dict(
            (await tx.connection.execute(sa.select(p.c.dataset_version, p.c.events))).all()
        )
    assert progress == {
        a1: VersionProgress(((0, 29), (40, 49)), 3),  # touching ranges joined
        a2: VersionProgress((), 7),  # the higher cursor stays
    }
    assert counts == {a1: 4, a2: 2}


# --- accepting in one statement (Postgres) -------------------------------------

ROWS = RouteRows(
    kind="route_event",
    ids_key="event_ids",
    chunk=2,
    deferred_key="redeliveries",
    at="2026-01-01T00:00:00+00:00",
    channel="trace_outbox",
    max_attempts=10,
)


def ranged(w: World, start: int, copies: int = 1, position: int = 0) -> NewEvent:
    key = f"{start}-{start + 9}"
    return NewEvent(
        w.dataset,
        w.versions["a1"],
        f"partition:{key}",
        None,
        key,
        start,
        start + 9,
        copies,
        position=position,
    )


async def outbox_payloads(repo: SqlRepository) -> list[dict[str, Any]]:
    o = schema.outbox
    async with repo.read() as tx:
        rows = await tx.connection.execute(sa.select(o.c.kind, o.c.payload).order_by(o.c.id))
        return [{"kind": kind, **payload} for kind, payload in rows]


async def test_one_statement_stores_counts_folds_and_writes_the_route_rows(
    repo: SqlRepository, clock: ManualClock, world: World, engine: str
) -> None:
    """The rows of store_events + advance_progress + the outbox rows, at once;
    SQLite has no such statement (its acceptance takes the generic path)."""
    if engine != "postgres":
        async with repo.transaction() as tx:
            assert tx.events.accepts_in_one_statement is False
            with pytest.raises(NotImplementedError):
                await tx.events.accept_in_one_statement(
                    [ranged(world, 0)], producer=None, now=clock.now(), rows=ROWS
                )
        return
    async with repo.transaction() as tx:
        before = await tx.events.store_events([ranged(world, 0)], producer=None, now=clock.now())
        await tx.events.advance_progress(
            [ProgressFold(world.versions["a1"], world.dataset, [(0, 9)], 4, 1)], now=clock.now()
        )
    a1, a2 = world.versions["a1"], world.versions["a2"]
    events = [  # key order; positions say where each stood in the request
        ranged(world, 0, copies=2, position=3),  # stored before: counted
        ranged(world, 10, position=2),
        ranged(world, 30, copies=2, position=0),
        ranged(world, 50, position=1),
        NewEvent(world.dataset, a2, "cursor:9", "9", None, None, None, 1, 4, int_cursor=9),
    ]
    async with repo.transaction() as tx:
        done = await tx.events.accept_in_one_statement(
            events, producer=None, now=clock.now(), rows=ROWS
        )
        assert "trace_outbox" in tx.channels & tx.notified  # notified by the statement
    old = before.ids[(a1, "partition:0-9")]
    new = {e.unit_key: done.ids[(e.dataset_version, e.unit_key)] for e in events}
    assert new["partition:0-9"] == old and done.later == {}
    assert done.fresh == set(new.values()) - {old}
    assert (await stored(repo, old))["deliveries"] == 3
    assert (await stored(repo, new["partition:30-39"]))["deliveries"] == 2
    async with repo.read() as tx:
        progress = await tx.registry.dataset_version_progress([a1, a2])
    assert progress == {
        a1: VersionProgress(((0, 19), (30, 39), (50, 59)), 4),
        a2: VersionProgress((), 9),
    }
    in_order = [
        new[k] for k in ("partition:30-39", "partition:50-59", "partition:10-19", "cursor:9")
    ]
    assert await outbox_payloads(repo) == [
        {"kind": "route_event", "event_ids": [str(i) for i in in_order[:2]]},
        {"kind": "route_event", "event_ids": [str(i) for i in in_order[2:]]},
    ]


async def test_one_statement_leaves_a_held_redelivery_in_its_deferred_row(
    repo: SqlRepository, clock: ManualClock, world: World, engine: str
) -> None:
    if engine != "postgres":
        pytest.skip("SQLite has no one-statement acceptance (and no row is ever held)")
    async with repo.transaction() as tx:
        first = await tx.events.store_events([ranged(world, 0)], producer=None, now=clock.now())
    event_id = first.ids[(world.versions["a1"], "partition:0-9")]
    async with repo.transaction() as router:
        await router.routing.lock_pending_events([event_id])
        async with repo.transaction() as tx:  # does not wait for the router
            done = await tx.events.accept_in_one_statement(
                [ranged(world, 0, copies=2)], producer=None, now=clock.now(), rows=ROWS
            )
    assert done.ids == {(world.versions["a1"], "partition:0-9"): event_id}
    assert done.fresh == set() and done.later == {}  # the statement wrote the row itself
    assert (await stored(repo, event_id))["deliveries"] == 1
    assert await outbox_payloads(repo) == [
        {"kind": "route_event", "redeliveries": [[str(event_id), 2]], "at": ROWS.at}
    ]


async def test_a_unit_stored_while_the_statement_ran_is_counted_after_it(
    repo: SqlRepository, clock: ManualClock, world: World, engine: str
) -> None:
    """The statement sees the rows committed before it began: a unit another
    acceptance commits while the statement waits for it is counted after."""
    if engine != "postgres":
        pytest.skip("SQLite serializes write transactions: no acceptance runs meanwhile")
    key = (world.versions["a1"], "partition:0-9")
    result: dict[str, Any] = {}
    inserted, release = anyio.Event(), anyio.Event()

    async def other() -> None:
        async with repo.transaction() as tx:
            result["first"] = await tx.events.store_events(
                [ranged(world, 0)], producer=None, now=clock.now()
            )
            inserted.set()
            await release.wait()  # commits when released

    async def accept() -> None:
        async with repo.transaction() as tx:
            result["done"] = await tx.events.accept_in_one_statement(
                [ranged(world, 0, copies=2), ranged(world, 10)],
                producer=None,
                now=clock.now(),
                rows=ROWS,
            )

    async with anyio.create_task_group() as tg:
        tg.start_soon(other)
        await inserted.wait()
        tg.start_soon(accept)
        await wait_for_lock_waiter(repo)  # the statement waits for the other insert of 0-9
        release.set()  # the unit is stored, after the statement began
    first = result["first"]
    done = result["done"]
    assert done.ids[key] == first.ids[key] and first.ids[key] not in done.fresh
    assert len(done.fresh) == 1 and done.later == {}
    assert (await stored(repo, first.ids[key]))["deliveries"] == 3  # 1 + 2, none lost
