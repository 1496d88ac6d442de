"""The concurrency area of the port (``tx.concurrency``), on both engines."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
import sqlalchemy as sa

from tests.test_storage_tasks import jobs, set_status, tasks
from trace_core.clock import ManualClock
from trace_core.storage import schema
from trace_core.storage.ports import JobClaimSettings, QueuedTasks
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio


async def test_task_counts_per_job_and_operator(repo: SqlRepository, clock: ManualClock) -> None:
    a, b, c = await jobs(repo, clock, ("spark", "x"), ("spark", "x"), ("lambda", "y"))
    start = clock.now()
    a_run1, a_run2, _, a_retry, a_done = await tasks(repo, clock, a, 0, 0, 0, 0, 0)
    clock.advance(5)
    _, b_run = await tasks(repo, clock, b, 0, 0)
    clock.advance(5)
    await tasks(repo, clock, b, -60)  # a handicap moves the claim order, not the age
    (c_dead,) = await tasks(repo, clock, c, 0)
    for task_id in (a_run1, a_run2, b_run):
        await set_status(repo, task_id, "Running", None, clock)
    await set_status(repo, a_retry, "Failed", 30, clock)
    await set_status(repo, a_done, "Completed", None, clock)
    await set_status(repo, c_dead, "Failed", None, clock)
    async with repo.read() as tx:
        ops = tx.concurrency
        assert await ops.running_by_job() == {a: 2, b: 1}
        assert await ops.running_by_job([b, c]) == {b: 1}
        assert await ops.running_by_job([]) == {}
        assert await ops.running_by_operator() == {"x": 3}
        assert await ops.queued_by_job() == {
            a: QueuedTasks(1, start),
            b: QueuedTasks(2, start + timedelta(seconds=5)),
        }
        # A retry waiting and a dead or finished task are not activity.
        assert await ops.active_by_job([a, b, c]) == {a: 3, b: 3}
        assert await ops.active_by_job([]) == {}


async def test_claim_settings_and_the_job_of_a_task(
    repo: SqlRepository, clock: ManualClock
) -> None:
    a, b = await jobs(repo, clock, ("spark", "x"), ("spark", "y"))
    j = schema.jobs
    async with repo.transaction() as tx:
        await tx.connection.execute(
            sa.update(j)
            .where(j.c.id == a)
            .values(scaling={"max_concurrency": 2}, heartbeat_timeout_seconds=30)
        )
    (task_id,) = await tasks(repo, clock, b, 0)
    async with repo.read() as tx:
        ops = tx.concurrency
        settings = await ops.claim_settings([a, b, uuid.uuid4()])
        assert settings[a] == JobClaimSettings({"max_concurrency": 2}, 30)
        assert set(settings) == {a, b}  # an unknown job is absent
        assert await ops.claim_settings([]) == {}
        assert await ops.job_of_task(task_id) == b
        assert await ops.job_of_task(uuid.uuid4()) is None


async def test_oldest_queued_tasks_of_a_job_and_of_the_other_jobs_in_claim_order(
    repo: SqlRepository, clock: ManualClock
) -> None:
    a, b, c = await jobs(repo, clock, ("spark", "x"), ("spark", "y"), ("spark", "z"))
    a_late, a_early, a_running = await tasks(repo, clock, a, 20, 0, -30)
    (b_first,) = await tasks(repo, clock, b, -10)
    (c_mid,) = await tasks(repo, clock, c, 10)
    await set_status(repo, a_running, "Running", None, clock)
    async with repo.read() as tx:
        ops = tx.concurrency
        assert await ops.oldest_queued_of_job(a, limit=5) == [a_early, a_late]
        assert await ops.oldest_queued_of_job(a, limit=1) == [a_early]
        assert await ops.oldest_queued_of_job(a, limit=0) == []
        assert await ops.oldest_queued_except_jobs([], limit=10) == [
            (b_first, b),
            (a_early, a),
            (c_mid, c),
            (a_late, a),
        ]
        assert await ops.oldest_queued_except_jobs([a, c], limit=10) == [(b_first, b)]
        assert await ops.oldest_queued_except_jobs([], limit=2) == [(b_first, b), (a_early, a)]


async def test_lock_claim_candidates_skips_what_another_claimer_holds(
    repo: SqlRepository, clock: ManualClock, engine: str
) -> None:
    (a,) = await jobs(repo, clock, ("spark", "x"))
    free, held, running = await tasks(repo, clock, a, 0, 0, 0)
    await set_status(repo, running, "Running", None, clock)
    t = schema.tasks
    async with repo.transaction() as tx:
        assert await tx.concurrency.lock_claim_candidates([]) == set()
    if engine == "sqlite":
        # The write transaction excludes every other claimer: all of them, unchecked.
        async with repo.transaction() as tx:
            got = await tx.concurrency.lock_claim_candidates([free, held, running])
        assert got == {free, held, running}
        return
    async with repo.transaction() as other:
        await other.connection.execute(sa.select(t.c.id).where(t.c.id == held).with_for_update())
        async with repo.transaction() as tx:
            got = await tx.concurrency.lock_claim_candidates([free, held, running])
            assert got == {free}  # held is another's; running is no longer Queued
            async with repo.transaction() as third:
                assert await third.concurrency.lock_claim_candidates([free, held, running]) == set()
