"""The reaper area of the port (``tx.reaper``), on both engines."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest

from tests.test_reaper import Setup
from trace_core.clock import ManualClock
from trace_core.storage.ports import TimedOutAttempt
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio


@pytest.fixture
async def world(repo: SqlRepository, clock: ManualClock) -> Setup:
    setup = Setup(repo, clock)
    await setup.deploy()
    return setup


async def test_heartbeat_timeout_of_task(world: Setup) -> None:
    slow, plain = await world.task_of("slow"), await world.task_of("plain")
    async with world.repo.read() as tx:
        assert await tx.reaper.heartbeat_timeout_of_task(slow) == 20
        assert await tx.reaper.heartbeat_timeout_of_task(plain) is None  # the job has none
        assert await tx.reaper.heartbeat_timeout_of_task(uuid.uuid4()) is None


async def test_held_leases(world: Setup, clock: ManualClock) -> None:
    running, queued = await world.task_of("slow"), await world.task_of("plain")
    lease = await world.claim(running, "slow")
    async with world.repo.read() as tx:
        held = await tx.reaper.held_leases([running, queued, uuid.uuid4()])
        assert await tx.reaper.held_leases([]) == {}
    assert set(held) == {running, queued}  # the unknown id is left out
    assert held[running].job_id == world.jobs["slow"].job_id
    assert held[running].last_heartbeat == clock.now()
    assert held[running].lease_expires_at == lease.expires_at
    assert (held[queued].last_heartbeat, held[queued].lease_expires_at) == (None, None)


async def test_timed_out_attempts_oldest_first_up_to_the_limit(
    world: Setup, clock: ManualClock
) -> None:
    first, second, young = [await world.task_of("slow") for _ in range(3)]
    plain = await world.task_of("plain")
    leases = {}
    for task in (first, second):
        leases[task] = await world.claim(task, "slow")
        clock.advance(1)
    await world.claim(plain, "plain")  # no timeout: never timed out
    clock.advance(55)
    leases[young] = await world.claim(young, "slow")  # started 5 s ago: not yet
    clock.advance(5)
    now = clock.now()
    async with world.repo.read() as tx:
        found = await tx.reaper.timed_out_attempts(now=now, limit=10)
        assert await tx.reaper.timed_out_attempts(now=now, limit=1) == found[:1]
        assert await tx.reaper.timed_out_attempts(now=now - timedelta(hours=1), limit=10) == []
    job = world.jobs["slow"].job_id
    assert found == [
        TimedOutAttempt(t, leases[t].attempt, leases[t].lease_token, job, 60)
        for t in (first, second)
    ]
