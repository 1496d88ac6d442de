"""The status area of the port (``tx.status``), on both engines."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
import sqlalchemy as sa

from trace_core.clock import ManualClock
from trace_core.storage import schema
from trace_core.storage.ports import (
    DagDataset,
    JobRecord,
    NewDagVersion,
    NewDataset,
    NewDatasetVersion,
    OutputVersion,
)
from trace_core.storage.protocol import NewOutboxRow, NewTask
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio


class World:
    """Org ``acme``: DAG ``dag`` with a current, a building and a superseded
    version (one job ``a`` or ``b`` each), and DAG ``other``; org ``zeta``
    with a DAG ``dag`` too."""

    def __init__(self) -> None:
        self.org, self.zeta = uuid.uuid4(), uuid.uuid4()
        self.versions: dict[str, uuid.UUID] = {}
        self.jobs: dict[str, uuid.UUID] = {}
        self.dataset_versions: dict[str, uuid.UUID] = {}


async def make_world(repo: SqlRepository, clock: ManualClock) -> World:
    w, now = World(), clock.now()
    dv = schema.dag_versions
    layout = [  # (key, org, dag, status, job, dataset)
        ("current", w.org, "dag", "current", "a", "x"),
        ("building", w.org, "dag", "building", "b", "y"),
        ("superseded", w.org, "dag", "superseded", "a", "z"),
        ("other", w.org, "other", "current", "a", "o"),
        ("zeta", w.zeta, "dag", "current", "a", "x"),
    ]
    async with repo.transaction() as tx:
        await tx.registry.create_org_if_absent(w.org, "acme", now=now)
        await tx.registry.create_org_if_absent(w.zeta, "zeta", now=now)
        for n, (key, org, dag, status, job, dataset) in enumerate(layout):
            version = w.versions[key] = uuid.uuid4()
            await tx.deploy.insert_version(NewDagVersion(version, org, dag, str(n), "", now))
            await tx.connection.execute(
                sa.update(dv).where(dv.c.id == version).values(status=status)
            )
            record = JobRecord(
                uuid.uuid4(), org, job, dag, version, "reactive", "spark", "op", "c", "replace"
            )
            await tx.deploy.insert_jobs([record], now=now)
            w.jobs[key] = record.job_id
            ds = NewDataset(uuid.uuid4(), org, f"{dataset}-{key}", dag, job, n, now)
            await tx.registry.register_datasets_if_absent([ds])
            v = NewDatasetVersion(uuid.uuid4(), ds.dataset_uuid, "h", 0, 99, f"s3://b/{key}", now)
            await tx.registry.insert_dataset_version_if_absent(v)
            await tx.deploy.insert_pointers(version, {ds.dataset_uuid: v.version_id})
            w.dataset_versions[key] = v.version_id
    return w


async def test_dag_datasets_of_the_live_versions(repo: SqlRepository, clock: ManualClock) -> None:
    w = await make_world(repo, clock)
    now = clock.now()
    async with repo.transaction() as tx:
        current = w.dataset_versions["current"]
        await tx.connection.execute(
            sa.insert(schema.dataset_version_progress).values(
                dataset_version=current,
                dataset_uuid=sa.select(schema.dataset_versions.c.dataset_uuid)
                .where(schema.dataset_versions.c.id == current)
                .scalar_subquery(),
                ranges=[[0, 9]],
                max_cursor=9,
            )
        )
        for n in range(2):
            await tx.connection.execute(
                sa.insert(schema.events).values(
                    dataset_uuid=sa.select(schema.dataset_versions.c.dataset_uuid)
                    .where(schema.dataset_versions.c.id == current)
                    .scalar_subquery(),
                    dataset_version=current,
                    unit_key=f"cursor:{n}",
                    origin="manual",
                    received_at=now,
                    last_received_at=now,
                )
            )
    async with repo.read() as tx:
        found = await tx.status.dag_datasets("acme", "dag")
        assert await tx.status.dag_datasets("acme", "missing") == []
        assert await tx.status.dag_datasets("nobody", "dag") == []
    assert [(d.name, d.dag_version_status) for d in found] == [
        ("x-current", "current"),
        ("y-building", "building"),
    ]  # current first; superseded versions, other DAGs and orgs left out
    assert found[0] == DagDataset(
        "x-current", found[0].dataset_uuid, current, "current", "s3://b/current", 0, 99,
        [[0, 9]], 9, 2,
    )  # fmt: skip
    assert (found[1].ranges, found[1].max_cursor, found[1].events) == ([], None, 0)


async def test_task_counts_listing_and_prefix_counts(
    repo: SqlRepository, clock: ManualClock
) -> None:
    w = await make_world(repo, clock)
    async with repo.transaction() as tx:
        made = {}
        for key, keys in [
            ("current", ["run:1:a", "run:1:b", "run_1:c"]),
            ("building", ["run:1:d"]),
            ("superseded", ["old"]),
            ("other", ["run:1:e"]),
            ("zeta", ["run:1:f"]),
        ]:
            for n, k in enumerate(keys):
                created = await tx.create_tasks(
                    [NewTask(w.jobs[key], dedupe_key=k)], now=clock.now() + timedelta(seconds=n)
                )
                made[k] = created[0].task_id
        t = schema.tasks
        await tx.connection.execute(
            sa.update(t)
            .where(t.c.id == made["run:1:b"])
            .values(status="Failed", attempt=2, error_message="boom")
        )
    async with repo.read() as tx:
        counts = await tx.status.task_counts_by_job("acme", "dag")
        listed = await tx.status.recent_tasks("acme", "dag", limit=10)
        two = await tx.status.recent_tasks("acme", "dag", limit=2)
        of_b = await tx.status.recent_tasks("acme", "dag", limit=10, job_name="b")
        failed = await tx.status.recent_tasks("acme", "dag", limit=10, status="Failed")
        by_prefix = await tx.status.task_counts_by_dedupe_prefix("run:1:")
        literal = await tx.status.task_counts_by_dedupe_prefix("run_")
        org = await tx.status.org_of_task(made["run:1:f"])
        assert await tx.status.org_of_task(uuid.uuid4()) is None
        assert await tx.status.task_counts_by_job("acme", "missing") == {}
    # every version of the DAG, not other DAGs or orgs
    assert counts == {"a": {"Queued": 3, "Failed": 1}, "b": {"Queued": 1}}
    assert len(listed) == 5 and listed[:2] == two
    queued = [r.queued_at for r in listed]
    assert queued == sorted(queued, reverse=True)
    assert [r.task_id for r in of_b] == [made["run:1:d"]]
    assert [(r.task_id, r.status, r.attempt, r.error_message) for r in failed] == [
        (made["run:1:b"], "Failed", 2, "boom")
    ]
    assert sorted(by_prefix) == [("Failed", 2, 1), ("Queued", 1, 4)]
    assert literal == [("Queued", 1, 1)]  # "_" is no wildcard: "run:1:..." do not match
    assert org == w.zeta


async def test_open_outbox_count(repo: SqlRepository, clock: ManualClock) -> None:
    async with repo.transaction() as tx:
        before = await tx.status.open_outbox_count()
        ids = await tx.insert_outbox(
            [NewOutboxRow("k", {}), NewOutboxRow("k", {}), NewOutboxRow("k", {})], now=clock.now()
        )
        o = schema.outbox
        await tx.connection.execute(
            sa.update(o).where(o.c.id == ids[0]).values(status="Processing")
        )
        await tx.connection.execute(sa.update(o).where(o.c.id == ids[1]).values(status="Done"))
        assert await tx.status.open_outbox_count() == before + 2


async def test_output_version_is_the_pointed_version_of_an_output_only(
    repo: SqlRepository, clock: ManualClock
) -> None:
    now, org, version = clock.now(), uuid.uuid4(), uuid.uuid4()
    out = NewDataset(uuid.uuid4(), org, "out", "dag", "w", 0, now)
    read = NewDataset(uuid.uuid4(), org, "in", "dag", "w", 1, now)
    out_v = NewDatasetVersion(uuid.uuid4(), out.dataset_uuid, "h", 0, 9, "s3://b/out", now)
    read_v = NewDatasetVersion(uuid.uuid4(), read.dataset_uuid, "h", 0, 9, "s3://b/in", now)
    job = JobRecord(
        uuid.uuid4(), org, "w", "dag", version, "reactive", "spark", "op", "c", "replace",
        output_datasets=(out.dataset_uuid,),
    )  # fmt: skip
    async with repo.transaction() as tx:
        await tx.registry.create_org_if_absent(org, "acme", now=now)
        await tx.deploy.insert_version(NewDagVersion(version, org, "dag", "0", "", now))
        await tx.registry.register_datasets_if_absent([out, read])
        for v in (out_v, read_v):
            await tx.registry.insert_dataset_version_if_absent(v)
        await tx.deploy.insert_pointers(
            version, {out.dataset_uuid: out_v.version_id, read.dataset_uuid: read_v.version_id}
        )
        await tx.deploy.insert_jobs([job], now=now)
        [created] = await tx.create_tasks([NewTask(job.job_id, dedupe_key="k")], now=now)
    task = created.task_id
    async with repo.read() as tx:
        found = await tx.status.output_version(task, out.dataset_uuid)
        assert found == OutputVersion(org, out_v.version_id, "s3://b/out")
        # pointed at by the DAG version, but not an output of the task's job
        assert await tx.status.output_version(task, read.dataset_uuid) is None
        assert await tx.status.output_version(uuid.uuid4(), out.dataset_uuid) is None
        assert await tx.status.output_version(task, uuid.uuid4()) is None
