"""Lease expiry and reclaim, on a manual clock: nothing waits on real time."""

from __future__ import annotations

import pytest

from trace_core.clock import ManualClock
from trace_core.errors import StaleClaim
from trace_core.storage.sql import SqlRepository
from trace_testing.conformance._support import LEASE_SECONDS, make_tasks, task_queue

pytestmark = pytest.mark.anyio


async def test_an_expired_lease_is_reclaimed_retried_and_claimed_anew(
    trace_repository: SqlRepository, trace_clock: ManualClock
) -> None:
    queue = task_queue(trace_repository, trace_clock)
    (task,) = await make_tasks(queue, 1)
    (first,) = await queue.claim_batch("crashed", 1)

    trace_clock.advance(LEASE_SECONDS - 1)
    assert (await queue.reclaim_expired()).retried == [], "a live lease is not reclaimed"

    trace_clock.advance(2)
    report = await queue.reclaim_expired()
    assert report.retried == [task] and report.dead_lettered == []
    state = await queue.leases.inspect(task)
    assert state.status == "Failed" and state.retry_at is not None

    assert await queue.requeue_due() == [], "not before its retry time"
    trace_clock.advance(1.5)
    assert await queue.requeue_due() == [task]

    (second,) = await queue.claim_batch("successor", 1)
    assert (second.item_id, second.attempt) == (task, first.attempt + 1)
    assert second.lease_token != first.lease_token
    with pytest.raises(StaleClaim):
        await queue.complete(first.fence)
    await queue.complete(second.fence)
    state = await queue.leases.inspect(task)
    assert (state.status, state.attempt) == ("Completed", second.attempt)


async def test_a_heartbeat_keeps_the_lease_past_its_first_expiry(
    trace_repository: SqlRepository, trace_clock: ManualClock
) -> None:
    queue = task_queue(trace_repository, trace_clock)
    (task,) = await make_tasks(queue, 1)
    (lease,) = await queue.claim_batch("alive", 1)
    for _ in range(3):
        trace_clock.advance(LEASE_SECONDS * 0.6)
        expires_at = await queue.heartbeat(lease.fence)
        assert expires_at > trace_clock.now()
        assert (await queue.reclaim_expired()).retried == []
    await queue.complete(lease.fence)
    assert (await queue.leases.inspect(task)).status == "Completed"


async def test_the_last_attempt_expiring_dead_letters_the_task(
    trace_repository: SqlRepository, trace_clock: ManualClock
) -> None:
    queue = task_queue(trace_repository, trace_clock)
    (task,) = await make_tasks(queue, 1, max_attempts=1)
    (lease,) = await queue.claim_batch("crashed", 1)
    trace_clock.advance(LEASE_SECONDS + 1)
    report = await queue.reclaim_expired()
    assert report.dead_lettered == [task] and report.retried == []
    trace_clock.advance(3600)
    assert await queue.requeue_due() == []
    assert await queue.claim_batch("anyone", 1) == []
    with pytest.raises(StaleClaim):
        await queue.heartbeat(lease.fence)
