"""The reaper and the retry scheduler on both engines: expiry, timeouts, retries."""

from __future__ import annotations

import json
import uuid
from typing import Any

import anyio
import pytest
import sqlalchemy as sa

import trace_core.dispatcher.reaper as reaper_module
from trace_core.clock import ManualClock
from trace_core.dag import LiveJob, deploy, live_jobs, parse_dag
from trace_core.dispatcher.journal import read_journal
from trace_core.dispatcher.periodic import PeriodicService
from trace_core.dispatcher.reaper import (
    Reaper,
    ReaperConfig,
    lease_seconds_for,
    lease_seconds_for_task,
)
from trace_core.dispatcher.retry_scheduler import RetryScheduler, RetrySchedulerConfig
from trace_core.errors import ConfigurationError, StaleClaim
from trace_core.model import Lease
from trace_core.retry import Backoff, RetryPolicy
from trace_core.storage import schema
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import ENQUEUE_TASK, TaskQueue

pytestmark = pytest.mark.anyio

NO_JITTER = RetryPolicy(normal=Backoff(base_seconds=1, cap_seconds=60, jitter=0))

DAG = """
dag: jobs
jobs:
  - name: slow
    activation: source
    runtime: dispatcher
    operator: noop
    source: {kind: manual}
    timeout_seconds: 60
    heartbeat_timeout_seconds: 20
    max_attempts: 2
    outputs: [{dataset: slow_out}]
  - name: plain
    activation: source
    runtime: dispatcher
    operator: noop
    source: {kind: manual}
    outputs: [{dataset: plain_out}]
"""


class Setup:
    def __init__(self, repo: SqlRepository, clock: ManualClock) -> None:
        self.repo = repo
        self.clock = clock
        self.tasks = TaskQueue(repo, clock=clock, retry=NO_JITTER)
        self.reaper = Reaper(repo, clock=clock, tasks=self.tasks)
        self.retries = RetryScheduler(repo, clock=clock, tasks=self.tasks)
        self.jobs: dict[str, LiveJob] = {}

    async def deploy(self) -> None:
        await deploy(self.repo, parse_dag(DAG), clock=self.clock)
        async with self.repo.read() as t:
            self.jobs = {j.job_name: j for j in await live_jobs(t)}

    async def task_of(self, name: str) -> uuid.UUID:
        job = self.jobs[name]
        [created] = await self.tasks.create(
            [NewTask(job.job_id, dedupe_key=f"k:{uuid.uuid4()}", max_attempts=job.max_attempts)]
        )
        return created.task_id

    async def claim(self, task_id: uuid.UUID, name: str) -> Lease:
        outcome = await self.tasks.leases.claim(
            task_id, "worker", lease_seconds=lease_seconds_for(self.jobs[name])
        )
        assert outcome.lease is not None, outcome.reason
        return outcome.lease

    async def heartbeat(self, lease: Lease, name: str) -> None:
        await self.tasks.leases.heartbeat(
            lease.fence, lease_seconds=lease_seconds_for(self.jobs[name])
        )

    async def row(self, task_id: uuid.UUID) -> Any:
        t_ = schema.tasks
        async with self.repo.read() as t:
            return (await t.connection.execute(sa.select(t_).where(t_.c.id == task_id))).one()

    async def journal(self, name: str) -> list[Any]:
        async with self.repo.read() as t:
            return list(await read_journal(t, self.jobs[name].job_id))


@pytest.fixture
async def setup(repo: SqlRepository, clock: ManualClock) -> Setup:
    s = Setup(repo, clock)
    await s.deploy()
    return s


async def test_expired_lease_fails_with_its_reason_and_retries(
    setup: Setup, clock: ManualClock
) -> None:
    task = await setup.task_of("slow")
    lease = await setup.claim(task, "slow")
    clock.advance(15)
    await setup.heartbeat(lease, "slow")  # extends to 35 s
    clock.advance(15)
    assert (await setup.reaper.run_once()).expired == 0
    clock.advance(6)
    report = await setup.reaper.run_once()
    assert (report.expired, report.retried, report.dead_lettered) == (1, 1, [])
    row = await setup.row(task)
    assert row.status == "Failed"
    assert row.error_message == "lease expired: no heartbeat within 20 s"
    assert row.next_retry_at == clock.now() + NO_JITTER.normal.delay(1)
    with pytest.raises(StaleClaim):
        await setup.heartbeat(lease, "slow")
    assert (await setup.reaper.run_once()).expired == 0


async def test_default_lease_is_named_in_the_reason(setup: Setup, clock: ManualClock) -> None:
    task = await setup.task_of("plain")
    await setup.claim(task, "plain")  # no heartbeat timeout: the queue's 30 s
    clock.advance(31)
    await setup.reaper.run_once()
    assert (await setup.row(task)).error_message == "lease expired: no heartbeat within 30 s"


async def test_expired_lease_is_terminal_when_attempts_run_out(
    setup: Setup, clock: ManualClock
) -> None:
    task = await setup.task_of("slow")  # max_attempts: 2
    for attempt in (1, 2):
        lease = await setup.claim(task, "slow")
        assert lease.attempt == attempt
        clock.advance(21)
        report = await setup.reaper.run_once()
        clock.advance(1)
        await setup.retries.run_once()
    assert report.dead_lettered == [task] and report.retried == 0
    row = await setup.row(task)
    assert (row.status, row.next_retry_at, row.attempt) == ("Failed", None, 2)
    [entry] = await setup.journal("slow")
    assert entry["kind"] == "task_dead"
    assert entry["detail"] == {
        "task_id": str(task),
        "attempt": 2,
        "reason": "lease expired: no heartbeat within 20 s",
    }


async def test_timed_out_attempt_is_failed_retried_then_terminal(
    setup: Setup, clock: ManualClock
) -> None:
    task = await setup.task_of("slow")  # timeout 60 s, max_attempts 2
    first = await setup.claim(task, "slow")
    for _ in range(6):  # a healthy heartbeat does not save an attempt that runs too long
        clock.advance(10)
        await setup.heartbeat(first, "slow")
    assert (await setup.reaper.run_once()).timed_out == 0  # exactly 60 s is not longer
    clock.advance(1)
    report = await setup.reaper.run_once()
    assert (report.timed_out, report.retried, report.expired) == (1, 1, 0)
    row = await setup.row(task)
    assert (row.status, row.error_message) == ("Failed", "timeout: attempt ran longer than 60 s")
    with pytest.raises(StaleClaim):
        await setup.heartbeat(first, "slow")

    clock.advance(1)
    assert await setup.retries.run_once() == [task]
    second = await setup.claim(task, "slow")
    assert second.attempt == 2
    for _ in range(7):
        clock.advance(10)
        await setup.heartbeat(second, "slow")
    report = await setup.reaper.run_once()
    assert (report.timed_out, report.dead_lettered) == (1, [task])
    row = await setup.row(task)
    assert (row.status, row.next_retry_at) == ("Failed", None)
    assert await setup.retries.run_once() == []
    [entry] = await setup.journal("slow")
    assert entry["kind"] == "task_dead"
    assert "timeout: attempt ran longer than 60 s" in entry["message"]


@pytest.mark.parametrize("rule", ["attempt timeout", "lease expiry"])
async def test_the_reapers_timeout_mark_keeps_the_late_reply(
    setup: Setup, clock: ManualClock, rule: str
) -> None:
    """interface-contracts.md: after the reaper marked the attempt timed out,
    its late reply is accepted while no newer attempt started (issue 14, §4)."""
    task = await setup.task_of("slow")
    lease = await setup.claim(task, "slow")
    if rule == "attempt timeout":
        for _ in range(6):
            clock.advance(10)
            await setup.heartbeat(lease, "slow")
        clock.advance(1)
    else:
        clock.advance(21)
    report = await setup.reaper.run_once()
    assert (report.timed_out, report.expired) == ((1, 0) if rule == "attempt timeout" else (0, 1))
    assert (await setup.row(task)).status == "Failed"
    await setup.tasks.complete(lease.fence)
    assert (await setup.row(task)).status == "Completed"


async def test_jobs_without_timeout_run_as_long_as_they_heartbeat(
    setup: Setup, clock: ManualClock
) -> None:
    task = await setup.task_of("plain")
    lease = await setup.claim(task, "plain")
    for _ in range(100):
        clock.advance(20)
        await setup.heartbeat(lease, "plain")
    report = await setup.reaper.run_once()
    assert (report.expired, report.timed_out) == (0, 0)
    assert (await setup.row(task)).status == "Running"


async def test_a_timed_out_attempt_that_finished_meanwhile_is_left_alone(
    setup: Setup, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = await setup.task_of("slow")
    lease = await setup.claim(task, "slow")
    clock.advance(10)
    await setup.heartbeat(lease, "slow")
    clock.advance(10)
    await setup.heartbeat(lease, "slow")
    # The reaper read the attempt as timed out; the worker completed before the fail.
    stale = [(task, lease.attempt, lease.lease_token, setup.jobs["slow"].job_id, 60)]

    async def scanned(*_: object) -> list[Any]:
        return stale

    await setup.tasks.complete(lease.fence)
    monkeypatch.setattr(reaper_module, "_timed_out", scanned)
    report = await setup.reaper.run_once()
    assert (report.timed_out, report.raced) == (0, 1)
    assert (await setup.row(task)).status == "Completed"


async def test_lease_seconds_for(setup: Setup) -> None:
    assert lease_seconds_for(setup.jobs["slow"]) == 20.0
    assert lease_seconds_for(setup.jobs["plain"]) is None
    task = await setup.task_of("slow")
    async with setup.repo.read() as t:
        assert await lease_seconds_for_task(t, task) == 20.0
        assert await lease_seconds_for_task(t, uuid.uuid4()) is None


async def test_retry_scheduler_requeues_due_retries_with_a_wakeup(
    setup: Setup, clock: ManualClock
) -> None:
    task = await setup.task_of("plain")
    lease = await setup.claim(task, "plain")
    await setup.tasks.fail(lease.fence, "boom")
    assert await setup.retries.run_once() == []  # not due yet
    clock.advance(1)
    assert await setup.retries.run_once() == [task]
    assert (await setup.row(task)).status == "Queued"
    o = schema.outbox
    async with setup.repo.read() as t:
        wakeups = [
            r.payload
            for r in await t.connection.execute(sa.select(o.c.kind, o.c.payload))
            if r.kind == ENQUEUE_TASK
        ]
    assert str(task) in json.dumps(wakeups[-1])  # the retry's wake-up
    assert len(wakeups) == 2  # creation and retry


async def test_service_loop_starts_and_stops(repo: SqlRepository, clock: ManualClock) -> None:
    passes = anyio.Event()

    class Counting(PeriodicService):
        def __init__(self) -> None:
            super().__init__(3600)
            self.count = 0

        async def run_once(self) -> int:
            self.count += 1
            if self.count == 2:
                passes.set()
            if self.count == 1:
                raise RuntimeError("a failing pass does not end the loop")
            return self.count

    service = Counting()
    service._interval = 0  # two passes without a real wait
    async with anyio.create_task_group() as tg:
        await service.start(tg)
        await passes.wait()
        await service.stop()
    assert service.count >= 2
    await Reaper(repo, clock=clock).stop()  # never started: returns at once


async def test_configs_are_validated() -> None:
    with pytest.raises(ConfigurationError):
        ReaperConfig(interval_seconds=0)
    with pytest.raises(ConfigurationError):
        ReaperConfig(batch_size=0)
    with pytest.raises(ConfigurationError):
        RetrySchedulerConfig(interval_seconds=-1)
    with pytest.raises(ConfigurationError):
        RetrySchedulerConfig(batch_size=0)
