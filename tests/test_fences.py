"""Every worker write carries the whole fence (euterpe-contract.md §4), single or
batch, on every queue and both engines; and an attempt that ended is over
(interface-contracts.md, "Worker → Dispatcher": only a timed-out attempt may
still reply, until a newer one starts). Issue 14, section 4."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from tests.factories import make_items
from trace_core.clock import ManualClock
from trace_core.errors import InvalidTransition, StaleClaim
from trace_core.leasing import LeaseConfig, LeaseQueue
from trace_core.model import INBOX_JOBS, QUEUES, TASKS, Fence, Lease, QueueSpec
from trace_core.retry import Backoff, RetryClass, RetryPolicy
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio

LEASE = 30.0
_STAGES = ("fetching", "processing", "uploading")


@pytest.fixture(params=sorted(QUEUES))
def queue(request: pytest.FixtureRequest) -> QueueSpec:
    return QUEUES[request.param]


def _queue(repo: SqlRepository, queue: QueueSpec, clock: ManualClock) -> LeaseQueue:
    retry = RetryPolicy(normal=Backoff(base_seconds=10, cap_seconds=100, jitter=0.0))
    return LeaseQueue(
        repo, queue, clock=clock, config=LeaseConfig(lease_seconds=LEASE), retry=retry
    )


async def _claimed(
    repo: SqlRepository, queue: QueueSpec, clock: ManualClock, count: int = 1
) -> tuple[LeaseQueue, list[Lease]]:
    """``count`` new items, claimed, and walked to the stage completion needs."""
    await make_items(repo, queue, clock.now(), count=count, max_attempts=5)
    q = _queue(repo, queue, clock)
    leases = await q.claim_batch("w1", count)
    assert len(leases) == count
    if queue is INBOX_JOBS:
        for lease in leases:
            for stage in _STAGES:
                await q.advance(lease.fence, stage)
    return q, leases


def _forged(lease: Lease) -> dict[str, Fence]:
    """The lease's fence, wrong in exactly one column each."""
    fence = lease.fence
    return {
        "stale claim_version": dataclasses.replace(fence, claim_version=lease.claim_version + 1),
        "older claim_version": dataclasses.replace(fence, claim_version=lease.claim_version - 1),
        "stale token": dataclasses.replace(fence, lease_token=uuid.uuid4()),
        "stale attempt": dataclasses.replace(fence, attempt=lease.attempt + 1),
        "older attempt": dataclasses.replace(fence, attempt=lease.attempt - 1),
        "attempt beyond any column": dataclasses.replace(fence, attempt=2**40),
        "claim_version beyond any column": dataclasses.replace(fence, claim_version=-(2**40)),
    }


async def test_every_single_and_batch_write_refuses_each_forged_fence_column(
    repo: SqlRepository, queue: QueueSpec, clock: ManualClock
) -> None:
    q, [lease] = await _claimed(repo, queue, clock)
    before = await q.inspect(lease.item_id)
    writes: dict[str, Callable[[Fence], Awaitable[Any]]] = {
        "heartbeat": q.heartbeat,
        "complete": q.complete,
        "fail": lambda f: q.fail(f, "boom"),
        "fail fatal": lambda f: q.fail(f, "boom", retry_class=RetryClass.FATAL),
    }
    if queue.lifecycle.allows(queue.claimed, queue.ready):  # not tasks
        writes["requeue"] = lambda f: q.requeue(f, reason="release")
    if queue is INBOX_JOBS:
        writes["advance"] = lambda f: q.advance(f, "uploading")
    for name, fence in _forged(lease).items():
        for write_name, write in writes.items():
            with pytest.raises(StaleClaim):
                await write(fence)
            assert await q.inspect(lease.item_id) == before, (name, write_name)
        assert await q.complete_many([fence]) == set(), name
        assert await q.inspect(lease.item_id) == before, (name, "complete_many")
    # The batch path completes exactly the whole, current fences of a batch.
    assert await q.complete_many([*_forged(lease).values(), lease.fence]) == {lease.item_id}
    assert (await q.inspect(lease.item_id)).status == queue.done


async def test_a_batch_fences_each_item_on_its_own_columns(
    repo: SqlRepository, queue: QueueSpec, clock: ManualClock
) -> None:
    q, leases = await _claimed(repo, queue, clock, count=4)
    good, stale_version, stale_token, http = leases
    fences = [
        good.fence,
        dataclasses.replace(stale_version.fence, claim_version=stale_version.claim_version + 1),
        dataclasses.replace(stale_token.fence, lease_token=good.lease_token),
        # An HTTP caller knows attempt + token only: as strong, and accepted.
        dataclasses.replace(http.fence, claim_version=None),
    ]
    assert await q.complete_many(fences) == {good.item_id, http.item_id}
    for lease in (stale_version, stale_token):
        assert (await q.inspect(lease.item_id)).status in queue.leased
    # The refused ones still complete with their own fences, in a batch.
    assert await q.complete_many([stale_version.fence, stale_token.fence]) == {
        stale_version.item_id,
        stale_token.item_id,
    }


async def test_an_expired_and_reclaimed_lease_cannot_complete_through_the_batch(
    repo: SqlRepository, queue: QueueSpec, clock: ManualClock
) -> None:
    """The realistic stale fence: the holder outlived its lease and the item
    was reclaimed and claimed again (a newer claim_version, token, attempt)."""
    q, [old] = await _claimed(repo, queue, clock)
    clock.advance(LEASE + 1)
    await q.reclaim_expired()
    clock.advance(1000)
    await q.requeue_due()
    new = (await q.claim(old.item_id, "w2")).lease
    assert new is not None and new.claim_version > old.claim_version
    for fence in (old.fence, dataclasses.replace(old.fence, claim_version=None)):
        assert await q.complete_many([fence]) == set()
        with pytest.raises(StaleClaim):
            await q.complete(fence)
    assert (await q.inspect(old.item_id)).status == queue.claimed


# --- tasks: the late-reply allowance and nothing more ------------------------------


async def _task(repo: SqlRepository, clock: ManualClock) -> tuple[LeaseQueue, Lease]:
    q, [lease] = await _claimed(repo, TASKS, clock)
    return q, lease


@pytest.mark.parametrize("batch", [False, True], ids=["single", "batch"])
@pytest.mark.parametrize("how", ["lease expired", "attempt timed out"])
async def test_a_timed_out_attempt_may_still_complete(
    repo: SqlRepository, clock: ManualClock, how: str, batch: bool
) -> None:
    q, lease = await _task(repo, clock)
    if how == "lease expired":
        clock.advance(LEASE + 1)
        assert (await q.reclaim_expired()).retried == [lease.item_id]
    else:
        outcome = await q.fail(lease.fence, "timeout: ran too long", timed_out=True)
        assert outcome.retrying
    assert (await q.inspect(lease.item_id)).status == "Failed"
    with pytest.raises(StaleClaim):  # not running: no heartbeat
        await q.heartbeat(lease.fence)
    if batch:
        assert await q.complete_many([lease.fence]) == {lease.item_id}
    else:
        await q.complete(lease.fence)
    assert (await q.inspect(lease.item_id)).status == "Completed"


@pytest.mark.parametrize("batch", [False, True], ids=["single", "batch"])
@pytest.mark.parametrize(
    "how", ["own failure", "own fatal failure", "own failure, requeued", "dead-lettered"]
)
async def test_an_attempt_that_ended_otherwise_cannot_complete(
    repo: SqlRepository, clock: ManualClock, how: str, batch: bool
) -> None:
    q, lease = await _task(repo, clock)
    if how.startswith("own"):
        fatal = RetryClass.FATAL if "fatal" in how else RetryClass.RETRYABLE
        await q.fail(lease.fence, "boom", retry_class=fatal)
        if "requeued" in how:
            clock.advance(1000)
            assert await q.requeue_due() == [lease.item_id]
    else:
        assert await q.dead_letter([lease.item_id], reason="operator") == {lease.item_id}
    before = await q.inspect(lease.item_id)
    for fence in (lease.fence, dataclasses.replace(lease.fence, claim_version=None)):
        if batch:
            assert await q.complete_many([fence]) == set()
        else:
            with pytest.raises((StaleClaim, InvalidTransition)):
                await q.complete(fence)
        assert await q.inspect(lease.item_id) == before


async def test_a_newer_attempt_ends_the_timed_out_ones_allowance(
    repo: SqlRepository, clock: ManualClock
) -> None:
    q, old = await _task(repo, clock)
    clock.advance(LEASE + 1)
    await q.reclaim_expired()
    clock.advance(1000)
    await q.requeue_due()
    new = (await q.claim(old.item_id, "w2")).lease
    assert new is not None
    # The newer attempt fails by its own report: the old one gains nothing.
    await q.fail(new.fence, "boom")
    assert await q.complete_many([old.fence, new.fence]) == set()
    with pytest.raises(StaleClaim):
        await q.complete(old.fence)
