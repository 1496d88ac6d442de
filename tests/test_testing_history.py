"""The history checker finds planted losses, duplicates and out-of-fence
effects in a real ledger, on both engines (and passes a clean history)."""

from __future__ import annotations

import uuid

import pytest

from tests.factories import make_job
from trace_core.clock import ManualClock
from trace_core.errors import DuplicateItem, StaleClaim
from trace_core.leasing import LeaseConfig
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import TaskQueue
from trace_testing.history import Effect, EffectLedger, check_history, committed_fences

pytestmark = pytest.mark.anyio


async def _completed_with_effects(
    repo: SqlRepository, clock: ManualClock, count: int
) -> tuple[TaskQueue, EffectLedger, list[uuid.UUID]]:
    """``count`` tasks, each completed with its effect recorded in the ledger."""
    queue = TaskQueue(repo, clock=clock, config=LeaseConfig(lease_seconds=30))
    job = await make_job(repo, clock.now())
    created = await queue.create([NewTask(job, dedupe_key=f"h{i}") for i in range(count)])
    ledger = EffectLedger(repo)
    await ledger.create()
    for lease in await queue.claim_batch("worker", count):
        async with repo.transaction() as tx:
            await ledger.record(tx, lease.fence, "worker")
            await queue.complete(lease.fence, tx=tx)
    return queue, ledger, [c.task_id for c in created]


async def test_a_clean_history_is_ok(repo: SqlRepository, clock: ManualClock) -> None:
    queue, ledger, ids = await _completed_with_effects(repo, clock, 5)
    report = await ledger.check(await committed_fences(queue.leases, ids))
    assert report.ok, str(report)
    assert report.summary() == {
        "expected": 5,
        "effects": 5,
        "lost": 0,
        "duplicated_items": 0,
        "duplicate_effects": 0,
        "out_of_fence": 0,
        "unexpected": 0,
    }


async def test_a_stale_completion_takes_its_effect_with_it(
    repo: SqlRepository, clock: ManualClock
) -> None:
    queue, ledger, ids = await _completed_with_effects(repo, clock, 1)
    (task,) = ids
    stale = (await committed_fences(queue.leases, ids))[task]
    stale = type(stale)(task, stale.attempt + 1, uuid.uuid4())
    with pytest.raises(StaleClaim):
        async with repo.transaction() as tx:
            await ledger.record(tx, stale, "ghost")
            await queue.complete(stale, tx=tx)
    assert (await ledger.check(await committed_fences(queue.leases, ids))).ok


async def test_the_ledger_refuses_a_second_effect_under_one_attempt(
    repo: SqlRepository, clock: ManualClock
) -> None:
    queue, ledger, ids = await _completed_with_effects(repo, clock, 1)
    fence = (await committed_fences(queue.leases, ids))[ids[0]]
    with pytest.raises(DuplicateItem):
        async with repo.transaction() as tx:
            await ledger.record(tx, fence, "twin")


async def test_planted_loss_duplicate_and_out_of_fence_effects_are_reported(
    repo: SqlRepository, clock: ManualClock
) -> None:
    queue, ledger, ids = await _completed_with_effects(repo, clock, 4)
    fences = await committed_fences(queue.leases, ids)
    lost, doubled, fenced_out, fine = ids
    # Plant the anomalies with writes the protocol would have refused.
    async with repo.transaction() as tx:
        await tx.connection.execute(
            EffectLedger.table.delete().where(EffectLedger.table.c.item_id == str(lost))
        )
        older = fences[doubled]
        await ledger.record(
            tx, type(older)(doubled, older.attempt + 1, uuid.uuid4()), "second-holder"
        )
        await tx.connection.execute(
            EffectLedger.table.update()
            .where(EffectLedger.table.c.item_id == str(fenced_out))
            .values(lease_token=uuid.uuid4().hex)
        )
        stray = uuid.uuid4()
        await ledger.record(tx, type(older)(stray, 1, uuid.uuid4()), "stray")

    report = await ledger.check(fences)
    assert not report.ok
    assert report.lost == (str(lost),)
    assert report.duplicated == {str(doubled): 2} and report.duplicate_effects == 1
    # The doubled item's second effect and the re-tokened one are out of fence.
    assert sorted((e.item_id, e.holder) for e in report.out_of_fence) == sorted(
        [(str(doubled), "second-holder"), (str(fenced_out), "worker")]
    )
    assert [e.item_id for e in report.unexpected] == [str(stray)]
    assert str(fine) not in str(report)
    assert "lost=1" in str(report) and "duplicate_effects=1" in str(report)


def test_at_least_once_effects_are_counted_not_fenced() -> None:
    effects = [
        Effect("a", 1, "t1", "relay"),
        Effect("a", 2, "t2", "relay"),
        Effect("b", 1, "t", "r"),
    ]
    report = check_history(effects, {"a": None, "b": None, "c": None})
    assert report.lost == ("c",)
    assert report.duplicated == {"a": 2}
    assert report.out_of_fence == ()
