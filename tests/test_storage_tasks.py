"""The tasks area of the port (``tx.tasks``), on both engines."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
import sqlalchemy as sa

from trace_core.clock import ManualClock
from trace_core.storage import schema
from trace_core.storage.ports import JobRecord, NewDagVersion
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio


async def jobs(
    repo: SqlRepository, clock: ManualClock, *routes: tuple[str, str]
) -> list[uuid.UUID]:
    """One job per ``(runtime, operator)``, in one DAG version; their ids."""
    org_id, version_id = uuid.uuid4(), uuid.uuid4()
    records = [
        JobRecord(
            job_id=uuid.uuid4(),
            org_id=org_id,
            name=f"job{n}",
            dag_name="dag",
            dag_version_id=version_id,
            activation="reactive",
            runtime=runtime,
            operator=operator,
            config_hash="c",
            update_strategy="replace",
        )
        for n, (runtime, operator) in enumerate(routes)
    ]
    async with repo.transaction() as tx:
        await tx.registry.create_org_if_absent(org_id, "acme", now=clock.now())
        await tx.deploy.insert_version(
            NewDagVersion(version_id, org_id, "dag", "h", "dag: dag\n", clock.now())
        )
        await tx.deploy.insert_jobs(records, now=clock.now())
    return [r.job_id for r in records]


async def tasks(
    repo: SqlRepository, clock: ManualClock, job_id: uuid.UUID, *handicaps: float
) -> list[uuid.UUID]:
    """Queued tasks of ``job_id``; a larger handicap queues later."""
    async with repo.transaction() as tx:
        created = await tx.create_tasks(
            [NewTask(job_id, handicap_seconds=h) for h in handicaps], now=clock.now()
        )
    return [c.task_id for c in created]


async def set_status(
    repo: SqlRepository, task_id: uuid.UUID, status: str, retry_in: float | None, clock: ManualClock
) -> None:
    t = schema.tasks
    retry = clock.now() + timedelta(seconds=retry_in) if retry_in is not None else None
    async with repo.transaction() as tx:
        await tx.connection.execute(
            sa.update(t).where(t.c.id == task_id).values(status=status, next_retry_at=retry)
        )


async def test_oldest_queued_tasks_of_the_routed_jobs_in_claim_order(
    repo: SqlRepository, clock: ManualClock
) -> None:
    spark_a, spark_b, lam = await jobs(repo, clock, ("spark", "a"), ("spark", "b"), ("lambda", "a"))
    a_late, a_early = await tasks(repo, clock, spark_a, 20, 0)
    (b_mid,) = await tasks(repo, clock, spark_b, 10)
    (lam_first,) = await tasks(repo, clock, lam, -10)
    (running,) = await tasks(repo, clock, spark_a, -20)
    await set_status(repo, running, "Running", None, clock)
    async with repo.read() as tx:
        oldest = tx.tasks.oldest_queued
        assert await oldest([("spark", None)], limit=10) == [a_early, b_mid, a_late]
        assert await oldest([("spark", "b"), ("lambda", "a")], limit=10) == [lam_first, b_mid]
        assert await oldest([("spark", None)], limit=2) == [a_early, b_mid]
        assert await oldest([("spark", "c")], limit=10) == []
        assert await oldest([], limit=10) == []


async def test_queued_tasks_of_the_routed_jobs_page_in_id_order(
    repo: SqlRepository, clock: ManualClock
) -> None:
    spark_a, spark_b, lam = await jobs(repo, clock, ("spark", "a"), ("spark", "b"), ("lambda", "a"))
    spark_tasks = await tasks(repo, clock, spark_a, 20, 0)
    spark_tasks += await tasks(repo, clock, spark_b, 0)
    (lam_task,) = await tasks(repo, clock, lam, 0)
    (running,) = await tasks(repo, clock, spark_a, 0)
    await set_status(repo, running, "Running", None, clock)
    ordered = sorted(spark_tasks)  # the ids' order, whatever the claim order
    async with repo.read() as tx:
        by_id = tx.tasks.queued_in_id_order
        assert await by_id([("spark", None)], after=None, limit=10) == ordered
        first = await by_id([("spark", None)], after=None, limit=2)
        assert first == ordered[:2]
        assert await by_id([("spark", None)], after=first[-1], limit=2) == ordered[2:]
        assert await by_id([("spark", None)], after=ordered[-1], limit=2) == []
        assert await by_id([("lambda", "a")], after=None, limit=10) == [lam_task]
        assert await by_id([], after=None, limit=10) == []


async def test_unfinished_tasks_are_queued_running_or_awaiting_a_retry(
    repo: SqlRepository, clock: ManualClock
) -> None:
    job_id, other = await jobs(repo, clock, ("spark", "a"), ("spark", "b"))
    queued, running, retrying, dead, done = await tasks(repo, clock, job_id, 0, 0, 0, 0, 0)
    (elsewhere,) = await tasks(repo, clock, other, 0)
    await set_status(repo, running, "Running", None, clock)
    await set_status(repo, retrying, "Failed", 30, clock)
    await set_status(repo, dead, "Failed", None, clock)
    await set_status(repo, done, "Completed", None, clock)
    async with repo.read() as tx:
        found = await tx.tasks.unfinished_of_jobs([job_id])
        assert await tx.tasks.unfinished_of_jobs([]) == []
    assert set(found) == {queued, running, retrying}
    assert elsewhere not in found
