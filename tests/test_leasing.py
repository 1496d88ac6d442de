"""Parity suite of the ownership protocol: every rule, every queue, both engines."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import anyio
import pytest

from tests.factories import make_items
from trace_core.clock import ManualClock
from trace_core.errors import ConfigurationError, InvalidTransition, NotFound, StaleClaim
from trace_core.leasing import FailOutcome, LeaseConfig, LeaseQueue, ReclaimHooks
from trace_core.model import (
    INBOX_JOBS,
    JOB_OUTBOX_EVENTS,
    OUTBOX,
    QUEUES,
    TASKS,
    Fence,
    Lease,
    NotClaimedReason,
    QueueSpec,
)
from trace_core.retry import Backoff, RetryClass, RetryPolicy
from trace_core.storage.protocol import Transaction
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio

LEASE = 30.0


@pytest.fixture(params=sorted(QUEUES))
def queue(request: pytest.FixtureRequest) -> QueueSpec:
    return QUEUES[request.param]


def lease_queue(repo: SqlRepository, queue: QueueSpec, clock: ManualClock) -> LeaseQueue:
    retry = RetryPolicy(normal=Backoff(base_seconds=10, cap_seconds=100, jitter=0.5))
    return LeaseQueue(
        repo, queue, clock=clock, config=LeaseConfig(lease_seconds=LEASE), retry=retry
    )


async def claimed(
    repo: SqlRepository, queue: QueueSpec, clock: ManualClock, *, max_attempts: int = 3
) -> tuple[LeaseQueue, Any, Lease]:
    """One new item of ``queue``, claimed by worker ``w1``."""
    [item] = await make_items(repo, queue, clock.now(), max_attempts=max_attempts)
    q = lease_queue(repo, queue, clock)
    lease = (await q.claim(item, "w1")).lease
    assert lease is not None
    return q, item, lease


async def finish(q: LeaseQueue, fence: Fence) -> None:
    """Complete an item, walking the inbox stages first where the table requires."""
    if q.queue is INBOX_JOBS:
        for stage in ("fetching", "processing", "uploading"):
            await q.advance(fence, stage)
    await q.complete(fence)


async def test_claim_by_id_sets_the_lease(
    repo: SqlRepository, queue: QueueSpec, clock: ManualClock
) -> None:
    [item] = await make_items(repo, queue, clock.now())
    q = lease_queue(repo, queue, clock)
    outcome = await q.claim(item, "w1")
    assert outcome.claimed and outcome.lease is not None
    lease = outcome.lease
    assert lease.item_id == item
    assert lease.attempt == 1
    assert lease.claim_version == 1
    assert lease.expires_at == clock.now() + timedelta(seconds=LEASE)
    state = await q.inspect(item)
    assert state.status == queue.claimed
    assert state.lease_token == lease.lease_token
    assert state.claim_version == 1


async def test_second_claim_is_refused_with_the_reason(
    repo: SqlRepository, queue: QueueSpec, clock: ManualClock
) -> None:
    [item] = await make_items(repo, queue, clock.now())
    q = lease_queue(repo, queue, clock)
    first = await q.claim(item, "w1")
    second = await q.claim(item, "w2")
    assert not second.claimed
    assert second.reason is NotClaimedReason.ALREADY_RUNNING
    assert first.lease is not None
    await finish(q, first.lease.fence)
    third = await q.claim(item, "w2")
    assert third.reason is NotClaimedReason.COMPLETED
    missing_id = 10**12 if queue is OUTBOX else uuid.uuid4()
    assert (await q.claim(missing_id, "w2")).reason is NotClaimedReason.NOT_FOUND


async def test_lease_tokens_are_fresh_per_claim(
    repo: SqlRepository, queue: QueueSpec, clock: ManualClock
) -> None:
    items = await make_items(repo, queue, clock.now(), count=5)
    q = lease_queue(repo, queue, clock)
    leases = await q.claim_batch("w1", 10)
    assert sorted(map(str, (le.item_id for le in leases))) == sorted(map(str, items))
    assert len({le.lease_token for le in leases}) == 5


async def test_claim_batch_never_hands_out_an_item_twice(
    repo: SqlRepository, clock: ManualClock
) -> None:
    items = await make_items(repo, TASKS, clock.now(), count=60)
    q = lease_queue(repo, TASKS, clock)
    got: list[object] = []

    async def claimer(name: str) -> None:
        while True:
            leases = await q.claim_batch(name, 7)
            if not leases:
                return
            got.extend(le.item_id for le in leases)

    async with anyio.create_task_group() as tg:
        for n in range(4):
            tg.start_soon(claimer, f"w{n}")
    assert sorted(map(str, got)) == sorted(map(str, items))


async def test_claim_batch_takes_the_oldest_first(repo: SqlRepository, clock: ManualClock) -> None:
    first = await make_items(repo, TASKS, clock.now(), count=3)
    clock.advance(1)
    await make_items(repo, TASKS, clock.now(), count=3)
    q = lease_queue(repo, TASKS, clock)
    leases = await q.claim_batch("w1", 3)
    assert {le.item_id for le in leases} == set(first)


async def test_claim_limit_is_validated(repo: SqlRepository, clock: ManualClock) -> None:
    q = lease_queue(repo, TASKS, clock)
    with pytest.raises(ConfigurationError, match="claim limit"):
        await q.claim_batch("w1", 0)


async def test_heartbeat_extends_only_the_current_lease(
    repo: SqlRepository, queue: QueueSpec, clock: ManualClock
) -> None:
    q, item, lease = await claimed(repo, queue, clock)
    clock.advance(10)
    expires = await q.heartbeat(lease.fence)
    assert expires == clock.now() + timedelta(seconds=LEASE)
    before = await q.inspect(item)
    wrong_token = Fence(item, lease.attempt, uuid.uuid4(), lease.claim_version)
    with pytest.raises(StaleClaim):
        await q.heartbeat(wrong_token)
    wrong_attempt = Fence(item, lease.attempt + 1, lease.lease_token, lease.claim_version)
    with pytest.raises(StaleClaim):
        await q.heartbeat(wrong_attempt)
    wrong_version = Fence(item, lease.attempt, lease.lease_token, lease.claim_version + 1)
    with pytest.raises(StaleClaim):
        await q.heartbeat(wrong_version)
    assert await q.inspect(item) == before


async def test_stale_complete_changes_nothing(
    repo: SqlRepository, queue: QueueSpec, clock: ManualClock
) -> None:
    q, item, lease = await claimed(repo, queue, clock)
    before = await q.inspect(item)
    stale = Fence(item, lease.attempt, uuid.uuid4(), lease.claim_version)
    with pytest.raises(StaleClaim):
        await q.complete(stale)
    with pytest.raises(StaleClaim):
        await q.fail(stale, "boom")
    assert await q.complete_many([stale]) == set()
    assert await q.inspect(item) == before


async def test_completing_twice_is_an_invalid_transition(
    repo: SqlRepository, queue: QueueSpec, clock: ManualClock
) -> None:
    q, item, lease = await claimed(repo, queue, clock)
    await finish(q, lease.fence)
    with pytest.raises(InvalidTransition) as info:
        await q.complete(lease.fence)
    assert info.value.source == queue.done
    assert (await q.inspect(item)).status == queue.done


async def test_complete_many_returns_only_current_fences(
    repo: SqlRepository, queue: QueueSpec, clock: ManualClock
) -> None:
    items = await make_items(repo, queue, clock.now(), count=4)
    q = lease_queue(repo, queue, clock)
    leases = await q.claim_batch("w1", 4)
    if queue is INBOX_JOBS:
        for lease in leases:
            for stage in ("fetching", "processing", "uploading"):
                await q.advance(lease.fence, stage)
    stale = Fence(leases[0].item_id, leases[0].attempt, uuid.uuid4(), leases[0].claim_version)
    done = await q.complete_many([stale, *(le.fence for le in leases[1:])])
    assert done == {le.item_id for le in leases[1:]}
    assert (await q.inspect(leases[0].item_id)).status in queue.leased
    assert len(items) == 4


async def test_expired_lease_is_reclaimed_and_the_old_holder_fenced_out(
    repo: SqlRepository, queue: QueueSpec, clock: ManualClock
) -> None:
    q, item, old = await claimed(repo, queue, clock, max_attempts=5)
    clock.advance(LEASE - 1)
    assert (await q.reclaim_expired()).retried == []
    clock.advance(2)
    report = await q.reclaim_expired()
    assert report.retried == [item]
    state = await q.inspect(item)
    assert state.status == queue.retry_to
    assert state.last_error is not None and "lease expired" in state.last_error
    if queue.expiry_bumps_claim_version:
        assert state.claim_version == old.claim_version + 1
        with pytest.raises(StaleClaim):
            await q.heartbeat(old.fence)
    # Once due, the item is claimable again as a new attempt with a new version.
    clock.advance(1000)
    await q.requeue_due()
    new = (await q.claim(item, "w2")).lease
    assert new is not None
    assert new.attempt == 2
    assert new.claim_version > old.claim_version
    with pytest.raises(StaleClaim):
        await q.complete(old.fence)
    await finish(q, new.fence)


async def test_task_late_reply_is_accepted_until_a_newer_attempt_starts(
    repo: SqlRepository, clock: ManualClock
) -> None:
    q, item, lease = await claimed(repo, TASKS, clock, max_attempts=5)
    clock.advance(LEASE + 1)
    await q.reclaim_expired()
    assert (await q.inspect(item)).status == "Failed"
    with pytest.raises(StaleClaim):  # the lease is gone: no more heartbeats
        await q.heartbeat(lease.fence)
    await q.complete(lease.fence)  # but the late reply of the current attempt counts
    assert (await q.inspect(item)).status == "Completed"


async def test_task_late_reply_is_stale_after_a_newer_attempt(
    repo: SqlRepository, clock: ManualClock
) -> None:
    q, item, old = await claimed(repo, TASKS, clock, max_attempts=5)
    clock.advance(LEASE + 1)
    await q.reclaim_expired()
    clock.advance(1000)
    assert await q.requeue_due() == [item]
    new = (await q.claim(item, "w2")).lease
    assert new is not None and new.attempt == old.attempt + 1
    with pytest.raises(StaleClaim):
        await q.complete(old.fence)
    assert (await q.inspect(item)).status == "Running"


async def test_retry_backoff_then_dead_letter(
    repo: SqlRepository, queue: QueueSpec, clock: ManualClock
) -> None:
    q, item, lease = await claimed(repo, queue, clock, max_attempts=2)
    outcome = await q.fail(lease.fence, "first error")
    assert outcome.retrying and outcome.status == queue.retry_to
    state = await q.inspect(item)
    assert state.retry_at is not None
    delay = (state.retry_at - clock.now()).total_seconds()
    assert 5 <= delay <= 10  # base 10 s with 50 % jitter
    # Not claimable before the retry is due.
    await q.requeue_due()
    assert (await q.claim(item, "w1")).reason is NotClaimedReason.NOT_READY
    clock.advance(delay)
    await q.requeue_due()
    lease = (await q.claim(item, "w1")).lease
    assert lease is not None and lease.attempt == 2
    outcome = await q.fail(lease.fence, "second error")
    assert not outcome.retrying and outcome.status == queue.dead
    assert_dead_letter_path(queue, outcome)
    state = await q.inspect(item)
    assert state.status == queue.dead and state.last_error == "second error"
    assert (await q.claim(item, "w1")).reason is NotClaimedReason.DEAD_LETTERED


async def test_fatal_errors_dead_letter_at_once(
    repo: SqlRepository, queue: QueueSpec, clock: ManualClock
) -> None:
    q, _item, lease = await claimed(repo, queue, clock, max_attempts=5)
    outcome = await q.fail(lease.fence, "bad input", retry_class=RetryClass.FATAL)
    assert not outcome.retrying and outcome.status == queue.dead
    assert_dead_letter_path(queue, outcome)


async def test_throttled_failures_use_the_larger_bucket(
    repo: SqlRepository, clock: ManualClock
) -> None:
    [item] = await make_items(repo, OUTBOX, clock.now(), max_attempts=5)
    retry = RetryPolicy(
        normal=Backoff(base_seconds=1, cap_seconds=1, jitter=0),
        throttled=Backoff(base_seconds=60, cap_seconds=60, jitter=0),
    )
    q = LeaseQueue(repo, OUTBOX, clock=clock, retry=retry)
    lease = (await q.claim(item, "w1")).lease
    assert lease is not None
    await q.fail(lease.fence, "429", retry_class=RetryClass.THROTTLED)
    state = await q.inspect(item)
    assert state.retry_at == clock.now() + timedelta(seconds=60)


async def test_reclaim_dead_letters_when_attempts_are_exhausted(
    repo: SqlRepository, queue: QueueSpec, clock: ManualClock
) -> None:
    [item] = await make_items(repo, queue, clock.now(), max_attempts=1)
    q = lease_queue(repo, queue, clock)
    assert (await q.claim(item, "w1")).claimed
    clock.advance(LEASE + 1)
    outcomes: list[FailOutcome] = []

    async def reasons(t: Transaction, fences: Sequence[Fence]) -> Mapping[Any, str]:
        return {}

    async def failed(t: Transaction, fence: Fence, outcome: FailOutcome, reason: str) -> None:
        outcomes.append(outcome)

    report = await q.reclaim_expired(hooks=ReclaimHooks(reasons, failed))
    assert report.dead_lettered == [item]
    [outcome] = outcomes
    assert not outcome.retrying
    assert_dead_letter_path(queue, outcome)
    assert (await q.inspect(item)).status == queue.dead


def assert_dead_letter_path(queue: QueueSpec, outcome: FailOutcome) -> None:
    """The failure walked the queue's lifecycle edge by edge from its claimed
    stage to the dead letter: an inbox job through ``failed`` (the contract's
    table has no leased -> dead_letter edge), the other queues directly."""
    expected = ("failed", "dead_letter") if queue is INBOX_JOBS else (queue.dead,)
    assert outcome.path == expected
    steps = (queue.claimed, *outcome.path)
    for source, target in itertools.pairwise(steps):
        assert queue.lifecycle.allows(source, target), (source, target)


async def test_inbox_stages_follow_the_table(repo: SqlRepository, clock: ManualClock) -> None:
    q, item, lease = await claimed(repo, INBOX_JOBS, clock)
    with pytest.raises(InvalidTransition):
        await q.advance(lease.fence, "processing")  # claimed -> processing skips fetching
    assert (await q.inspect(item)).status == "claimed"
    for stage in ("fetching", "processing", "uploading"):
        await q.advance(lease.fence, stage)
        assert (await q.inspect(item)).status == stage
    with pytest.raises(ConfigurationError):
        await q.advance(lease.fence, "succeeded")
    await q.complete(lease.fence, values={"outputs": {"uri": "s3://b/o/x"}})
    state = await q.inspect(item)
    assert state.status == "succeeded"


async def test_inbox_requeue_hands_the_job_back(repo: SqlRepository, clock: ManualClock) -> None:
    q, item, lease = await claimed(repo, INBOX_JOBS, clock)
    await q.advance(lease.fence, "fetching")
    await q.requeue(lease.fence, reason="draining")
    state = await q.inspect(item)
    assert state.status == "queued" and state.last_error == "draining"
    again = (await q.claim(item, "w2")).lease
    assert again is not None and again.attempt == 2


async def test_stale_stage_change_is_refused(repo: SqlRepository, clock: ManualClock) -> None:
    q, item, old = await claimed(repo, INBOX_JOBS, clock, max_attempts=5)
    clock.advance(LEASE + 1)
    await q.reclaim_expired()
    clock.advance(1000)
    await q.requeue_due()
    new = (await q.claim(item, "w2")).lease
    assert new is not None
    with pytest.raises(StaleClaim):
        await q.advance(old.fence, "fetching")
    assert (await q.inspect(item)).status == "claimed"


async def test_cancel_fences_out_the_holder(repo: SqlRepository, clock: ManualClock) -> None:
    queued, running, done = await make_items(repo, TASKS, clock.now(), count=3)
    q = lease_queue(repo, TASKS, clock)
    running_lease = (await q.claim(running, "w1")).lease
    done_lease = (await q.claim(done, "w1")).lease
    assert running_lease is not None and done_lease is not None
    await q.complete(done_lease.fence)
    canceled = await q.cancel([queued, running, done], reason="rollback")
    assert canceled == {queued, running}
    with pytest.raises(StaleClaim):
        await q.complete(running_lease.fence)
    assert (await q.inspect(running)).status == "Canceled"
    assert (await q.claim(queued, "w2")).reason is NotClaimedReason.CANCELED
    assert (await q.inspect(done)).status == "Completed"


async def test_cancel_is_only_for_queues_with_cancellation(
    repo: SqlRepository, clock: ManualClock
) -> None:
    q = lease_queue(repo, JOB_OUTBOX_EVENTS, clock)
    with pytest.raises(ConfigurationError):
        await q.cancel([uuid.uuid4()])


async def test_inspect_unknown_item(repo: SqlRepository, clock: ManualClock) -> None:
    with pytest.raises(NotFound):
        await lease_queue(repo, TASKS, clock).inspect(uuid.uuid4())


async def test_cancel_leaves_dead_letters_and_their_error(
    repo: SqlRepository, clock: ManualClock
) -> None:
    q, item, lease = await claimed(repo, TASKS, clock, max_attempts=1)
    await q.fail(lease.fence, "the last error")
    assert await q.cancel([item]) == set()
    state = await q.inspect(item)
    assert (state.status, state.last_error) == ("Failed", "the last error")


async def test_late_reply_clears_the_scheduled_retry(
    repo: SqlRepository, clock: ManualClock
) -> None:
    q, item, lease = await claimed(repo, TASKS, clock, max_attempts=5)
    clock.advance(LEASE + 1)
    await q.reclaim_expired()
    assert (await q.inspect(item)).retry_at is not None
    await q.complete(lease.fence)
    state = await q.inspect(item)
    assert (state.status, state.retry_at) == ("Completed", None)
    clock.advance(1000)
    assert await q.requeue_due() == []
