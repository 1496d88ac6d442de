"""Taking back a gone holder's leases at once (``tx.handover`` and
``LeaseQueue.reclaim_held_by``), on both engines."""

from __future__ import annotations

import pytest

from tests.factories import make_items
from tests.test_reaper import NO_JITTER, Setup
from trace_core.clock import ManualClock
from trace_core.errors import StaleClaim
from trace_core.leasing import LeaseQueue
from trace_core.model import OUTBOX, TASKS
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio

GONE = "trace-lite/aaaa/"


async def test_revoke_leases_takes_only_the_prefixs_leased_rows(
    repo: SqlRepository, clock: ManualClock
) -> None:
    queue = LeaseQueue(repo, TASKS, clock=clock)
    gone_a, gone_b, other, like, queued = await make_items(repo, TASKS, clock.now(), 5)
    leases = {
        gone_a: (await queue.claim(gone_a, f"{GONE}101")).lease,
        gone_b: (await queue.claim(gone_b, f"{GONE}102")).lease,
        other: (await queue.claim(other, "trace-lite/bbbb/101")).lease,
        # "_" and "%" in a prefix are literal, not LIKE wildcards.
        like: (await queue.claim(like, "trace-lite/a_aa/1")).lease,
    }
    clock.advance(1)
    async with repo.transaction() as tx:
        with pytest.raises(ValueError, match="worker_prefix"):
            await tx.handover.revoke_leases(TASKS, worker_prefix="", now=clock.now(), limit=10)
        one = await tx.handover.revoke_leases(
            TASKS, worker_prefix="trace-lite/a_a", now=clock.now(), limit=10
        )
        fences = await tx.handover.revoke_leases(
            TASKS, worker_prefix=GONE, now=clock.now(), limit=10
        )
    assert [f.item_id for f in one] == [like]
    assert {f.item_id for f in fences} == {gone_a, gone_b}
    for fence in fences:
        old = leases[fence.item_id]
        assert old is not None
        assert (fence.attempt, fence.lease_token) == (old.attempt, old.lease_token)
        assert fence.claim_version == old.claim_version + 1  # the old holder is fenced out
        state = await queue.inspect(fence.item_id)
        assert state.status == "Running" and state.lease_expires_at == clock.now()
    untouched = await queue.inspect(other)
    assert untouched.lease_expires_at != clock.now()
    assert (await queue.inspect(queued)).status == "Queued"
    async with repo.transaction() as tx:
        assert (
            len(
                await tx.handover.revoke_leases(TASKS, worker_prefix=GONE, now=clock.now(), limit=1)
            )
            == 1
        )


async def test_reclaim_held_by_fails_at_once_and_fences_the_ghost(
    repo: SqlRepository, clock: ManualClock
) -> None:
    setup = Setup(repo, clock)
    await setup.deploy()
    task, alive = await setup.task_of("slow"), await setup.task_of("slow")
    ghost = await setup.tasks.leases.claim(task, f"{GONE}7", lease_seconds=60)
    kept = await setup.tasks.leases.claim(alive, "another-host", lease_seconds=60)
    assert ghost.lease is not None and kept.lease is not None
    clock.advance(1)  # far from the 60 s expiry: the reaper would do nothing
    assert (await setup.reaper.run_once()).expired == 0

    report = await setup.reaper.reclaim_held_by(GONE, "holder gone")
    assert (report.expired, report.retried, report.dead_lettered) == (1, 1, [])
    row = await setup.row(task)
    assert row.status == "Failed" and row.error_message == "holder gone"
    assert row.next_retry_at == clock.now() + NO_JITTER.normal.delay(1)
    with pytest.raises(StaleClaim):  # every write of the old holder is refused
        await setup.tasks.leases.complete(ghost.lease.fence)
    assert (await setup.row(alive)).status == "Running"  # another holder's lease stays
    assert (await setup.reaper.reclaim_held_by(GONE, "again")).expired == 0


async def test_reclaim_held_by_dead_letters_the_last_attempt_and_journals_it(
    repo: SqlRepository, clock: ManualClock
) -> None:
    setup = Setup(repo, clock)
    await setup.deploy()
    task = await setup.task_of("plain")
    max_attempts = setup.jobs["plain"].max_attempts
    for _ in range(max_attempts):
        outcome = await setup.tasks.leases.claim(task, f"{GONE}1")
        assert outcome.lease is not None, outcome.reason
        report = await setup.reaper.reclaim_held_by(GONE, "holder gone")
        clock.advance(3600)
        await setup.retries.run_once()
    assert report.dead_lettered == [task]
    assert (await setup.row(task)).status == "Failed"
    assert any("holder gone" in str(entry) for entry in await setup.journal("plain"))


async def test_outbox_leases_of_a_gone_relay_are_handed_back(
    repo: SqlRepository, clock: ManualClock
) -> None:
    queue = LeaseQueue(repo, OUTBOX, clock=clock, retry=NO_JITTER)
    await make_items(repo, OUTBOX, clock.now(), 3)
    claimed = await queue.claim_batch(f"{GONE}9", 3)
    report = await queue.reclaim_held_by(GONE, reason="relay gone")
    assert sorted(map(str, report.retried)) == sorted(str(lease.item_id) for lease in claimed)
    clock.advance(NO_JITTER.normal.delay(1).total_seconds())
    again = await queue.claim_batch("successor", 3)  # claimable once the backoff passed
    assert len(again) == 3
    before = {lease.item_id: lease.claim_version for lease in claimed}
    assert all(lease.claim_version > before[lease.item_id] for lease in again)
