"""The registry area of the port (``tx.registry``), on both engines.

Each test states one guarantee of :class:`trace_core.storage.ports.RegistryOps`
as its docstring says it, through the SQL implementation of the engine.
"""

from __future__ import annotations

import uuid

import pytest

from tests.factories import set_progress
from tests.test_storage_tasks import jobs
from trace_core.clock import ManualClock
from trace_core.storage.ports import NewDataset, NewDatasetVersion, RegisteredDataset
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio


async def org(repo: SqlRepository, clock: ManualClock, slug: str = "acme") -> uuid.UUID:
    org_id = uuid.uuid4()
    async with repo.transaction() as tx:
        await tx.registry.create_org_if_absent(org_id, slug, now=clock.now())
    return org_id


def dataset(
    org_id: uuid.UUID,
    name: str,
    clock: ManualClock,
    *,
    dag: str = "d",
    job: str = "j",
    index: int = 0,
) -> NewDataset:
    return NewDataset(uuid.uuid4(), org_id, name, dag, job, index, clock.now(), {"kind": "parquet"})


def version(
    ds: NewDataset,
    clock: ManualClock,
    *,
    config_hash: str = "h1",
    range_start: int | None = None,
    range_end: int | None = None,
) -> NewDatasetVersion:
    return NewDatasetVersion(
        uuid.uuid4(),
        ds.dataset_uuid,
        config_hash,
        range_start,
        range_end,
        f"mem://{ds.name}/",
        clock.now(),
    )


async def test_an_org_is_created_once_and_found_by_slug(
    repo: SqlRepository, clock: ManualClock
) -> None:
    async with repo.read() as tx:
        assert await tx.registry.find_org("acme") is None
    first = await org(repo, clock)
    async with repo.transaction() as tx:
        # Same slug, another id: a no-op, not an error; the first org stays.
        await tx.registry.create_org_if_absent(uuid.uuid4(), "acme", now=clock.now())
        assert await tx.registry.find_org("acme") == first


async def test_the_org_slug_of_a_job(repo: SqlRepository, clock: ManualClock) -> None:
    (job_id,) = await jobs(repo, clock, ("spark", "x"))  # in org "acme"
    async with repo.read() as tx:
        assert await tx.registry.org_slug_of_job(job_id) == "acme"
        assert await tx.registry.org_slug_of_job(uuid.uuid4()) is None


async def test_registering_skips_a_taken_name_or_producer_slot(
    repo: SqlRepository, clock: ManualClock
) -> None:
    org_id = await org(repo, clock)
    blocks = dataset(org_id, "blocks", clock, dag="chain", job="follow", index=0)
    async with repo.transaction() as tx:
        await tx.registry.register_datasets_if_absent([blocks])
        await tx.registry.register_datasets_if_absent(
            [
                dataset(org_id, "blocks", clock, dag="other", job="x"),  # name taken
                dataset(org_id, "renamed", clock, dag="chain", job="follow", index=0),  # slot
                dataset(org_id, "alerts", clock, dag="chain", job="alerts"),
            ]
        )
        await tx.registry.register_datasets_if_absent([])
    async with repo.read() as tx:
        assert await tx.registry.dataset_names(org_id) == {"blocks", "alerts"}
        [row] = await tx.registry.datasets_named_or_produced_by(org_id, names=["blocks"])
        assert row == RegisteredDataset(blocks.dataset_uuid, "blocks", "chain", "follow", 0)
        assert row.producer == "chain/follow[0]"


async def test_datasets_are_selected_by_name_or_producer_dag(
    repo: SqlRepository, clock: ManualClock
) -> None:
    org_id = await org(repo, clock)
    other_org = await org(repo, clock, "other")
    rows = [
        dataset(org_id, "a", clock, dag="one", job="j", index=0),
        dataset(org_id, "b", clock, dag="one", job="j", index=1),
        dataset(org_id, "c", clock, dag="two", job="j", index=0),
        dataset(other_org, "c", clock, dag="two", job="j", index=0),
    ]
    async with repo.transaction() as tx:
        await tx.registry.register_datasets_if_absent(rows)
    async with repo.read() as tx:
        ops = tx.registry

        async def names(wanted: list[str], producer: str | None) -> set[str]:
            found = await ops.datasets_named_or_produced_by(
                org_id, names=wanted, producer_dag=producer
            )
            return {r.name for r in found}

        assert await names(["c"], None) == {"c"}
        assert await names([], "one") == {"a", "b"}
        assert await names(["c"], "one") == {"a", "b", "c"}
        assert await names([], None) == set()
        by_id = await ops.dataset_names_by_id([rows[0].dataset_uuid, uuid.uuid4()])
        assert by_id == {rows[0].dataset_uuid: "a"}
        assert await ops.dataset_names_by_id([]) == {}


async def test_a_dataset_version_is_keyed_by_config_hash_and_range(
    repo: SqlRepository, clock: ManualClock
) -> None:
    org_id = await org(repo, clock)
    ds = dataset(org_id, "blocks", clock)
    open_range = version(ds, clock)
    bounded = version(ds, clock, range_start=0, range_end=99)
    async with repo.transaction() as tx:
        await tx.registry.register_datasets_if_absent([ds])
        assert await tx.registry.insert_dataset_version_if_absent(open_range) is True
        assert await tx.registry.insert_dataset_version_if_absent(bounded) is True
        # The same key again, under a fresh id: nothing is written.
        again = version(ds, clock, range_start=0, range_end=99)
        assert await tx.registry.insert_dataset_version_if_absent(again) is False
    async with repo.read() as tx:
        find = tx.registry.find_dataset_version
        key = {"config_hash": "h1"}
        assert await find(ds.dataset_uuid, **key, range_start=None, range_end=None) == (
            open_range.version_id
        )
        assert await find(ds.dataset_uuid, **key, range_start=0, range_end=99) == bounded.version_id
        # A None bound matches only None.
        assert await find(ds.dataset_uuid, **key, range_start=0, range_end=None) is None
        assert (
            await find(ds.dataset_uuid, config_hash="h2", range_start=None, range_end=None) is None
        )


async def test_the_same_version_id_is_not_inserted_twice(
    repo: SqlRepository, clock: ManualClock
) -> None:
    org_id = await org(repo, clock)
    ds = dataset(org_id, "blocks", clock)
    v = version(ds, clock)
    async with repo.transaction() as tx:
        await tx.registry.register_datasets_if_absent([ds])
        assert await tx.registry.insert_dataset_version_if_absent(v)
        assert not await tx.registry.insert_dataset_version_if_absent(v)


async def test_progress_is_read_for_the_versions_that_have_it(
    repo: SqlRepository, clock: ManualClock
) -> None:
    org_id = await org(repo, clock)
    ds = dataset(org_id, "blocks", clock)
    with_progress, without = version(ds, clock), version(ds, clock, config_hash="h2")
    async with repo.transaction() as tx:
        await tx.registry.register_datasets_if_absent([ds])
        await tx.registry.insert_dataset_version_if_absent(with_progress)
        await tx.registry.insert_dataset_version_if_absent(without)
    await set_progress(
        repo, with_progress.version_id, ds.dataset_uuid, [[0, 9], [20, 29]], 7, clock
    )
    async with repo.read() as tx:
        found = await tx.registry.dataset_version_progress(
            [with_progress.version_id, without.version_id]
        )
        assert await tx.registry.dataset_version_progress([]) == {}
    assert list(found) == [with_progress.version_id]
    assert found[with_progress.version_id].ranges == ((0, 9), (20, 29))
    assert found[with_progress.version_id].max_cursor == 7
