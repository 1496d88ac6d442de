"""The sources and launch areas of the port (``tx.sources``, ``tx.launch``), on both engines."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from trace_core.clock import ManualClock
from trace_core.storage import schema
from trace_core.storage.ports import (
    CronState,
    JobRecord,
    NewDagVersion,
    SourceRun,
    SourceState,
    SourceStatus,
    StartableTask,
)
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio

PENDING, RUNNING, DEAD = str(SourceStatus.PENDING), str(SourceStatus.RUNNING), "Dead"
DRAINING, STOPPED = str(SourceStatus.DRAINING), str(SourceStatus.STOPPED)


async def make_jobs(
    repo: SqlRepository,
    clock: ManualClock,
    count: int,
    *,
    bootstrap: Mapping[str, Any] | None = None,
    runtime: str = "spark",
) -> tuple[uuid.UUID, list[uuid.UUID]]:
    """``count`` source jobs of one DAG version in a new org: ``(org, job ids)``."""
    org_id, version_id = uuid.uuid4(), uuid.uuid4()
    records = [
        JobRecord(
            job_id=uuid.uuid4(),
            org_id=org_id,
            name=f"job{n}",
            dag_name="dag",
            dag_version_id=version_id,
            activation="source",
            runtime=runtime,
            operator=f"op{n}",
            config_hash="c",
            update_strategy="replace",
            bootstrap=bootstrap,
        )
        for n in range(count)
    ]
    async with repo.transaction() as tx:
        await tx.registry.create_org_if_absent(org_id, f"org-{org_id.hex[:8]}", now=clock.now())
        await tx.deploy.insert_version(
            NewDagVersion(version_id, org_id, "dag", "h", "dag: dag\n", clock.now())
        )
        await tx.deploy.insert_jobs(records, now=clock.now())
    return org_id, [r.job_id for r in records]


async def make_task(
    repo: SqlRepository,
    clock: ManualClock,
    job_id: uuid.UUID,
    *,
    dedupe_key: str | None = None,
    status: str = "Queued",
) -> uuid.UUID:
    """A task of ``job_id`` set to ``status``."""
    async with repo.transaction() as tx:
        [created] = await tx.create_tasks([NewTask(job_id, dedupe_key=dedupe_key)], now=clock.now())
        if status != "Queued":
            t = schema.tasks
            await tx.connection.execute(
                sa.update(t).where(t.c.id == created.task_id).values(status=status)
            )
    return created.task_id


async def job_state_row(repo: SqlRepository, job_id: uuid.UUID) -> dict[str, Any] | None:
    """The job's ``job_states`` row as a dict, or ``None``."""
    s = schema.job_states
    async with repo.read() as tx:
        row = (await tx.connection.execute(sa.select(s).where(s.c.job_id == job_id))).first()
    return None if row is None else dict(row._mapping)


_EPOCH = ManualClock().now()


async def set_job_state(repo: SqlRepository, job_id: uuid.UUID, **values: Any) -> None:
    """Insert the job's ``job_states`` row with ``values`` (the rest default)."""
    async with repo.transaction() as tx:
        await tx.connection.execute(
            sa.insert(schema.job_states).values(job_id=job_id, updated_at=_EPOCH, **values)
        )


# --- source jobs and their first task ---------------------------------------------


async def test_job_bootstraps_of_existing_jobs_with_an_empty_default(
    repo: SqlRepository, clock: ManualClock
) -> None:
    _, [reset] = await make_jobs(repo, clock, 1, bootstrap={"reset_outputs": True})
    _, [plain] = await make_jobs(repo, clock, 1)
    async with repo.read() as tx:
        found = await tx.sources.job_bootstraps([reset, plain, uuid.uuid4()])
        assert await tx.sources.job_bootstraps([]) == {}
    assert found == {reset: {"reset_outputs": True}, plain: {}}


async def test_job_has_tasks_counts_only_tasks_with_a_dedupe_key_in_any_status(
    repo: SqlRepository, clock: ManualClock
) -> None:
    _, [keyed, unkeyed, none] = await make_jobs(repo, clock, 3)
    await make_task(repo, clock, keyed, dedupe_key="k", status="Canceled")
    await make_task(repo, clock, unkeyed)
    async with repo.read() as tx:
        assert await tx.sources.job_has_tasks(keyed)
        assert not await tx.sources.job_has_tasks(unkeyed)
        assert not await tx.sources.job_has_tasks(none)


async def test_clear_operator_state_deletes_the_jobs_rows_only(
    repo: SqlRepository, clock: ManualClock
) -> None:
    org_id, [job_id, other] = await make_jobs(repo, clock, 2)
    o = schema.operator_state
    async with repo.transaction() as tx:
        await tx.connection.execute(
            sa.insert(o),
            [
                {"org_id": org_id, "job_id": job_id, "state_key": "a", "updated_at": _EPOCH},
                {"org_id": org_id, "job_id": job_id, "state_key": "b", "updated_at": _EPOCH},
                {"org_id": org_id, "job_id": other, "state_key": "a", "updated_at": _EPOCH},
            ],
        )
    async with repo.transaction() as tx:
        assert await tx.sources.clear_operator_state(uuid.uuid4(), job_id) == 0
        assert await tx.sources.clear_operator_state(org_id, job_id) == 2
        assert await tx.sources.clear_operator_state(org_id, job_id) == 0
    async with repo.read() as tx:
        left = (await tx.connection.execute(sa.select(o.c.job_id, o.c.state_key))).all()
    assert [tuple(r) for r in left] == [(other, "a")]


# --- the always-on run ------------------------------------------------------------


async def test_source_states_join_the_run_and_leave_out_jobs_without_a_row(
    repo: SqlRepository, clock: ManualClock
) -> None:
    _, [with_run, without_run, no_row] = await make_jobs(repo, clock, 3)
    task_id = await make_task(repo, clock, with_run, dedupe_key="run", status="Running")
    await set_job_state(
        repo, with_run, source_status=RUNNING, source_task_id=task_id, source_restarts=2
    )
    await set_job_state(repo, without_run, paused=True)
    async with repo.read() as tx:
        states = await tx.sources.source_states([with_run, without_run, no_row])
        assert await tx.sources.source_states([]) == {}
    assert states == {
        with_run: SourceState(
            RUNNING, task_id, 2, False, SourceRun(task_id, "Running", 1, 0, None, None)
        ),
        without_run: SourceState(None, None, 0, True, None),
    }


async def test_active_sources_are_those_with_a_status_other_than_stopped(
    repo: SqlRepository, clock: ManualClock
) -> None:
    _, [pending, dead, draining, stopped, unset] = await make_jobs(repo, clock, 5)
    task_id = await make_task(repo, clock, pending, dedupe_key="run")
    await set_job_state(repo, pending, source_status=PENDING, source_task_id=task_id)
    await set_job_state(repo, dead, source_status=DEAD)
    await set_job_state(repo, draining, source_status=DRAINING)
    await set_job_state(repo, stopped, source_status=STOPPED)
    await set_job_state(repo, unset)
    async with repo.read() as tx:
        active = await tx.sources.active_sources()
    assert sorted(active, key=lambda r: r[1]) == [
        (dead, DEAD, None),
        (draining, DRAINING, None),
        (pending, PENDING, task_id),
    ]


async def test_start_run_if_previous_sets_a_pending_run_only_over_the_expected_one(
    repo: SqlRepository, clock: ManualClock
) -> None:
    _, [job_id] = await make_jobs(repo, clock, 1)
    first = await make_task(repo, clock, job_id, dedupe_key="1")
    second = await make_task(repo, clock, job_id, dedupe_key="2")
    now = clock.now()
    async with repo.transaction() as tx:
        assert await tx.sources.start_run_if_previous(job_id, previous=None, task_id=first, now=now)
    async with repo.transaction() as tx:
        await tx.connection.execute(
            sa.update(schema.job_states).values(source_status=STOPPED, source_restarts=4)
        )
    async with repo.transaction() as tx:
        # Someone else started a run already: "no run yet" no longer holds.
        assert not await tx.sources.start_run_if_previous(
            job_id, previous=None, task_id=second, now=now
        )
        assert not await tx.sources.start_run_if_previous(
            job_id, previous=second, task_id=second, now=now
        )
    row = await job_state_row(repo, job_id)
    assert row is not None
    assert (row["source_task_id"], row["source_status"], row["source_restarts"]) == (
        first,
        STOPPED,
        4,
    )
    async with repo.transaction() as tx:
        assert await tx.sources.start_run_if_previous(
            job_id, previous=first, task_id=second, now=now
        )
    row = await job_state_row(repo, job_id)
    assert row is not None
    assert (row["source_task_id"], row["source_status"], row["source_restarts"]) == (
        second,
        PENDING,
        0,
    )


async def test_set_run_status_if_current_needs_both_the_run_and_the_status(
    repo: SqlRepository, clock: ManualClock
) -> None:
    _, [job_id] = await make_jobs(repo, clock, 1)
    run = await make_task(repo, clock, job_id, dedupe_key="run")
    await set_job_state(repo, job_id, source_task_id=run)
    now = clock.now()
    async with repo.transaction() as tx:
        op = tx.sources.set_run_status_if_current
        # A NULL status is matched by None, not by a string.
        assert not await op(
            job_id, task_id=run, expected=PENDING, status=RUNNING, restarts=1, now=now
        )
        assert not await op(
            job_id, task_id=uuid.uuid4(), expected=None, status=RUNNING, restarts=1, now=now
        )
        assert await op(job_id, task_id=run, expected=None, status=RUNNING, restarts=1, now=now)
        assert not await op(job_id, task_id=run, expected=None, status=DEAD, restarts=2, now=now)
        assert await op(job_id, task_id=run, expected=RUNNING, status=DEAD, restarts=2, now=now)
    row = await job_state_row(repo, job_id)
    assert row is not None
    assert (row["source_task_id"], row["source_status"], row["source_restarts"]) == (run, DEAD, 2)


async def test_set_source_status_if_status_leaves_the_run_alone(
    repo: SqlRepository, clock: ManualClock
) -> None:
    _, [job_id, fresh] = await make_jobs(repo, clock, 2)
    run = await make_task(repo, clock, job_id, dedupe_key="run")
    await set_job_state(repo, job_id, source_status=DEAD, source_task_id=run, source_restarts=3)
    now = clock.now()
    async with repo.transaction() as tx:
        assert not await tx.sources.set_source_status_if_status(
            job_id, expected=None, status=STOPPED, now=now
        )
        assert await tx.sources.set_source_status_if_status(
            job_id, expected=DEAD, status=STOPPED, now=now
        )
        # No row yet: created, and its NULL status matches None.
        assert await tx.sources.set_source_status_if_status(
            fresh, expected=None, status=DEAD, now=now
        )
    row = await job_state_row(repo, job_id)
    assert row is not None
    assert (row["source_status"], row["source_task_id"], row["source_restarts"]) == (
        STOPPED,
        run,
        3,
    )
    fresh_row = await job_state_row(repo, fresh)
    assert fresh_row is not None and fresh_row["source_status"] == DEAD


async def test_running_sources_are_drained_once_while_their_task_runs(
    repo: SqlRepository, clock: ManualClock
) -> None:
    _, [running, queued_run, pending, no_row] = await make_jobs(repo, clock, 4)
    task_id = await make_task(repo, clock, running, dedupe_key="run", status="Running")
    queued = await make_task(repo, clock, queued_run, dedupe_key="run")
    other = await make_task(repo, clock, pending, dedupe_key="run", status="Running")
    await set_job_state(repo, running, source_status=RUNNING, source_task_id=task_id)
    await set_job_state(repo, queued_run, source_status=RUNNING, source_task_id=queued)
    await set_job_state(repo, pending, source_status=PENDING, source_task_id=other)
    async with repo.read() as tx:
        assert await tx.sources.running_sources() == [running]
    later = clock.advance(5)
    async with repo.transaction() as tx:
        await tx.job_states.lock([running, queued_run, pending, no_row])
        await tx.job_states.lock([])
        assert await tx.sources.drain_run_if_running(running, now=later) == task_id
        assert await tx.sources.drain_run_if_running(running, now=later) is None
        assert await tx.sources.drain_run_if_running(queued_run, now=later) is None
        assert await tx.sources.drain_run_if_running(pending, now=later) is None
        assert await tx.sources.drain_run_if_running(no_row, now=later) is None
    drained = await job_state_row(repo, running)
    assert drained is not None
    assert (drained["source_status"], drained["updated_at"]) == (DRAINING, later)
    for job_id, status in ((queued_run, RUNNING), (pending, PENDING)):
        row = await job_state_row(repo, job_id)
        assert row is not None and row["source_status"] == status
    assert await job_state_row(repo, no_row) is None  # neither op creates a row


async def test_run_directive_state_by_the_run_task(repo: SqlRepository, clock: ManualClock) -> None:
    _, [job_id] = await make_jobs(repo, clock, 1)
    run = await make_task(repo, clock, job_id, dedupe_key="run")
    await set_job_state(repo, job_id, source_status=DRAINING, source_task_id=run, paused=True)
    async with repo.read() as tx:
        assert await tx.sources.run_directive_state(run) == (DRAINING, True)
        assert await tx.sources.run_directive_state(uuid.uuid4()) is None


# --- cron schedules -----------------------------------------------------------------


async def test_cron_states_of_the_jobs_and_of_every_scheduled_job(
    repo: SqlRepository, clock: ManualClock
) -> None:
    _, [asked, scheduled, unscheduled, no_row] = await make_jobs(repo, clock, 4)
    fire = clock.now() + timedelta(minutes=1)
    await set_job_state(repo, asked, source_status=DEAD)
    await set_job_state(repo, scheduled, next_fire_at=fire)
    await set_job_state(repo, unscheduled)
    async with repo.read() as tx:
        states = await tx.sources.cron_states([asked, no_row])
        only_scheduled = await tx.sources.cron_states([])
    assert states == {asked: CronState(None, DEAD), scheduled: CronState(fire, None)}
    assert only_scheduled == {scheduled: CronState(fire, None)}


async def test_cron_schedule_advance_and_clear_are_compare_and_set(
    repo: SqlRepository, clock: ManualClock
) -> None:
    _, [job_id] = await make_jobs(repo, clock, 1)
    now = clock.now()
    first, second, third = (now + timedelta(minutes=m) for m in (1, 2, 3))
    async with repo.transaction() as tx:
        assert await tx.sources.schedule_cron_if_unscheduled(job_id, first=first, now=now)
        assert not await tx.sources.schedule_cron_if_unscheduled(job_id, first=third, now=now)
        assert not await tx.sources.advance_cron_if_next_fire(
            job_id, expected=second, next_fire_at=third, now=now
        )
        assert await tx.sources.advance_cron_if_next_fire(
            job_id, expected=first, next_fire_at=second, now=now
        )
        await tx.sources.record_cron_fire(job_id, fired_at=first, now=now)
        assert not await tx.sources.clear_cron_if_next_fire(job_id, expected=first, now=now)
    row = await job_state_row(repo, job_id)
    assert row is not None
    assert (row["next_fire_at"], row["last_fired_at"]) == (second, first)
    async with repo.transaction() as tx:
        assert await tx.sources.clear_cron_if_next_fire(job_id, expected=second, now=now)
    row = await job_state_row(repo, job_id)
    assert row is not None
    assert (row["next_fire_at"], row["last_fired_at"]) == (None, first)


async def test_record_cron_fire_creates_the_row(repo: SqlRepository, clock: ManualClock) -> None:
    _, [job_id] = await make_jobs(repo, clock, 1)
    async with repo.transaction() as tx:
        await tx.sources.record_cron_fire(job_id, fired_at=clock.now(), now=clock.now())
    row = await job_state_row(repo, job_id)
    assert row is not None and row["last_fired_at"] == clock.now()


# --- pauses and the journal ---------------------------------------------------------


# --- the launch area ------------------------------------------------------------------


async def test_startable_tasks_are_the_queued_ones_with_their_runtime(
    repo: SqlRepository, clock: ManualClock
) -> None:
    _, [spark_job] = await make_jobs(repo, clock, 1)
    _, [lambda_job] = await make_jobs(repo, clock, 1, runtime="lambda")
    queued = await make_task(repo, clock, spark_job)
    other = await make_task(repo, clock, lambda_job)
    running = await make_task(repo, clock, spark_job, status="Running")
    canceled = await make_task(repo, clock, lambda_job, status="Canceled")
    async with repo.read() as tx:
        found = await tx.launch.startable_tasks([queued, other, running, canceled, uuid.uuid4()])
        assert await tx.launch.startable_tasks([]) == []
    assert sorted(found, key=lambda t: t.runtime) == [
        StartableTask(other, "lambda", "op0"),
        StartableTask(queued, "spark", "op0"),
    ]
