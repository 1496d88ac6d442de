"""The deploy area of the port (``tx.deploy``), on both engines.

Each test states one guarantee of :class:`trace_core.storage.ports.DeployOps`
as its docstring says it, through the SQL implementation of the engine. The
end-to-end behaviour (deploy, promotion, rollback) is in test_dag_deploy.py.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
import sqlalchemy as sa

from trace_core.clock import ManualClock
from trace_core.errors import DuplicateItem
from trace_core.storage.ports import (
    DagVersionRef,
    DagVersionRow,
    JobOutputs,
    JobRecord,
    NewDagVersion,
    NewDataset,
    NewDatasetVersion,
)
from trace_core.storage.sql import SqlRepository
from trace_core.storage.sql_deploy import dag_lock_key

pytestmark = pytest.mark.anyio


@dataclass
class World:
    """An org with datasets ``a`` (made by DAG ``up``) and ``b`` (made by ``down``),
    each with dataset versions ``<name>1`` and ``<name>2``."""

    org_id: uuid.UUID
    datasets: dict[str, uuid.UUID] = field(default_factory=dict)
    versions: dict[str, uuid.UUID] = field(default_factory=dict)


@pytest.fixture
async def world(repo: SqlRepository, clock: ManualClock) -> World:
    w = World(uuid.uuid4())
    now = clock.now()
    async with repo.transaction() as tx:
        await tx.registry.create_org_if_absent(w.org_id, "acme", now=now)
        for name, dag in (("a", "up"), ("b", "down")):
            ds = NewDataset(uuid.uuid4(), w.org_id, name, dag, "job", 0, now)
            await tx.registry.register_datasets_if_absent([ds])
            w.datasets[name] = ds.dataset_uuid
            for n in (1, 2):
                v = NewDatasetVersion(uuid.uuid4(), ds.dataset_uuid, f"h{n}", None, None, "x", now)
                await tx.registry.insert_dataset_version_if_absent(v)
                w.versions[f"{name}{n}"] = v.version_id
    return w


async def new_version(
    repo: SqlRepository, clock: ManualClock, w: World, dag: str, yaml_hash: str
) -> uuid.UUID:
    version_id = uuid.uuid4()
    async with repo.transaction() as tx:
        await tx.deploy.insert_version(
            NewDagVersion(version_id, w.org_id, dag, yaml_hash, f"dag: {dag}\n", clock.now())
        )
    clock.advance(1)
    return version_id


def job(w: World, version_id: uuid.UUID, name: str, dag: str = "down") -> JobRecord:
    return JobRecord(
        job_id=uuid.uuid4(),
        org_id=w.org_id,
        name=name,
        dag_name=dag,
        dag_version_id=version_id,
        activation="reactive",
        runtime="lambda",
        operator="op",
        config_hash="c",
        update_strategy="replace",
        input_datasets=(w.datasets["a"],),
        output_datasets=(w.datasets["b"],),
        config={"k": [1, 2], "inputs_where": {str(w.datasets["a"]): "x > 0"}},
        source={"kind": "cron", "schedule": "* * * * *"},
        bootstrap={"reset_outputs": True},
        execution_strategy="PerUpdate",
        idle_timeout="5m",
        unique_key=None,
        scaling={"max_concurrency": 2},
        timeout_seconds=60,
        heartbeat_timeout_seconds=30,
        max_attempts=4,
        backpressure={"max_queue_depth": 10},
        priority_tier="bulk",
    )


async def test_versions_are_inserted_building_and_found_by_hash_newest_first(
    repo: SqlRepository, clock: ManualClock, world: World
) -> None:
    first = await new_version(repo, clock, world, "down", "abc")
    second = await new_version(repo, clock, world, "down", "abc+1")
    await new_version(repo, clock, world, "down", "abcd")  # another hash
    await new_version(repo, clock, world, "up", "abc")  # another DAG
    async with repo.transaction() as tx:
        found = await tx.deploy.versions_with_yaml_hash(world.org_id, "down", "abc")
        assert found == [DagVersionRef(second, "building"), DagVersionRef(first, "building")]
        assert await tx.deploy.version(first) == DagVersionRow(
            first, world.org_id, "down", "building"
        )
        assert await tx.deploy.version(uuid.uuid4()) is None
    with pytest.raises(DuplicateItem):
        await new_version(repo, clock, world, "down", "abc")


async def test_status_marks_and_the_guarded_supersede(
    repo: SqlRepository, clock: ManualClock, world: World
) -> None:
    v1 = await new_version(repo, clock, world, "down", "h1")
    v2 = await new_version(repo, clock, world, "down", "h2")
    v3 = await new_version(repo, clock, world, "down", "h3")
    async with repo.transaction() as tx:
        ops = tx.deploy
        assert not await ops.mark_version_superseded_if_current(v1)  # building: unchanged
        await ops.mark_version_current(v1, now=clock.now())
        assert await ops.mark_version_superseded_if_current(v1)
        await ops.mark_versions_abandoned([v2])
        await ops.mark_versions_abandoned([])
        assert set(await ops.version_ids_with_status(world.org_id, "down", "building")) == {v3}
        assert await ops.version_ids_with_status(world.org_id, "down", "superseded") == [v1]
        assert await ops.version_ids_with_status(world.org_id, "down", "abandoned") == [v2]
        await ops.mark_version_building(v2)
        assert (await ops.version(v2)) == DagVersionRow(v2, world.org_id, "down", "building")


async def test_building_versions_of_every_dag_oldest_first(
    repo: SqlRepository, clock: ManualClock, world: World
) -> None:
    down = await new_version(repo, clock, world, "down", "h1")
    up = await new_version(repo, clock, world, "up", "h1")
    current = await new_version(repo, clock, world, "up", "h2")
    async with repo.transaction() as tx:
        await tx.deploy.mark_version_current(current, now=clock.now())
        assert await tx.deploy.building_versions() == [
            DagVersionRow(down, world.org_id, "down", "building"),
            DagVersionRow(up, world.org_id, "up", "building"),
        ]


async def test_live_dataset_versions_are_those_of_current_and_building_versions(
    repo: SqlRepository, clock: ManualClock, world: World
) -> None:
    a, b, v = world.datasets["a"], world.datasets["b"], world.versions
    current = await new_version(repo, clock, world, "up", "h1")
    building = await new_version(repo, clock, world, "up", "h2")
    async with repo.transaction() as tx:
        assert await tx.deploy.live_dataset_versions() == set()
        await tx.deploy.insert_pointers(current, {a: v["a1"], b: v["b1"]})
        await tx.deploy.insert_pointers(building, {a: v["a1"]})  # shared: counted once
        await tx.deploy.mark_version_current(current, now=clock.now())
        assert await tx.deploy.live_dataset_versions() == {v["a1"], v["b1"]}
        await tx.deploy.mark_versions_abandoned([current])
        assert await tx.deploy.live_dataset_versions() == {v["a1"]}
        await tx.deploy.mark_versions_abandoned([building])
        assert await tx.deploy.live_dataset_versions() == set()


async def test_the_latest_superseded_version_is_the_one_activated_last(
    repo: SqlRepository, clock: ManualClock, world: World
) -> None:
    created_first = await new_version(repo, clock, world, "down", "h1")
    created_next = await new_version(repo, clock, world, "down", "h2")
    abandoned = await new_version(repo, clock, world, "down", "h3")
    async with repo.transaction() as tx:
        ops = tx.deploy
        assert await ops.latest_superseded_version(world.org_id, "down") is None
        # Activation order, not creation order, decides.
        await ops.mark_version_current(created_next, now=clock.now())
        await ops.mark_version_current(created_first, now=clock.now() + timedelta(hours=1))
        for v in (created_first, created_next):
            await ops.mark_version_superseded_if_current(v)
        await ops.mark_versions_abandoned([abandoned])
        assert await ops.latest_superseded_version(world.org_id, "down") == created_first
        assert await ops.latest_superseded_version(world.org_id, "up") is None


async def test_the_current_version_pointer_is_created_then_replaced(
    repo: SqlRepository, clock: ManualClock, world: World
) -> None:
    v1 = await new_version(repo, clock, world, "down", "h1")
    v2 = await new_version(repo, clock, world, "down", "h2")
    async with repo.transaction() as tx:
        assert await tx.deploy.current_version_id(world.org_id, "down") is None
        await tx.deploy.set_current_version(world.org_id, "down", v1, now=clock.now())
        await tx.deploy.set_current_version(world.org_id, "down", v2, now=clock.now())
    async with repo.read() as tx:
        assert await tx.deploy.current_version_id(world.org_id, "down") == v2
        assert await tx.deploy.current_version_id(world.org_id, "up") is None
        # The pointer only: statuses are left as they were.
        assert (await tx.deploy.version(v2)) == DagVersionRow(v2, world.org_id, "down", "building")


async def test_pointer_sets_insert_update_and_read(
    repo: SqlRepository, clock: ManualClock, world: World
) -> None:
    a, b, vs = world.datasets["a"], world.datasets["b"], world.versions
    down = await new_version(repo, clock, world, "down", "h1")
    bare = await new_version(repo, clock, world, "down", "h2")
    async with repo.transaction() as tx:
        ops = tx.deploy
        await ops.insert_pointers(down, {a: vs["a1"], b: vs["b1"]})
        await ops.insert_pointers(down, {})
        # Only existing pointers move; a dataset not in the set is not added.
        await ops.update_pointers(down, {a: vs["a2"]})
        await ops.update_pointers(bare, {a: vs["a2"]})
    async with repo.read() as tx:
        ops = tx.deploy
        assert await ops.pointers(down) == {a: vs["a2"], b: vs["b1"]}
        assert await ops.pointers(bare) == {}
        assert await ops.pointers_of_versions([down, bare]) == {down: {a: vs["a2"], b: vs["b1"]}}
        assert await ops.pointers_of_versions([]) == {}
        # "down" produces b; a is an input from "up".
        assert await ops.produced_pointers(down, "down") == {b: vs["b1"]}
    with pytest.raises(DuplicateItem):
        async with repo.transaction() as tx:
            await tx.deploy.insert_pointers(down, {a: vs["a1"]})


async def test_producers_current_pointers_follow_each_producers_current_version(
    repo: SqlRepository, clock: ManualClock, world: World
) -> None:
    a, b, vs = world.datasets["a"], world.datasets["b"], world.versions
    up = await new_version(repo, clock, world, "up", "h1")
    async with repo.transaction() as tx:
        await tx.deploy.insert_pointers(up, {a: vs["a2"]})
        # No current version of "up" yet.
        assert await tx.deploy.producers_current_pointers(world.org_id, [a, b]) == {}
        await tx.deploy.set_current_version(world.org_id, "up", up, now=clock.now())
        # b's producer ("down") has no current version: b is absent.
        assert await tx.deploy.producers_current_pointers(world.org_id, [a, b]) == {a: vs["a2"]}
        assert await tx.deploy.producers_current_pointers(world.org_id, []) == {}


async def test_live_consumers_of_other_dags_are_repointed(
    repo: SqlRepository, clock: ManualClock, world: World
) -> None:
    a, vs = world.datasets["a"], world.versions
    producer = await new_version(repo, clock, world, "up", "h1")
    consumer = await new_version(repo, clock, world, "down", "h1")
    dead = await new_version(repo, clock, world, "down", "h2")
    async with repo.transaction() as tx:
        ops = tx.deploy
        for v in (producer, consumer, dead):
            await ops.insert_pointers(v, {a: vs["a1"]})
        await ops.mark_versions_abandoned([dead])
        await ops.repoint_live_consumers(world.org_id, "up", {a: vs["a2"]})
        assert await ops.pointers(consumer) == {a: vs["a2"]}
        assert await ops.pointers(producer) == {a: vs["a1"]}  # the producer's own: untouched
        assert await ops.pointers(dead) == {a: vs["a1"]}  # not live: untouched


async def test_jobs_round_trip_and_live_reads_cover_current_and_building_versions(
    repo: SqlRepository, clock: ManualClock, world: World
) -> None:
    a, b, vs = world.datasets["a"], world.datasets["b"], world.versions
    current = await new_version(repo, clock, world, "down", "h1")
    building = await new_version(repo, clock, world, "down", "h2")
    gone = await new_version(repo, clock, world, "down", "h3")
    jobs = [job(world, v, name) for v in (current, building, gone) for name in ("y", "x")]
    async with repo.transaction() as tx:
        ops = tx.deploy
        await ops.insert_jobs(jobs, now=clock.now())
        await ops.insert_jobs([], now=clock.now())
        await ops.insert_pointers(current, {a: vs["a1"], b: vs["b1"]})
        await ops.mark_version_current(current, now=clock.now())
        await ops.mark_versions_abandoned([gone])
    async with repo.read() as tx:
        ops = tx.deploy
        assert await ops.job_ids_by_name(current) == {"y": jobs[0].job_id, "x": jobs[1].job_id}
        outputs = await ops.job_outputs([current])
        assert sorted(outputs, key=lambda o: str(o.job_id)) == sorted(
            (JobOutputs(j.job_id, current, (b,)) for j in jobs[:2]), key=lambda o: str(o.job_id)
        )
        assert await ops.job_outputs([]) == []
        live = {v.version_id: v for v in await ops.live_versions()}
        live_jobs = await ops.live_version_jobs()
    assert set(live) == {current, building}
    assert live[current].status == "current" and live[current].pointers == {
        a: vs["a1"],
        b: vs["b1"],
    }
    assert live[building].pointers == {}  # a version without pointers is still live
    # Current before building, then by job name; every field as written.
    assert [(j.version_status, j.job.name) for j in live_jobs] == [
        ("current", "x"),
        ("current", "y"),
        ("building", "x"),
        ("building", "y"),
    ]
    assert live_jobs[0].job == jobs[1]


async def test_a_job_name_is_unique_within_a_version(
    repo: SqlRepository, clock: ManualClock, world: World
) -> None:
    v = await new_version(repo, clock, world, "down", "h1")
    with pytest.raises(DuplicateItem):
        async with repo.transaction() as tx:
            await tx.deploy.insert_jobs([job(world, v, "x"), job(world, v, "x")], now=clock.now())


async def test_the_dag_lock_is_held_until_the_transaction_ends(
    repo: SqlRepository, clock: ManualClock, world: World, engine: str
) -> None:
    key = dag_lock_key(world.org_id, "down")
    async with repo.transaction() as tx:
        await tx.deploy.lock_dag_versions(world.org_id, "down")
        await tx.deploy.lock_dag_versions(world.org_id, "down")  # re-entrant in one transaction
        if engine == "postgres":
            # Engine difference: Postgres holds an advisory lock another
            # session cannot take; SQLite's write transaction is the lock.
            assert not await _try_lock(repo, key)
    if engine == "postgres":
        assert await _try_lock(repo, key)


async def _try_lock(repo: SqlRepository, key: int) -> bool:
    """Whether another session could take the advisory lock ``key`` now (Postgres)."""
    async with repo.autocommit() as other:
        got = await other.connection.execute(sa.select(sa.func.pg_try_advisory_lock(key)))
        locked = bool(got.scalar())
        if locked:
            await other.connection.execute(sa.select(sa.func.pg_advisory_unlock(key)))
        return locked
