"""The payload area of the port (``tx.payload``), on both engines."""

from __future__ import annotations

import uuid

import pytest

from trace_core.clock import ManualClock
from trace_core.storage.ports import (
    ClaimedView,
    JobRecord,
    NewDagVersion,
    NewDataset,
    NewDatasetVersion,
    ProgressFold,
    VersionPointer,
    VersionProgress,
)
from trace_core.storage.protocol import NewTask
from trace_core.storage.scopes import per_statement_reads
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio


async def test_task_rows_carry_the_task_and_its_job(
    repo: SqlRepository, clock: ManualClock
) -> None:
    org_id, version_id, job_id = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    now = clock.now()
    async with repo.transaction() as tx:
        await tx.registry.create_org_if_absent(org_id, "acme", now=now)
        await tx.deploy.insert_version(NewDagVersion(version_id, org_id, "dag", "h", "y", now))
        await tx.deploy.insert_jobs(
            [
                JobRecord(
                    job_id=job_id,
                    org_id=org_id,
                    name="job",
                    dag_name="dag",
                    dag_version_id=version_id,
                    activation="reactive",
                    runtime="spark",
                    operator="op",
                    config_hash="c",
                    update_strategy="replace",
                    config={"k": 1},
                    heartbeat_timeout_seconds=30,
                )
            ],
            now=now,
        )
        created = await tx.create_tasks(
            [NewTask(job_id, partitions=("p1",), dedupe_key="a"), NewTask(job_id, dedupe_key="b")],
            now=now,
        )
    ids = [c.task_id for c in created]
    async with repo.read() as tx:
        rows = await tx.payload.task_rows([*ids, uuid.uuid4()])
        assert await tx.payload.task_rows([]) == []
    by_id = {row["id"]: row for row in rows}
    assert set(by_id) == set(ids)  # the unknown id is skipped
    row = by_id[ids[0]]
    assert set(row) == {
        "id", "attempt", "status", "partitions", "input_versions", "job_id", "org_id", "name",
        "dag_name", "dag_version_id", "operator", "runtime", "config", "output_datasets",
        "activation", "scaling", "heartbeat_timeout_seconds", "source",
    }  # fmt: skip
    assert (row["status"], row["attempt"], list(row["partitions"])) == ("Queued", 1, ["p1"])
    assert (row["job_id"], row["org_id"], row["name"], row["dag_name"]) == (
        job_id,
        org_id,
        "job",
        "dag",
    )
    assert (row["dag_version_id"], row["operator"], row["runtime"]) == (version_id, "op", "spark")
    assert (row["config"], row["heartbeat_timeout_seconds"]) == ({"k": 1}, 30)


async def test_version_pointers_and_storage_locations(
    repo: SqlRepository, clock: ManualClock
) -> None:
    org_id, now = uuid.uuid4(), clock.now()
    v1, v2, elsewhere = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    a = NewDataset(uuid.uuid4(), org_id, "a", "dag", "job", 0, now)
    b = NewDataset(uuid.uuid4(), org_id, "b", "dag", "job", 1, now)
    av = NewDatasetVersion(uuid.uuid4(), a.dataset_uuid, "h", 0, 9, "s3://x/a", now)
    bv = NewDatasetVersion(uuid.uuid4(), b.dataset_uuid, "h", None, None, "s3://x/b", now)
    async with repo.transaction() as tx:
        await tx.registry.create_org_if_absent(org_id, "acme", now=now)
        for version in (v1, v2, elsewhere):
            await tx.deploy.insert_version(
                NewDagVersion(version, org_id, "dag", str(version), "y", now)
            )
        await tx.registry.register_datasets_if_absent([a, b])
        for dv in (av, bv):
            await tx.registry.insert_dataset_version_if_absent(dv)
        await tx.deploy.insert_pointers(v1, {a.dataset_uuid: av.version_id})
        await tx.deploy.insert_pointers(v2, {b.dataset_uuid: bv.version_id})
        await tx.deploy.insert_pointers(elsewhere, {a.dataset_uuid: av.version_id})
    async with repo.read() as tx:
        pointers = await tx.payload.version_pointers([v1, v2, uuid.uuid4()])
        assert await tx.payload.version_pointers([]) == []
        locations = await tx.payload.storage_locations([av.version_id, uuid.uuid4()])
        assert await tx.payload.storage_locations([]) == {}
    assert sorted(pointers, key=lambda p: p.dataset_name) == [
        VersionPointer(v1, a.dataset_uuid, av.version_id, "s3://x/a", 0, 9, "a"),
        VersionPointer(v2, b.dataset_uuid, bv.version_id, "s3://x/b", None, None, "b"),
    ]  # the version not asked for is left out
    assert locations == {av.version_id: "s3://x/a"}


async def test_claimed_view_reads_state_pointers_and_progress_in_one_statement(
    repo: SqlRepository, clock: ManualClock
) -> None:
    # What a claim reads after its lease (ONE statement, on Postgres on the
    # direct path): only the asked DAG version's pointers and the progress of
    # the versions it points to.
    org_id, now = uuid.uuid4(), clock.now()
    mine, other, job_id, both = uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    a = NewDataset(uuid.uuid4(), org_id, "a", "dag", "job", 0, now)
    b = NewDataset(uuid.uuid4(), org_id, "b", "dag", "job", 1, now)
    av = NewDatasetVersion(uuid.uuid4(), a.dataset_uuid, "h", 0, 9, "s3://x/a", now)
    bv = NewDatasetVersion(uuid.uuid4(), b.dataset_uuid, "h", None, None, "s3://x/b", now)
    async with repo.transaction() as tx:
        await tx.registry.create_org_if_absent(org_id, "acme", now=now)
        for version in (mine, other, both):
            await tx.deploy.insert_version(
                NewDagVersion(version, org_id, "dag", str(version), "y", now)
            )
        await tx.registry.register_datasets_if_absent([a, b])
        for dv in (av, bv):
            await tx.registry.insert_dataset_version_if_absent(dv)
        await tx.deploy.insert_pointers(mine, {a.dataset_uuid: av.version_id})
        await tx.deploy.insert_pointers(other, {b.dataset_uuid: bv.version_id})
        await tx.deploy.insert_pointers(
            both, {a.dataset_uuid: av.version_id, b.dataset_uuid: bv.version_id}
        )
        await tx.events.advance_progress(
            [
                ProgressFold(av.version_id, a.dataset_uuid, [(0, 4)], 4, 1),
                ProgressFold(bv.version_id, b.dataset_uuid, [(0, 9)], None, 1),
            ],
            now=now,
        )
        await tx.deploy.insert_jobs(
            [
                JobRecord(
                    job_id=job_id,
                    org_id=org_id,
                    name="job",
                    dag_name="dag",
                    dag_version_id=mine,
                    activation="source",
                    runtime="spark",
                    operator="op",
                    config_hash="c",
                    update_strategy="replace",
                )
            ],
            now=now,
        )
        (created,) = await tx.create_tasks([NewTask(job_id, dedupe_key="k")], now=now)
    pointer = VersionPointer(mine, a.dataset_uuid, av.version_id, "s3://x/a", 0, 9, "a")
    async with per_statement_reads(repo) as reads:
        view = await reads.payload.claimed_view(created.task_id, mine, progress=True)
        bare = await reads.payload.claimed_view(created.task_id, mine, progress=False)
        gone = await reads.payload.claimed_view(uuid.uuid4(), other, progress=True)
        two_progress = await reads.payload.claimed_view(created.task_id, both, progress=True)
        unpointed = await reads.payload.claimed_view(created.task_id, uuid.uuid4(), progress=False)
        gone_bare = await reads.payload.claimed_view(uuid.uuid4(), mine, progress=False)
        two = await reads.payload.claimed_view(created.task_id, both, progress=False)
        if repo.engine_name == "postgres":
            assert repo.engine.pool.checkedout() == 0  # the direct path, no pooled connection
    assert view == ClaimedView(
        "Queued", 1, [pointer], {av.version_id: VersionProgress(((0, 4),), 4)}
    )
    assert bare == ClaimedView("Queued", 1, [pointer], {})
    assert (gone.status, gone.attempt) == (None, 0)
    assert unpointed == ClaimedView("Queued", 1, [], {})
    assert (gone_bare.status, gone_bare.attempt) == (None, 0)
    assert (two.status, two.attempt, two.progress) == ("Queued", 1, {})
    assert two_progress.progress == {
        av.version_id: VersionProgress(((0, 4),), 4),
        bv.version_id: VersionProgress(((0, 9),), None),
    }
    assert sorted(two_progress.pointers, key=lambda p: p.dataset_name) == sorted(
        two.pointers, key=lambda p: p.dataset_name
    )
    assert sorted(two.pointers, key=lambda p: p.dataset_name) == [
        VersionPointer(both, a.dataset_uuid, av.version_id, "s3://x/a", 0, 9, "a"),
        VersionPointer(both, b.dataset_uuid, bv.version_id, "s3://x/b", None, None, "b"),
    ]
