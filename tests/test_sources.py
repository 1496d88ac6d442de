"""Source jobs on both engines: always-on runs, cron fires, manual triggers,
bootstrap; and a running Dispatcher's loops woken by deploys, promotions and
rollbacks, also by a deploy from another process (Postgres)."""

from __future__ import annotations

import contextlib
import sys
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
import sqlalchemy as sa

from tests.factories import set_progress, wait_until
from trace_core.authoring.context import OperatorResult, TaskContext
from trace_core.authoring.events import DatasetEvent
from trace_core.authoring.operators import OperatorRegistry, OperatorSpec
from trace_core.clock import ManualClock
from trace_core.dag import DeployResult, deploy, live_jobs, parse_dag
from trace_core.dispatcher.backfill import BackfillConfig
from trace_core.dispatcher.cron import CronConfig, CronSchedule, CronScheduler, cron_key
from trace_core.dispatcher.events import EventGateway, Producer
from trace_core.dispatcher.journal import read_journal
from trace_core.dispatcher.manual import ManualTrigger
from trace_core.dispatcher.periodic import PeriodicService
from trace_core.dispatcher.promoter import PromoterConfig
from trace_core.dispatcher.reaper import Reaper, lease_seconds_for
from trace_core.dispatcher.retry_scheduler import RetryScheduler
from trace_core.dispatcher.service import Dispatcher, DispatcherConfig
from trace_core.dispatcher.source_runs import source_run_key
from trace_core.dispatcher.sources import SourceConfig, SourceDirective, SourceSupervisor
from trace_core.errors import ConfigurationError, NotFound, StaleClaim
from trace_core.model import Lease
from trace_core.retry import Backoff, RetryPolicy
from trace_core.storage import schema
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import TaskQueue

pytestmark = pytest.mark.anyio

NO_JITTER = RetryPolicy(normal=Backoff(base_seconds=1, cap_seconds=60, jitter=0))

DAG = """
dag: feeds
jobs:
  - name: follow
    activation: source
    runtime: dispatcher
    operator: block_follower
    source: {kind: always_on}
    heartbeat_timeout_seconds: 20
    outputs: [{dataset: blocks}]
  - name: tick
    activation: source
    runtime: dispatcher
    operator: cron_tick
    source: {kind: cron, schedule: "*/10 * * * *"}
    outputs: [{dataset: ticks}]
  - name: upload
    activation: source
    runtime: dispatcher
    operator: noop
    source: {kind: manual}
    outputs: [{dataset: uploads}]
"""


class Platform:
    """The services under test around one database and one manual clock."""

    def __init__(self, repo: SqlRepository, clock: ManualClock) -> None:
        self.repo = repo
        self.clock = clock
        self.tasks = TaskQueue(repo, clock=clock, retry=NO_JITTER)
        self.supervisor = self.new_supervisor()
        self.cron = self.new_cron()
        self.reaper = Reaper(repo, clock=clock, tasks=self.tasks)
        self.retries = RetryScheduler(repo, clock=clock, tasks=self.tasks)

    def new_supervisor(self) -> SourceSupervisor:
        """A supervisor object as a restarted Dispatcher would build it."""
        return SourceSupervisor(self.repo, clock=self.clock, tasks=self.tasks)

    def new_cron(self) -> CronScheduler:
        return CronScheduler(self.repo, clock=self.clock, tasks=self.tasks)

    async def deploy(self, text: str = DAG) -> DeployResult:
        return await deploy(self.repo, parse_dag(text), clock=self.clock)

    async def state_if_any(self, job_id: uuid.UUID) -> Any:
        """The job's ``job_states`` row, or ``None`` before a service wrote it."""
        s = schema.job_states
        async with self.repo.read() as t:
            query = sa.select(s).where(s.c.job_id == job_id)
            return (await t.connection.execute(query)).one_or_none()

    async def state(self, job_id: uuid.UUID) -> Any:
        row = await self.state_if_any(job_id)
        assert row is not None, f"job {job_id} has no job_states row"
        return row

    async def task(self, task_id: uuid.UUID) -> Any:
        t_ = schema.tasks
        async with self.repo.read() as t:
            return (await t.connection.execute(sa.select(t_).where(t_.c.id == task_id))).one()

    async def tasks_of(self, job_id: uuid.UUID) -> list[Any]:
        t_ = schema.tasks
        async with self.repo.read() as t:
            rows = await t.connection.execute(
                sa.select(t_).where(t_.c.job_id == job_id).order_by(t_.c.created_at, t_.c.id)
            )
            return list(rows)

    async def journal(self, job_id: uuid.UUID) -> list[str]:
        """Journal kinds, oldest first."""
        async with self.repo.read() as t:
            entries = await read_journal(t, job_id, limit=200)
        return [e["kind"] for e in reversed(entries)]

    async def claim(self, task_id: uuid.UUID, worker: str) -> Lease:
        """Claim as the claim path does: with the job's heartbeat timeout as lease."""
        job_id = (await self.task(task_id)).job_id
        async with self.repo.read() as t:
            [job] = [j for j in await live_jobs(t) if j.job_id == job_id]
        outcome = await self.tasks.leases.claim(
            task_id, worker, lease_seconds=lease_seconds_for(job)
        )
        assert outcome.lease is not None, outcome.reason
        return outcome.lease

    async def set_paused(self, job_id: uuid.UUID, paused: bool) -> None:
        s = schema.job_states
        async with self.repo.transaction() as t:
            await t.connection.execute(
                t.insert(s)
                .values(job_id=job_id, updated_at=self.clock.now())
                .on_conflict_do_nothing()
            )
            await t.connection.execute(
                sa.update(s)
                .where(s.c.job_id == job_id)
                .values(paused=paused, pause_reason="queue depth 1200 > 1000" if paused else None)
            )


@pytest.fixture
def platform(repo: SqlRepository, clock: ManualClock) -> Platform:
    return Platform(repo, clock)


# --- always_on ----------------------------------------------------------------


async def test_always_on_restart_keeps_the_run_id_and_fences_the_old_attempt(
    platform: Platform, clock: ManualClock
) -> None:
    dag = await platform.deploy()
    job = dag.jobs["follow"]
    blocks = dag.datasets["blocks"]
    report = await platform.supervisor.run_once()
    [run] = report.runs_created
    assert (await platform.state(job)).source_status == "Pending"
    assert (await platform.task(run)).dedupe_key == source_run_key(job)

    first = await platform.claim(run, "worker-a")
    await platform.supervisor.run_once()
    assert (await platform.state(job)).source_status == "Running"

    # The worker stops heartbeating: its 20 s lease (the job's heartbeat timeout) expires.
    clock.advance(21)
    reaped = await platform.reaper.run_once()
    assert reaped.expired == 1 and reaped.retried == 1
    await platform.supervisor.run_once()
    state = await platform.state(job)
    assert (state.source_status, state.source_restarts) == ("Dead", 1)
    assert (await platform.task(run)).error_message == "lease expired: no heartbeat within 20 s"

    clock.advance(1)  # the first retry's backoff (no jitter)
    assert await platform.retries.run_once() == [run]
    await platform.supervisor.run_once()
    assert (await platform.state(job)).source_status == "Pending"

    second = await platform.claim(run, "worker-b")
    assert (second.item_id, second.attempt) == (run, first.attempt + 1)
    await platform.supervisor.run_once()
    state = await platform.state(job)
    assert (state.source_status, state.source_task_id, state.source_restarts) == (
        "Running",
        run,
        1,
    )

    # The old attempt is fenced out: its heartbeat and its events are refused.
    with pytest.raises(StaleClaim):
        await platform.tasks.heartbeat(first.fence)
    gateway = EventGateway(platform.repo, clock=clock)
    event = DatasetEvent(blocks.dataset_uuid, blocks.dataset_version, cursor=100)
    with pytest.raises(StaleClaim):
        await gateway.accept([event], producer=Producer(run, first.attempt))
    accepted = await gateway.accept([event], producer=Producer(run, second.attempt))
    assert accepted.new == 1

    assert await platform.journal(job) == [
        "source_start",
        "source_running",
        "source_dead",
        "source_restart",
        "source_running",
    ]
    assert len(await platform.tasks_of(job)) == 1


async def test_passes_are_idempotent(platform: Platform) -> None:
    dag = await platform.deploy()
    job = dag.jobs["follow"]
    await platform.supervisor.run_once()
    again = await platform.supervisor.run_once()
    other = await platform.new_supervisor().run_once()
    assert again.runs_created == other.runs_created == []
    assert again.transitions == other.transitions == []
    assert len(await platform.tasks_of(job)) == 1
    assert (await platform.journal(job)).count("source_start") == 1


async def test_a_missed_death_is_seen_as_a_restart(platform: Platform, clock: ManualClock) -> None:
    """Death, retry and reclaim all between two passes: still counted and journaled."""
    dag = await platform.deploy()
    job = dag.jobs["follow"]
    [run] = (await platform.supervisor.run_once()).runs_created
    await platform.claim(run, "worker-a")
    await platform.supervisor.run_once()
    clock.advance(21)
    await platform.reaper.run_once()
    clock.advance(1)
    await platform.retries.run_once()
    await platform.claim(run, "worker-b")
    report = await platform.supervisor.run_once()
    job_transitions = [tr for tr in report.transitions if tr[0] == job]
    assert job_transitions == [(job, "Running", "Running")]  # Running again ...
    state = await platform.state(job)
    assert (state.source_status, state.source_restarts) == ("Running", 1)  # ... one restart later
    assert (await platform.journal(job))[-1] == "source_restart"


async def test_drain_stops_the_run_and_a_new_dispatcher_starts_a_new_one(
    platform: Platform,
) -> None:
    dag = await platform.deploy()
    job = dag.jobs["follow"]
    [run] = (await platform.supervisor.run_once()).runs_created
    lease = await platform.claim(run, "worker-a")
    await platform.supervisor.run_once()

    assert await platform.supervisor.directive(run) is SourceDirective.RUN
    assert await platform.supervisor.drain() == [job]
    assert (await platform.state(job)).source_status == "Draining"
    assert await platform.supervisor.directive(run) is SourceDirective.STOP

    await platform.tasks.complete(lease.fence)  # the source stops cleanly
    report = await platform.supervisor.run_once()
    assert report.transitions == [(job, "Draining", "Stopped")]
    assert report.runs_created == []  # a draining supervisor starts nothing
    assert (await platform.supervisor.run_once()).runs_created == []

    restarted = platform.new_supervisor()
    [new_run] = (await restarted.run_once()).runs_created
    assert new_run != run
    assert (await platform.task(new_run)).dedupe_key == source_run_key(job, run)
    state = await platform.state(job)
    assert (state.source_status, state.source_task_id, state.source_restarts) == (
        "Pending",
        new_run,
        0,
    )
    assert await restarted.directive(new_run) is SourceDirective.RUN
    assert (await restarted.run_once()).runs_created == []
    kinds = await platform.journal(job)
    assert kinds[-3:] == ["source_draining", "source_stopped", "source_start"]


async def test_a_leftover_drain_is_lifted_while_the_run_lives(platform: Platform) -> None:
    dag = await platform.deploy()
    job = dag.jobs["follow"]
    [run] = (await platform.supervisor.run_once()).runs_created
    await platform.claim(run, "worker-a")
    await platform.supervisor.run_once()
    await platform.supervisor.drain()
    # The Dispatcher died before the source stopped; the next one keeps the run.
    report = await platform.new_supervisor().run_once()
    assert report.transitions == [(job, "Draining", "Running")]
    assert report.runs_created == []


async def test_paused_source_is_not_started(platform: Platform) -> None:
    dag = await platform.deploy()
    job = dag.jobs["follow"]
    await platform.set_paused(job, True)
    assert (await platform.supervisor.run_once()).runs_created == []
    assert await platform.tasks_of(job) == []
    await platform.set_paused(job, False)
    [run] = (await platform.supervisor.run_once()).runs_created
    await platform.set_paused(job, True)
    assert await platform.supervisor.directive(run) is SourceDirective.PAUSE


async def test_superseded_source_run_is_canceled(platform: Platform) -> None:
    old = await platform.deploy()
    job, tick = old.jobs["follow"], old.jobs["tick"]
    [run] = (await platform.supervisor.run_once()).runs_created
    assert (await platform.cron.run_once()).scheduled == [tick]
    lease = await platform.claim(run, "worker-a")
    await platform.supervisor.run_once()

    # A new version that adds a job swaps at once; the old jobs are no longer live.
    new = await platform.deploy(
        DAG
        + """
  - name: extra
    activation: source
    runtime: dispatcher
    operator: noop
    source: {kind: manual}
    outputs: [{dataset: extras}]
"""
    )
    assert new.status == "current" and new.jobs["follow"] != job
    report = await platform.supervisor.run_once()
    assert job in report.retired
    assert (await platform.task(run)).status == "Canceled"
    assert (await platform.state(job)).source_status == "Stopped"
    assert (await platform.journal(job))[-1] == "source_retired"
    with pytest.raises(StaleClaim):
        await platform.tasks.heartbeat(lease.fence)
    # The new version's source gets its own run; the old one stays stopped.
    assert len(report.runs_created) == 1
    assert (await platform.state(new.jobs["follow"])).source_status == "Pending"
    assert (await platform.supervisor.run_once()).retired == []
    # The old cron job's schedule is cleared; the new one's starts.
    cron = await platform.cron.run_once()
    assert (cron.retired, cron.scheduled) == ([tick], [new.jobs["tick"]])
    assert (await platform.state(tick)).next_fire_at is None
    assert (await platform.cron.run_once()).retired == []


# --- bootstrap.reset_outputs ---------------------------------------------------


async def test_reset_outputs_clears_operator_state_once(
    platform: Platform, clock: ManualClock
) -> None:
    dag = await platform.deploy(
        DAG.replace("heartbeat_timeout_seconds: 20", "bootstrap: {reset_outputs: true}")
    )
    job = dag.jobs["follow"]
    o = schema.operator_state

    async def put_state(key: str) -> None:
        async with platform.repo.transaction() as t:
            org = (
                await t.connection.execute(
                    sa.select(schema.jobs.c.org_id).where(schema.jobs.c.id == job)
                )
            ).scalar_one()
            await t.connection.execute(
                sa.insert(o).values(
                    org_id=org,
                    job_id=job,
                    state_key=key,
                    state={"cursor": 7},
                    updated_at=clock.now(),
                )
            )

    async def state_keys() -> list[str]:
        async with platform.repo.read() as t:
            rows = await t.connection.execute(sa.select(o.c.state_key).where(o.c.job_id == job))
            return sorted(r[0] for r in rows)

    await put_state("default")
    await put_state("ranges")
    [run] = (await platform.supervisor.run_once()).runs_created
    assert (await platform.task(run)).input_versions == {"bootstrap": {"reset_outputs": True}}
    assert await state_keys() == []
    assert (await platform.journal(job))[0] == "bootstrap_reset"

    # State the run writes survives a restart (same run) and a later run.
    await put_state("default")
    await platform.claim(run, "worker-a")
    clock.advance(31)  # no heartbeat: dies
    await platform.reaper.run_once()
    clock.advance(1)
    await platform.retries.run_once()
    lease = await platform.claim(run, "worker-b")
    assert lease.attempt == 2
    await platform.tasks.complete(lease.fence)  # the run ends on its own
    await platform.supervisor.run_once()  # Stopped
    [new_run] = (await platform.supervisor.run_once()).runs_created
    assert (await platform.task(new_run)).input_versions is None
    assert await state_keys() == ["default"]
    kinds = await platform.journal(job)
    assert kinds.count("bootstrap_reset") == 1
    assert kinds[-2:] == ["source_stopped", "source_start"]


# --- cron -------------------------------------------------------------------------


async def test_cron_fires_once_per_time_across_a_jump_and_a_restart(
    platform: Platform, clock: ManualClock
) -> None:
    dag = await platform.deploy()
    job = dag.jobs["tick"]
    start = clock.now()  # 2026-01-01T00:00:00Z
    await platform.cron.run_once()
    assert (await platform.state(job)).next_fire_at == start + timedelta(minutes=10)
    assert await platform.tasks_of(job) == []

    clock.advance(minutes=10)
    first = await platform.cron.run_once()
    assert len(first.fired) == 1
    assert (await platform.cron.run_once()).fired == []  # same instant: no refire
    clock.advance(minutes=5)
    assert (await platform.cron.run_once()).fired == []

    # The Dispatcher was down for an hour: one fire for the whole missed window.
    clock.advance(hours=1)  # 01:15
    jumped = await platform.cron.run_once()
    assert len(jumped.fired) == 1
    state = await platform.state(job)
    assert state.last_fired_at == start + timedelta(hours=1, minutes=10)
    assert state.next_fire_at == start + timedelta(hours=1, minutes=20)

    # A restarted Dispatcher (new supervisor, same database) does not fire again.
    restarted = platform.new_cron()
    assert (await restarted.run_once()).fired == []
    clock.advance(minutes=5)  # 01:20
    assert len((await restarted.run_once()).fired) == 1
    assert (await platform.cron.run_once()).fired == []

    tasks = await platform.tasks_of(job)
    assert [t.dedupe_key for t in tasks] == [
        f"cron:{job}:2026-01-01T00:10:00+00:00",
        f"cron:{job}:2026-01-01T01:10:00+00:00",
        f"cron:{job}:2026-01-01T01:20:00+00:00",
    ]
    assert tasks[0].dedupe_key == cron_key(job, start + timedelta(minutes=10))
    assert tasks[1].input_versions == {
        "cron": {"fire_at": "2026-01-01T01:10:00+00:00", "missed": 5}
    }
    assert await platform.journal(job) == ["cron_scheduled"] + ["cron_fired"] * 3


async def test_cron_fire_while_paused_is_skipped_and_journaled(
    platform: Platform, clock: ManualClock
) -> None:
    dag = await platform.deploy()
    job = dag.jobs["tick"]
    await platform.cron.run_once()
    await platform.set_paused(job, True)
    clock.advance(minutes=10)
    report = await platform.cron.run_once()
    assert report.skipped == [job] and report.fired == []
    assert await platform.tasks_of(job) == []
    async with platform.repo.read() as t:
        [entry, *_] = await read_journal(t, job)
    assert entry["kind"] == "cron_skipped"
    assert "paused by backpressure (queue depth 1200 > 1000)" in entry["message"]
    await platform.set_paused(job, False)
    assert (await platform.cron.run_once()).fired == []  # skipped, not deferred
    clock.advance(minutes=10)
    assert len((await platform.cron.run_once()).fired) == 1


async def test_cron_timezone_and_draining(platform: Platform, clock: ManualClock) -> None:
    dag = await platform.deploy(
        DAG.replace('schedule: "*/10 * * * *"', 'schedule: "0 9 * * *", timezone: Europe/Berlin')
    )
    job = dag.jobs["tick"]
    await platform.cron.run_once()
    # 09:00 in Berlin in January is 08:00 UTC.
    assert (await platform.state(job)).next_fire_at == datetime(2026, 1, 1, 8, tzinfo=UTC)
    await platform.cron.drain()
    clock.advance(hours=9)
    assert (await platform.cron.run_once()).fired == []  # draining: none
    assert len((await platform.new_cron().run_once()).fired) == 1


async def test_cron_schedule_unit() -> None:
    every_10 = CronSchedule("*/10 * * * *")
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    assert every_10.next_after(t0) == t0 + timedelta(minutes=10)
    assert every_10.last_at_or_before(t0 + timedelta(minutes=10)) == t0 + timedelta(minutes=10)
    assert every_10.last_at_or_before(t0 + timedelta(minutes=9, seconds=59)) == t0
    assert every_10.due(t0 + timedelta(minutes=10), t0 + timedelta(minutes=9)) is None
    due = every_10.due(t0 + timedelta(minutes=10), t0 + timedelta(minutes=35, microseconds=5))
    assert due is not None
    assert (due.fire_at, due.missed, due.next_fire_at) == (
        t0 + timedelta(minutes=30),
        2,
        t0 + timedelta(minutes=40),
    )
    capped = CronSchedule("* * * * *", scan_limit=3).due(t0, t0 + timedelta(hours=1))
    assert capped is not None and capped.missed == 3
    with pytest.raises(ConfigurationError, match="bad cron schedule"):
        CronSchedule("every day")
    with pytest.raises(ConfigurationError, match="unknown time zone"):
        CronSchedule("0 9 * * *", "Mars/Olympus")


# --- manual -------------------------------------------------------------------------


async def test_manual_task_is_idempotent_per_key(platform: Platform) -> None:
    dag = await platform.deploy()
    job = dag.jobs["upload"]
    trigger = ManualTrigger(platform.repo, clock=platform.clock, tasks=platform.tasks)
    first = await trigger.create_task("upload", "2026-01-01-batch")
    again = await trigger.create_task(job, "2026-01-01-batch")
    by_path = await trigger.create_task("feeds/upload", "2026-01-01-batch")
    assert first.created and not again.created and not by_path.created
    assert first.task_id == again.task_id == by_path.task_id
    assert first.task_id is not None
    task = await platform.task(first.task_id)
    assert task.dedupe_key == "manual:2026-01-01-batch"
    assert task.input_versions == {"manual": {"key": "2026-01-01-batch"}}
    assert (await platform.journal(job)) == ["manual_task"]

    await platform.set_paused(job, True)
    refused = await trigger.create_task("upload", "another")
    assert (refused.task_id, refused.refused) == (None, "paused by backpressure")
    assert len(await platform.tasks_of(job)) == 1

    with pytest.raises(ConfigurationError, match="not a manual one"):
        await trigger.create_task("follow", "k")
    with pytest.raises(NotFound):
        await trigger.create_task("nope", "k")
    with pytest.raises(ConfigurationError, match="key"):
        await trigger.create_task("upload", "  ")


async def test_manual_events_go_through_the_gateway(platform: Platform) -> None:
    dag = await platform.deploy()
    uploads = dag.datasets["uploads"]
    trigger = ManualTrigger(platform.repo, clock=platform.clock)
    event = DatasetEvent(uploads.dataset_uuid, uploads.dataset_version, partition_key="a")
    first = await trigger.emit([event])
    again = await trigger.emit([event])
    assert (first.new, again.duplicates) == (1, 1)
    e = schema.events
    async with platform.repo.read() as t:
        row = (await t.connection.execute(sa.select(e.c.origin, e.c.producer_task_id))).one()
    assert tuple(row) == ("manual", None)


async def test_configs_are_validated() -> None:
    with pytest.raises(ConfigurationError):
        CronConfig(interval_seconds=0)
    with pytest.raises(ConfigurationError):
        CronConfig(scan_limit=0)
    with pytest.raises(ConfigurationError):
        SourceConfig(interval_seconds=0)
    with pytest.raises(ConfigurationError):
        SourceConfig(run_max_attempts=2**31)


async def test_services_with_nothing_deployed(repo: SqlRepository, clock: ManualClock) -> None:
    cron = await CronScheduler(repo, clock=clock).run_once()
    assert (cron.fired, cron.skipped, cron.scheduled, cron.retired) == ([], [], [], [])
    report = await SourceSupervisor(repo, clock=clock).run_once()
    assert (report.runs_created, report.transitions, report.retired) == ([], [], [])
    assert await SourceSupervisor(repo, clock=clock).drain() == []


# --- deploys, promotions and rollbacks wake the loops ------------------------------

HOUR = 3600.0
WAKE_BOUND = 30.0
"""Seconds a woken loop may take to act (it takes milliseconds; the interval is an hour)."""

ASLEEP = DispatcherConfig(
    sources=SourceConfig(interval_seconds=HOUR),
    cron=CronConfig(interval_seconds=HOUR),
    promoter=PromoterConfig(interval_seconds=HOUR),
    backfill=BackfillConfig(interval_seconds=HOUR),
)
"""Every loop that acts on live jobs passes once at start, then not for an hour."""


async def _never_runs(ctx: TaskContext) -> OperatorResult:
    raise AssertionError("queued tasks are not run in these tests")


# Tasks go to an in-memory worker queue nobody reads: they stay as created.
QUEUED_DAG = DAG.replace("runtime: dispatcher", "runtime: ecs_platform")
QUEUED_OPERATORS = OperatorRegistry(
    [OperatorSpec(name, _never_runs) for name in ("block_follower", "cron_tick", "noop")]
)
ALWAYS_ON = "source: {kind: always_on}"
GENERATION_2 = "\n    config: {generation: 2}"
"""Appended to ``ALWAYS_ON``: a follower config that re-versions its outputs."""


@contextlib.asynccontextmanager
async def _running(dispatcher: Dispatcher) -> AsyncIterator[None]:
    async with anyio.create_task_group() as group:
        await dispatcher.start(group)
        try:
            yield
        finally:
            await dispatcher.stop()
            group.cancel_scope.cancel()


def _count_passes(monkeypatch: pytest.MonkeyPatch, service: PeriodicService) -> list[object]:
    """The reports of ``service``'s passes, appended as each pass ends."""
    reports: list[object] = []
    run_once = service.run_once

    async def counted() -> object:
        report = await run_once()
        reports.append(report)
        return report

    monkeypatch.setattr(service, "run_once", counted)
    return reports


def _parsed(text: str) -> Any:
    return parse_dag(text, operators=QUEUED_OPERATORS.names())


async def _progress(repo: SqlRepository, pointer: Any, clock: ManualClock) -> None:
    """Blocks 0-99 written to the dataset version ``pointer``."""
    await set_progress(repo, pointer.dataset_version, pointer.dataset_uuid, [[0, 99]], None, clock)


async def _until(what: str, condition: Any, platform: Platform, job_id: uuid.UUID) -> None:
    await wait_until(
        what,
        condition,
        time.monotonic() + WAKE_BOUND,
        describe=lambda: platform.tasks_of(job_id),
    )


async def test_a_deploy_wakes_the_source_supervisor_and_cron(
    repo: SqlRepository, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    platform = Platform(repo, clock)
    dispatcher = Dispatcher(repo, operators=QUEUED_OPERATORS, clock=clock, config=ASLEEP)
    sources = _count_passes(monkeypatch, dispatcher.sources)
    cron = _count_passes(monkeypatch, dispatcher.cron)
    async with _running(dispatcher):
        await wait_until(
            "the first passes (nothing deployed yet)",
            lambda: len(sources) == len(cron) == 1,
            time.monotonic() + WAKE_BOUND,
            describe=lambda: (sources, cron),
        )
        deployed = await dispatcher.deploy(_parsed(QUEUED_DAG))
        follow, tick = deployed.jobs["follow"], deployed.jobs["tick"]

        async def started() -> bool:
            return len(await platform.tasks_of(follow)) == 1

        async def scheduled() -> bool:
            # The cron pass may come after the supervisor's: no row until then.
            row = await platform.state_if_any(tick)
            return row is not None and row.next_fire_at is not None

        await _until("the always-on run created", started, platform, follow)
        await _until("the cron schedule started", scheduled, platform, tick)
    [run] = await platform.tasks_of(follow)
    assert run.dedupe_key == source_run_key(follow)
    assert (await platform.state(follow)).source_status == "Pending"


async def test_a_promotion_and_a_rollback_wake_the_source_supervisor(
    repo: SqlRepository, clock: ManualClock
) -> None:
    platform = Platform(repo, clock)
    dispatcher = Dispatcher(repo, operators=QUEUED_OPERATORS, clock=clock, config=ASLEEP)
    async with _running(dispatcher):
        v1 = await dispatcher.deploy(_parsed(QUEUED_DAG))
        old, blocks_v1 = v1.jobs["follow"], v1.datasets["blocks"]

        async def runs(job_id: uuid.UUID, statuses: list[str]) -> bool:
            return [r.status for r in await platform.tasks_of(job_id)] == statuses

        await _until("v1's run", lambda: runs(old, ["Queued"]), platform, old)

        # v1 has blocks 0-99: a follower with a new config builds a new blocks
        # version, and its DAG version stays building until that catches up.
        await _progress(repo, blocks_v1, clock)
        clock.advance(60)
        v2 = await dispatcher.deploy(
            _parsed(QUEUED_DAG.replace(ALWAYS_ON, ALWAYS_ON + GENERATION_2))
        )
        assert v2.status == "building"
        new, blocks_v2 = v2.jobs["follow"], v2.datasets["blocks"]
        await _until("the building version's run", lambda: runs(new, ["Queued"]), platform, new)

        # Caught up: the promotion swaps v2 in and v1's run stops now.
        await _progress(repo, blocks_v2, clock)
        await dispatcher.promoter.run_once()
        await _until("v1's run retired", lambda: runs(old, ["Canceled"]), platform, old)
        assert (await platform.state(old)).source_status == "Stopped"

        # Rolled back: v1 is current again and its source gets a new run now.
        result = await dispatcher.rollback("feeds")
        assert result.current_version_id == v1.dag_version_id
        await _until("v1's new run", lambda: runs(old, ["Canceled", "Queued"]), platform, old)
    assert [r.status for r in await platform.tasks_of(new)] == ["Canceled"]


async def test_a_deploy_by_another_process_wakes_a_running_dispatcher(
    repo: SqlRepository,
    clock: ManualClock,
    engine: str,
    database_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Postgres: ``trace-lite dag deploy`` run as another OS process starts a
    running Dispatcher's always-on source now, not an interval later."""
    if engine != "postgres":
        pytest.skip("SQLite wake-ups are in-process; the loops' intervals pick such deploys up")
    platform = Platform(repo, clock)
    dispatcher = Dispatcher(repo, operators=QUEUED_OPERATORS, clock=clock, config=ASLEEP)
    sources = _count_passes(monkeypatch, dispatcher.sources)
    dag_file = tmp_path / "feeds.yaml"
    dag_file.write_text(QUEUED_DAG)
    async with _running(dispatcher):
        await wait_until(
            "the first pass (nothing deployed yet)",
            lambda: len(sources) == 1,
            time.monotonic() + WAKE_BOUND,
            describe=lambda: sources,
        )
        command = [sys.executable, "-m", "trace_lite.cli", "dag", "deploy", str(dag_file)]
        done = await anyio.run_process([*command, "--db", database_url], check=False)
        assert done.returncode == 0, done.stderr.decode()
        async with repo.read() as t:
            [follow] = [j.job_id for j in await live_jobs(t) if j.job_name == "follow"]

        async def started() -> bool:
            return len(await platform.tasks_of(follow)) == 1

        await _until("the always-on run created", started, platform, follow)
    [run] = await platform.tasks_of(follow)
    assert run.dedupe_key == source_run_key(follow)
