"""The explain area of the port (``tx.explain``), on both engines."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
import sqlalchemy as sa

from trace_core.clock import ManualClock
from trace_core.storage import schema
from trace_core.storage.ports import (
    ExplainedJob,
    FailedAttempt,
    InputEvent,
    JobRecord,
    JobStateFlags,
    NewDagVersion,
    NewDataset,
    NewDatasetVersion,
)
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio


def job_record(org_id: uuid.UUID, version_id: uuid.UUID, **extra: object) -> JobRecord:
    return JobRecord(
        job_id=uuid.uuid4(),
        org_id=org_id,
        name="job",
        dag_name="dag",
        dag_version_id=version_id,
        activation="reactive",
        runtime="spark",
        operator="op",
        config_hash="c",
        update_strategy="replace",
        **extra,  # type: ignore[arg-type]
    )


async def versions(
    repo: SqlRepository, clock: ManualClock, org_id: uuid.UUID, *statuses: str
) -> list[JobRecord]:
    """One DAG version per status (created a second apart), each with job ``job``."""
    jobs = []
    async with repo.transaction() as tx:
        await tx.registry.create_org_if_absent(org_id, f"org-{org_id}", now=clock.now())
        for n, status in enumerate(statuses):
            version_id = uuid.uuid4()
            at = clock.now() + timedelta(seconds=n)
            await tx.deploy.insert_version(NewDagVersion(version_id, org_id, "dag", str(n), "", at))
            v = schema.dag_versions
            await tx.connection.execute(
                sa.update(v).where(v.c.id == version_id).values(status=status)
            )
            record = job_record(org_id, version_id, input_datasets=(uuid.uuid4(),))
            await tx.deploy.insert_jobs([record], now=at)
            jobs.append(record)
    return jobs


async def test_find_job_prefers_current_then_building_then_newest(
    repo: SqlRepository, clock: ManualClock
) -> None:
    org = uuid.uuid4()
    _, current, _, _ = await versions(
        repo, clock, org, "superseded", "current", "building", "abandoned"
    )
    org2 = uuid.uuid4()
    _, building2 = await versions(repo, clock, org2, "superseded", "building")
    org3 = uuid.uuid4()
    _, newest3 = await versions(repo, clock, org3, "superseded", "abandoned")
    async with repo.read() as tx:
        found = await tx.explain.find_job(f"org-{org}", "dag", "job")
        assert found == ExplainedJob(
            current.job_id, current.dag_version_id, "current", "reactive", "op", "spark",
            current.input_datasets,
        )  # fmt: skip
        second = await tx.explain.find_job(f"org-{org2}", "dag", "job")
        third = await tx.explain.find_job(f"org-{org3}", "dag", "job")
        assert await tx.explain.find_job(f"org-{org}", "dag", "other") is None
        assert await tx.explain.find_job(f"org-{org}", "other", "job") is None
        assert await tx.explain.find_job("nobody", "dag", "job") is None
    assert second is not None and second.job_id == building2.job_id
    assert third is not None and (third.job_id, third.version_status) == (
        newest3.job_id,
        "abandoned",
    )


async def test_job_state(repo: SqlRepository, clock: ManualClock) -> None:
    job, other = await versions(repo, clock, uuid.uuid4(), "current", "superseded")
    async with repo.transaction() as tx:
        await tx.connection.execute(
            sa.insert(schema.job_states).values(
                job_id=job.job_id, paused=True, pause_reason="full", source_status="Running"
            )
        )
        assert await tx.explain.job_state(job.job_id) == JobStateFlags(
            True, "full", "Running", "Idle"
        )
        assert await tx.explain.job_state(other.job_id) is None


async def test_task_status_counts_and_failed_attempts(
    repo: SqlRepository, clock: ManualClock
) -> None:
    job, other = await versions(repo, clock, uuid.uuid4(), "current", "superseded")
    async with repo.transaction() as tx:
        created = await tx.create_tasks(
            [NewTask(job.job_id, dedupe_key=str(n)) for n in range(4)], now=clock.now()
        )
        await tx.create_tasks([NewTask(other.job_id)], now=clock.now())
    ids = [c.task_id for c in created]
    t = schema.tasks
    retry_at = clock.now() + timedelta(minutes=1)
    async with repo.transaction() as tx:
        for n, (task_id, status, error, retry) in enumerate(
            [
                (ids[0], "Failed", "boom", retry_at),
                (ids[1], "Failed", "dead", None),
                (ids[2], "Completed", "once failed", None),
            ]
        ):
            await tx.connection.execute(
                sa.update(t)
                .where(t.c.id == task_id)
                .values(
                    status=status,
                    error_message=error,
                    next_retry_at=retry,
                    created_at=clock.now() + timedelta(seconds=n),
                )
            )
    async with repo.read() as tx:
        assert await tx.explain.task_status_counts(job.job_id) == {
            "Failed": 2,
            "Completed": 1,
            "Queued": 1,
        }
        totals = await tx.explain.task_status_counts()
        failed = await tx.explain.failed_attempts(job.job_id, limit=10)
        assert await tx.explain.failed_attempts(job.job_id, limit=1) == failed[:1]
        assert await tx.explain.failed_attempts(other.job_id, limit=10) == []
    assert totals["Queued"] >= 2 and totals["Failed"] >= 2  # every job's tasks
    assert [(f.task_id, f.status, f.error) for f in failed] == [
        (ids[2], "Completed", "once failed"),
        (ids[1], "Failed", "dead"),
        (ids[0], "Failed", "boom"),
    ]
    assert failed[2] == FailedAttempt(ids[0], failed[2].attempt, "Failed", "boom", retry_at)
    assert failed[1].next_retry_at is None


async def test_recent_input_events_newest_first(repo: SqlRepository, clock: ManualClock) -> None:
    org_id, now = uuid.uuid4(), clock.now()
    a = NewDataset(uuid.uuid4(), org_id, "a", "dag", "job", 0, now)
    b = NewDataset(uuid.uuid4(), org_id, "b", "dag", "job", 1, now)
    c = NewDataset(uuid.uuid4(), org_id, "c", "dag", "job", 2, now)
    vs = {
        d.dataset_uuid: NewDatasetVersion(uuid.uuid4(), d.dataset_uuid, "h", None, None, "x", now)
        for d in (a, b, c)
    }
    async with repo.transaction() as tx:
        await tx.registry.create_org_if_absent(org_id, "acme", now=now)
        await tx.registry.register_datasets_if_absent([a, b, c])
        for v in vs.values():
            await tx.registry.insert_dataset_version_if_absent(v)
        for n, (d, detail) in enumerate([(a, None), (b, {"job": "created"}), (c, None), (a, None)]):
            at = now + timedelta(seconds=n)
            await tx.connection.execute(
                sa.insert(schema.events).values(
                    dataset_uuid=d.dataset_uuid,
                    dataset_version=vs[d.dataset_uuid].version_id,
                    unit_key=f"cursor:{n}",
                    origin="manual",
                    received_at=at,
                    last_received_at=at,
                    route_detail=detail,
                    route_status="pending" if detail is None else "routed",
                )
            )
    async with repo.read() as tx:
        found = await tx.explain.recent_input_events([a.dataset_uuid, b.dataset_uuid], limit=10)
        top = await tx.explain.recent_input_events([a.dataset_uuid, b.dataset_uuid], limit=2)
        assert await tx.explain.recent_input_events([], limit=10) == []
    assert [(e.dataset, e.unit) for e in found] == [
        ("a", "cursor:3"),
        ("b", "cursor:1"),
        ("a", "cursor:0"),
    ]  # c's event is left out
    assert top == found[:2]
    assert found[1] == InputEvent(
        now + timedelta(seconds=1),
        "b",
        vs[b.dataset_uuid].version_id,
        "cursor:1",
        1,
        "routed",
        {"job": "created"},
    )
    assert found[0].route_detail is None and found[0].route_status == "pending"
