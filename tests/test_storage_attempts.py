"""The attempts area of the port (``tx.attempts``) and the attempt rows the
ownership protocol opens and closes, on both engines."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from factories import make_items

from trace_core.clock import ManualClock
from trace_core.errors import InvalidTransition, StaleClaim
from trace_core.leasing import LeaseConfig
from trace_core.model import TASKS, Fence, Holder
from trace_core.retry import Backoff, RetryClass, RetryPolicy
from trace_core.storage.ports import AttemptRecord
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import TaskQueue

pytestmark = pytest.mark.anyio


def queue(repo: SqlRepository, clock: ManualClock) -> TaskQueue:
    return TaskQueue(
        repo,
        clock=clock,
        config=LeaseConfig(lease_seconds=30),
        retry=RetryPolicy(normal=Backoff(base_seconds=1, cap_seconds=1, jitter=0)),
    )


async def attempts(repo: SqlRepository, task_id: uuid.UUID) -> list[AttemptRecord]:
    async with repo.read() as tx:
        return (await tx.attempts.of_tasks([task_id])).get(task_id, [])


async def test_a_claim_opens_the_attempt_row_with_the_lease(
    repo: SqlRepository, clock: ManualClock
) -> None:
    tq = queue(repo, clock)
    (task_id,) = await make_items(repo, TASKS, clock.now())
    outcome = await tq.claim(task_id, "w1")
    lease = outcome.lease
    assert lease is not None and lease.attempt_id is not None
    (row,) = await attempts(repo, task_id)
    assert row == AttemptRecord(
        attempt_id=lease.attempt_id,
        task_id=task_id,
        attempt=1,
        worker_id="w1",
        stream=None,
        message_id=None,
        status="Running",
        started_at=clock.now(),
        ended_at=None,
        result=None,
        error=None,
    )
    async with repo.read() as tx:
        assert await tx.attempts.find(lease.attempt_id) == row
        assert await tx.attempts.find(uuid.uuid4()) is None
        assert await tx.attempts.find_by_number(task_id, 1) == row
        assert await tx.attempts.find_by_number(task_id, 2) is None


async def test_a_batch_claim_opens_one_row_per_task(
    repo: SqlRepository, clock: ManualClock
) -> None:
    tq = queue(repo, clock)
    ids = await make_items(repo, TASKS, clock.now(), 3)
    leases = await tq.claim_batch("w", 3)
    assert {lease.item_id for lease in leases} == set(ids)
    async with repo.read() as tx:
        found = await tx.attempts.of_tasks(ids)
    assert {t: [r.attempt_id for r in rows] for t, rows in found.items()} == {
        lease.item_id: [lease.attempt_id] for lease in leases
    }


async def test_of_tasks_is_ordered_and_leaves_out_tasks_without_attempts(
    repo: SqlRepository, clock: ManualClock
) -> None:
    tq = queue(repo, clock)
    claimed, never = await make_items(repo, TASKS, clock.now(), 2, max_attempts=3)
    first = (await tq.claim(claimed, "w1")).lease
    assert first is not None
    await tq.fail(first.fence, "boom")
    clock.advance(5)
    assert await tq.requeue_due() == [claimed]
    second = (await tq.claim(claimed, "w2")).lease
    assert second is not None and second.attempt_id != first.attempt_id
    async with repo.read() as tx:
        found = await tx.attempts.of_tasks([claimed, never, uuid.uuid4()])
        assert await tx.attempts.of_tasks([]) == {}
    assert list(found) == [claimed]
    assert [(r.attempt, r.worker_id, r.status) for r in found[claimed]] == [
        (1, "w1", "Failed"),
        (2, "w2", "Running"),
    ]


async def test_completion_closes_the_attempt_in_the_same_write(
    repo: SqlRepository, clock: ManualClock
) -> None:
    tq = queue(repo, clock)
    (task_id,) = await make_items(repo, TASKS, clock.now())
    lease = (await tq.claim(task_id, "w")).lease
    assert lease is not None
    clock.advance(3)
    await tq.complete(lease.fence, outputs=[{"n": 1}])
    (row,) = await attempts(repo, task_id)
    assert (row.status, row.ended_at, row.error) == ("Completed", clock.now(), None)


async def test_a_batch_completion_closes_only_the_current_attempts(
    repo: SqlRepository, clock: ManualClock
) -> None:
    tq = queue(repo, clock)
    a, b = await make_items(repo, TASKS, clock.now(), 2)
    la, lb = (await tq.claim(a, "w")).lease, (await tq.claim(b, "w")).lease
    assert la is not None and lb is not None
    stale = type(lb.fence)(lb.item_id, lb.attempt, uuid.uuid4())
    assert await tq.complete_many([la.fence, stale]) == {a}
    assert [r.status for r in await attempts(repo, a)] == ["Completed"]
    assert [r.status for r in await attempts(repo, b)] == ["Running"]


async def test_a_batch_completion_closes_the_record_of_its_own_attempt_only(
    repo: SqlRepository, clock: ManualClock
) -> None:
    tq = queue(repo, clock)
    (task_id,) = await make_items(repo, TASKS, clock.now(), max_attempts=3)
    first = (await tq.claim(task_id, "w")).lease
    assert first is not None
    assert (await tq.fail(first.fence, "flaky", retry_class=RetryClass.RETRYABLE)).retrying
    clock.advance(2)  # past the retry delay (1 s)
    assert await tq.leases.requeue_due() == [task_id]
    second = (await tq.claim(task_id, "w")).lease
    assert second is not None and second.attempt == first.attempt + 1
    assert await tq.complete_many([second.fence, first.fence]) == {task_id}
    records = sorted(await attempts(repo, task_id), key=lambda r: r.attempt)
    assert [(r.attempt, r.status) for r in records] == [(1, "Failed"), (2, "Completed")]
    assert records[1].ended_at == clock.now() and records[0].ended_at != clock.now()


async def test_failure_closes_the_attempt_with_a_structured_error(
    repo: SqlRepository, clock: ManualClock
) -> None:
    tq = queue(repo, clock)
    (task_id,) = await make_items(repo, TASKS, clock.now(), max_attempts=1)
    lease = (await tq.claim(task_id, "w")).lease
    assert lease is not None
    outcome = await tq.fail(lease.fence, "it broke", retry_class=RetryClass.RETRYABLE)
    assert not outcome.retrying  # one attempt only: dead-lettered
    (row,) = await attempts(repo, task_id)
    assert row.status == "Failed" and row.ended_at == clock.now()
    assert row.error == {"code": "error", "message": "it broke", "stack": None, "retryable": True}


async def test_the_reaper_closes_an_expired_attempt(
    repo: SqlRepository, clock: ManualClock
) -> None:
    tq = queue(repo, clock)
    (task_id,) = await make_items(repo, TASKS, clock.now())
    lease = (await tq.claim(task_id, "w")).lease
    assert lease is not None
    clock.advance(31)
    report = await tq.reclaim_expired()
    assert report.retried == [task_id]
    (row,) = await attempts(repo, task_id)
    assert row.status == "Expired"
    assert row.error is not None and row.error["code"] == "lease_expired"
    assert row.error["retryable"] is True


async def test_the_reaper_dead_letters_an_exhausted_attempt_with_its_record_closed(
    repo: SqlRepository, clock: ManualClock
) -> None:
    tq = queue(repo, clock)
    (task_id,) = await make_items(repo, TASKS, clock.now(), max_attempts=1)
    assert (await tq.claim(task_id, "w")).lease is not None
    clock.advance(31)
    report = await tq.reclaim_expired()
    assert report.dead_lettered == [task_id]
    (row,) = await attempts(repo, task_id)
    assert (row.status, row.ended_at) == ("Expired", clock.now())
    assert row.error is not None and row.error["code"] == "lease_expired"


async def test_cancellation_closes_the_running_attempt_only(
    repo: SqlRepository, clock: ManualClock
) -> None:
    tq = queue(repo, clock)
    running, queued = await make_items(repo, TASKS, clock.now(), 2)
    assert (await tq.claim(running, "w")).lease is not None
    assert await tq.cancel([running, queued], reason="operator said so") == {running, queued}
    (row,) = await attempts(repo, running)
    assert row.status == "Canceled"
    assert row.error == {
        "code": "canceled",
        "message": "operator said so",
        "stack": None,
        "retryable": False,
    }
    assert await attempts(repo, queued) == []


async def test_guarded_writes_touch_only_the_attempt_in_the_named_state(
    repo: SqlRepository, clock: ManualClock
) -> None:
    tq = queue(repo, clock)
    (task_id,) = await make_items(repo, TASKS, clock.now())
    lease = (await tq.claim(task_id, "w")).lease
    assert lease is not None
    async with repo.transaction() as tx:
        assert await tx.attempts.set_transport_if_running(
            task_id, 1, stream="trace-udf", message_id="1-0"
        )
        assert not await tx.attempts.set_transport_if_running(
            task_id, 2, stream="trace-udf", message_id="1-0"
        )
        # Still running: neither a result nor an error is kept yet.
        assert not await tx.attempts.set_result_if_ended(
            task_id, 1, status="Completed", result={"x": 1}
        )
        assert not await tx.attempts.set_error_if_ended(
            task_id, 1, statuses={"Failed"}, error={"code": "x"}
        )
    await tq.complete(lease.fence)
    async with repo.transaction() as tx:
        assert not await tx.attempts.set_transport_if_running(
            task_id, 1, stream="other", message_id="2-0"
        )
        assert await tx.attempts.set_result_if_ended(
            task_id, 1, status="Completed", result={"timings": {"run_s": 1.5}}
        )
        assert not await tx.attempts.set_error_if_ended(
            task_id, 1, statuses={"Failed"}, error={"code": "x"}
        )
    (row,) = await attempts(repo, task_id)
    assert (row.stream, row.message_id) == ("trace-udf", "1-0")
    assert row.result == {"timings": {"run_s": 1.5}}
    assert row.error is None


async def test_a_late_reply_after_a_timeout_completes_the_same_attempt(
    repo: SqlRepository, clock: ManualClock
) -> None:
    tq = queue(repo, clock)
    (task_id,) = await make_items(repo, TASKS, clock.now())
    lease = (await tq.claim(task_id, "w")).lease
    assert lease is not None
    await tq.fail(lease.fence, "ran too long", timed_out=True)
    assert [r.status for r in await attempts(repo, task_id)] == ["TimedOut"]
    clock.advance(1)
    await tq.complete(lease.fence)
    (row,) = await attempts(repo, task_id)
    assert row.status == "Completed" and row.ended_at == clock.now()


async def test_a_completion_keeps_its_result_on_the_record_in_the_same_write(
    repo: SqlRepository, clock: ManualClock
) -> None:
    tq = queue(repo, clock)
    (task_id,) = await make_items(repo, TASKS, clock.now())
    lease = (await tq.claim(task_id, "w1")).lease
    assert lease is not None
    fence = Fence(task_id, lease.attempt, lease.lease_token)
    await tq.complete(fence, result={"took_ms": 7})
    with pytest.raises(InvalidTransition):  # a repeated report writes nothing
        await tq.complete(fence, result={"took_ms": 8})
    (row,) = await attempts(repo, task_id)
    assert (row.status, row.result) == ("Completed", {"took_ms": 7})


async def test_a_holder_is_checked_by_the_fenced_write_itself(
    repo: SqlRepository, clock: ManualClock
) -> None:
    # The v1 routes' one-statement heartbeat and completion: the attempt's
    # record must name the worker and, when it names a stream message, the
    # report's message; anything else changes nothing.
    tq = queue(repo, clock)
    delivered, fallback = await make_items(repo, TASKS, clock.now(), 2)
    fences = {}
    for task_id in (delivered, fallback):
        lease = (await tq.claim(task_id, "w1")).lease
        assert lease is not None
        fences[task_id] = Fence(task_id, lease.attempt, lease.lease_token)
    async with repo.statement() as tx:
        assert await tx.attempts.set_transport_if_running(
            delivered, 1, stream="s", message_id="1-0"
        )
    clock.advance(5)
    expires = clock.now() + timedelta(seconds=30)
    for wrong in (Holder("w2"), Holder("w2", "s", "1-0")):
        with pytest.raises(StaleClaim):
            await tq.heartbeat(fences[delivered], holder=wrong)
    assert await tq.heartbeat(fences[delivered], holder=Holder("w1")) == expires
    for wrong in (Holder("w1", "s", "2-0"), Holder("w1", "t", "1-0"), Holder("w2", "s", "1-0")):
        with pytest.raises(StaleClaim):
            await tq.complete(fences[delivered], holder=wrong)
    assert [r.status for r in await attempts(repo, delivered)] == ["Running"]
    await tq.complete(fences[delivered], holder=Holder("w1", "s", "1-0"))
    # No message on the record (a database-fallback claim): only the worker counts.
    with pytest.raises(StaleClaim):
        await tq.complete(fences[fallback], holder=Holder("w2", "any", "x"))
    await tq.complete(fences[fallback], holder=Holder("w1", "any", "x"))
    for task_id in (delivered, fallback):
        assert [r.status for r in await attempts(repo, task_id)] == ["Completed"]
