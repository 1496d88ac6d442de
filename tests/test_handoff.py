"""The one-commit hand-off on both engines: a task created while a consumer of
this process waits in ``claim_wait`` is inserted already claimed for it.

The hand-off must leave exactly what a normal claim leaves (fence, attempt
row, lease expiry from the same clock), never jump an older queued task, put
the consumer back to waiting when the enqueue fails, and leave a task whose
consumer is gone to the normal paths (claimable, or reclaimed by the reaper).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import sqlalchemy as sa

from tests.factories import make_job, wait_until
from trace_core.clock import ManualClock
from trace_core.errors import StaleClaim, TraceError
from trace_core.leasing import LeaseConfig
from trace_core.model import Fence, Lease
from trace_core.retry import Backoff, RetryPolicy
from trace_core.storage import schema
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository, SqlTransaction
from trace_core.tasks import ENQUEUE_TASK, TaskQueue
from trace_core.wakeup import Offer, WakeupHub

pytestmark = pytest.mark.anyio

LEASE = 30.0
BOUND = 10.0
"""Seconds a test waits for a condition before failing (never reached when green)."""


class Consumer:
    """A consumer blocked in ``claim_wait`` in the test's task group."""

    def __init__(
        self, tq: TaskQueue, worker_id: str, *, only_handoffs: bool = False, limit: int = 5
    ) -> None:
        self.tq = tq
        self.limit = limit
        self.worker_id = worker_id
        # A subscription to a channel nobody fires: the consumer then wakes
        # only for a hand-off, which makes "an older task is queued" exact.
        self.only_handoffs = only_handoffs
        self.got: list[Lease] | None = None
        self.scope = anyio.CancelScope()
        self.finished = False

    async def run(self) -> None:
        wakeups = self.tq.repo.hub.subscribe("nobody") if self.only_handoffs else None
        try:
            with self.scope:
                self.got = await self.tq.claim_wait(
                    self.worker_id,
                    self.limit,
                    max_wait=BOUND * 2,
                    lease_seconds=LEASE,
                    wakeups=wakeups,
                )
        finally:
            self.finished = True

    async def waiting(self) -> None:
        hub, key = self.tq.repo.hub, self.tq.handoff_key
        await wait_until(
            "the consumer to wait",
            lambda: hub.waiting(key) == 1,
            time.monotonic() + BOUND,
            describe=lambda: f"{hub.waiting(key)} offers",
        )

    async def done(self) -> list[Lease]:
        await wait_until(
            "the consumer to get work",
            lambda: self.got is not None,
            time.monotonic() + BOUND,
            describe=lambda: "still waiting",
        )
        assert self.got is not None
        return self.got


@asynccontextmanager
async def running(consumer: Consumer) -> AsyncIterator[Consumer]:
    """``consumer`` run in a task group and waiting in ``claim_wait``; the
    block's end waits for it to return."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(consumer.run)
        await consumer.waiting()
        yield consumer


async def task_row(repo: SqlRepository, task_id: uuid.UUID) -> dict[str, Any]:
    async with repo.read() as tx:
        row = (
            await tx.connection.execute(sa.select(schema.tasks).where(schema.tasks.c.id == task_id))
        ).one()
    return dict(row._mapping)


async def wakeup_ids(repo: SqlRepository) -> list[str]:
    async with repo.read() as tx:
        rows = await tx.connection.execute(
            sa.select(schema.outbox.c.payload).where(schema.outbox.c.kind == ENQUEUE_TASK)
        )
        return [i for r in rows for i in r.payload["task_ids"]]


async def task_count(repo: SqlRepository) -> int:
    async with repo.read() as tx:
        count = await tx.connection.execute(sa.select(sa.func.count()).select_from(schema.tasks))
        return int(count.scalar_one())


async def test_handed_off_task_is_exactly_a_claimed_task(
    repo: SqlRepository, clock: ManualClock
) -> None:
    """Row, lease, fence and attempt record equal a normal claim's, made at the
    same clock time; no wake-up is written for it; the fence works."""
    job = await make_job(repo, clock.now())
    tq = TaskQueue(repo, clock=clock)
    # The reference: created the normal way, then claimed.
    plain = TaskQueue(repo, clock=clock, handoff=False)
    [ref] = await plain.create([NewTask(job, input_versions={"v": 1}, partitions=["p"])])
    [ref_lease] = await plain.claim_batch("w1", 5, lease_seconds=LEASE)

    async with running(Consumer(tq, "w1")) as consumer:
        [made] = await tq.create([NewTask(job, input_versions={"v": 1}, partitions=["p"])])
        [lease] = await consumer.done()

    assert made.created and lease.item_id == made.task_id
    assert (lease.attempt, lease.claim_version, lease.worker_id) == (1, 1, "w1")
    assert lease.expires_at == clock.now() + timedelta(seconds=LEASE)
    assert lease.data == ref_lease.data
    assert lease.lease_token != ref_lease.lease_token
    row, ref_row = await task_row(repo, made.task_id), await task_row(repo, ref.task_id)
    differs = {"id", "lease_token"}
    assert {k: v for k, v in row.items() if k not in differs} == {
        k: v for k, v in ref_row.items() if k not in differs
    }
    assert row["lease_token"] == lease.lease_token
    async with repo.read() as tx:
        attempts = await tx.attempts.of_tasks([made.task_id, ref.task_id])
    [record], [ref_record] = attempts[made.task_id], attempts[ref.task_id]
    assert record.attempt_id == lease.attempt_id
    assert (record.attempt, record.worker_id, record.status, record.started_at) == (
        ref_record.attempt,
        ref_record.worker_id,
        ref_record.status,
        ref_record.started_at,
    )
    # The normal task's wake-up only: the handed-off one had nobody to wake.
    assert await wakeup_ids(repo) == [str(ref.task_id)]

    # A full fence: a foreign token, another attempt or claim_version is refused.
    for stale in (
        Fence(lease.item_id, lease.attempt, uuid.uuid4(), lease.claim_version),
        Fence(lease.item_id, lease.attempt + 1, lease.lease_token, lease.claim_version),
        Fence(lease.item_id, lease.attempt, lease.lease_token, lease.claim_version + 1),
        # another task's lease presented for this one
        Fence(lease.item_id, ref_lease.attempt, ref_lease.lease_token, ref_lease.claim_version),
    ):
        with pytest.raises(StaleClaim):
            await tq.complete(stale)
    await tq.heartbeat(lease.fence)
    await tq.complete(lease.fence)
    assert (await task_row(repo, made.task_id))["status"] == "Completed"


async def test_no_consumer_or_cancelled_consumer_leaves_a_normal_task(
    repo: SqlRepository, clock: ManualClock
) -> None:
    """A consumer cancelled before the enqueue withdraws its offer: the task is
    created queued, with its wake-up, and claimable by anyone."""
    job = await make_job(repo, clock.now())
    tq = TaskQueue(repo, clock=clock)
    async with running(Consumer(tq, "gone")) as consumer:
        consumer.scope.cancel()
    assert consumer.got is None
    assert repo.hub.waiting(tq.handoff_key) == 0

    [made] = await tq.create([NewTask(job)])
    assert (await task_row(repo, made.task_id))["status"] == "Queued"
    assert await wakeup_ids(repo) == [str(made.task_id)]
    [lease] = await tq.claim_batch("other", 5)
    assert lease.item_id == made.task_id and lease.attempt == 1


async def test_failed_or_rolled_back_enqueue_keeps_the_consumer_waiting(
    repo: SqlRepository, clock: ManualClock
) -> None:
    """An enqueue that fails (its statement refused) or a caller's transaction
    rolled back creates nothing, and the consumer goes on waiting; the next
    enqueue is handed to it."""
    job = await make_job(repo, clock.now())
    tq = TaskQueue(repo, clock=clock)
    async with running(Consumer(tq, "w1")) as consumer:
        with pytest.raises(TraceError):  # no such job: the foreign key refuses the insert
            await tq.create([NewTask(uuid.uuid4())])
        await consumer.waiting()

        class Abort(Exception):
            pass

        with pytest.raises(Abort):
            async with repo.transaction() as tx:
                await tq.create([NewTask(job)], tx=tx)
                raise Abort
        await consumer.waiting()
        assert await task_count(repo) == 0 and consumer.got is None

        [made] = await tq.create([NewTask(job)])
        [lease] = await consumer.done()
    assert lease.item_id == made.task_id
    assert await task_count(repo) == 1


async def test_an_older_queued_task_is_not_jumped(repo: SqlRepository, clock: ManualClock) -> None:
    """With a task queued before it, a new task is queued normally and the
    waiting consumer is given the older one; a duplicate dedupe key is
    answered as by a normal create."""
    job = await make_job(repo, clock.now())
    tq = TaskQueue(repo, clock=clock)
    async with running(Consumer(tq, "w1", only_handoffs=True, limit=1)) as consumer:
        # Queued behind the consumer's back (it only wakes for hand-offs).
        [older] = await TaskQueue(repo, clock=clock, handoff=False).create(
            [NewTask(job, dedupe_key="k")]
        )
        [again] = await tq.create([NewTask(job, dedupe_key="k")])
        assert (again.task_id, again.created) == (older.task_id, False)
        clock.advance(1)
        [newer] = await tq.create([NewTask(job)])
        [lease] = await consumer.done()
    assert lease.item_id == older.task_id
    assert (await task_row(repo, newer.task_id))["status"] == "Queued"
    assert await wakeup_ids(repo) == [str(older.task_id), str(newer.task_id)]


async def test_a_dedupe_key_whose_task_runs_is_answered_as_by_a_normal_create(
    repo: SqlRepository, clock: ManualClock
) -> None:
    """A key whose task is not queued (it runs) does not block the hand-off
    test, but the insert finds the key taken: the create answers the existing
    task, nothing is written, and the consumer is handed the next new task."""
    job = await make_job(repo, clock.now())
    tq = TaskQueue(repo, clock=clock)
    plain = TaskQueue(repo, clock=clock, handoff=False)
    [busy] = await plain.create([NewTask(job, dedupe_key="k")])
    [lease] = await plain.claim_batch("w0", 1)
    assert lease.item_id == busy.task_id
    async with running(Consumer(tq, "w1", only_handoffs=True)) as consumer:
        [again] = await tq.create([NewTask(job, dedupe_key="k")])
        assert (again.task_id, again.created) == (busy.task_id, False)
        await consumer.waiting()
        clock.advance(1)
        [made] = await tq.create([NewTask(job, dedupe_key="other")])
        [handed] = await consumer.done()
    assert handed.item_id == made.task_id and made.created
    assert await task_count(repo) == 2
    async with repo.read() as tx:
        attempts = await tx.attempts.of_tasks([busy.task_id, made.task_id])
    assert [r.worker_id for r in attempts[busy.task_id]] == ["w0"]
    assert [(r.worker_id, r.attempt_id) for r in attempts[made.task_id]] == [
        ("w1", handed.attempt_id)
    ]


async def test_a_later_bulk_task_does_not_block_the_handoff(
    repo: SqlRepository, clock: ManualClock
) -> None:
    """Only a task the claim would take first blocks a hand-off: one queued
    with a handicap that puts it after the new task does not."""
    job = await make_job(repo, clock.now())
    tq = TaskQueue(repo, clock=clock)
    async with running(Consumer(tq, "w1", only_handoffs=True)) as consumer:
        await TaskQueue(repo, clock=clock, handoff=False).create(
            [NewTask(job, handicap_seconds=60)]
        )
        [made] = await tq.create([NewTask(job)])
        [lease] = await consumer.done()
    assert lease.item_id == made.task_id


async def test_reaper_reclaims_a_handed_off_task_whose_consumer_died(
    repo: SqlRepository, clock: ManualClock
) -> None:
    """The consumer got the lease and died before starting: the lease expires,
    the reaper fails the attempt, the retry is claimed as attempt 2, and the
    dead consumer's fence is stale."""
    job = await make_job(repo, clock.now())
    policy = RetryPolicy(normal=Backoff(base_seconds=1.0, cap_seconds=1.0, jitter=0.0))
    tq = TaskQueue(repo, clock=clock, config=LeaseConfig(lease_seconds=LEASE), retry=policy)
    async with running(Consumer(tq, "doomed")) as consumer:
        [made] = await tq.create([NewTask(job)])
        [dead] = await consumer.done()

    clock.advance(LEASE + 1)
    report = await tq.reclaim_expired()
    assert report.retried == [made.task_id]
    clock.advance(2)
    assert await tq.requeue_due() == [made.task_id]
    [lease] = await tq.claim_batch("heir", 5)
    assert (lease.item_id, lease.attempt, lease.claim_version) == (made.task_id, 2, 2)
    with pytest.raises(StaleClaim):
        await tq.complete(dead.fence)
    await tq.complete(lease.fence)


async def test_consumer_cancelled_during_the_commit_leaves_it_to_the_reaper(
    repo: SqlRepository, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consumer cancelled while the creator commits its hand-off never gets
    the lease: the creator ends the lease at once and the reaper's next round
    retries the task, which is claimed as attempt 2."""
    job = await make_job(repo, clock.now())
    policy = RetryPolicy(normal=Backoff(base_seconds=1.0, cap_seconds=1.0, jitter=0.0))
    tq = TaskQueue(repo, clock=clock, retry=policy)
    consumer = Consumer(tq, "cancelled")
    real = SqlTransaction.create_claimed_tasks

    async def commit_then_cancel(self: SqlTransaction, *args: Any, **kwargs: Any) -> Any:
        made = await real(self, *args, **kwargs)  # committed: its own statement
        consumer.scope.cancel()
        await wait_until(
            "the consumer to leave",
            lambda: consumer.finished,
            time.monotonic() + BOUND,
            describe=str,
        )
        return made

    async with running(consumer):
        monkeypatch.setattr(SqlTransaction, "create_claimed_tasks", commit_then_cancel)
        [made] = await tq.create([NewTask(job)])
        monkeypatch.undo()
    assert made.created and consumer.got is None
    row = await task_row(repo, made.task_id)
    assert (row["status"], row["worker_id"], row["lease_expires_at"]) == (
        "Running",
        "cancelled",
        clock.now(),
    )
    clock.advance(0.001)
    assert (await tq.reclaim_expired()).retried == [made.task_id]
    clock.advance(2)
    assert await tq.requeue_due() == [made.task_id]
    [lease] = await tq.claim_batch("heir", 5)
    assert (lease.item_id, lease.attempt) == (made.task_id, 2)


async def test_offer_taken_then_abandoned_is_reported_gone() -> None:
    """The hub's book: a consumer cancelled while its offer is taken (the
    creator's commit under way) leaves it ``gone``, and the creator learns it;
    a consumer whose wait ends otherwise (a fire, its time) waits for the
    hand-off instead."""
    hub = WakeupHub()
    gone: Offer[str] = Offer("k", "w", 1, LEASE)
    kept: Offer[str] = Offer("k", "w", 1, LEASE)
    scope = anyio.CancelScope()
    results: list[bool] = []

    async def wait(offer: Offer[str], max_wait: float, cancel: anyio.CancelScope | None) -> None:
        with cancel or anyio.CancelScope():
            results.append(await hub.wait("ch", max_wait, offer=offer))

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait, gone, BOUND, scope)
        await wait_until(
            "an offer", lambda: hub.waiting("k") == 1, time.monotonic() + BOUND, describe=str
        )
        taken = hub.take("k", 1)
        assert taken is gone and hub.take("k", 1) is None
        scope.cancel()
    assert hub.settle(gone, "work") is False and gone.value is None

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait, kept, BOUND, None)
        await wait_until(
            "an offer", lambda: hub.waiting("k") == 1, time.monotonic() + BOUND, describe=str
        )
        assert hub.take("k", 2) is None  # it takes one item only
        assert hub.take("k", 1) is kept
        hub.fire("ch")  # its wait ends while the offer is taken: it waits on
        for _ in range(20):
            await anyio.lowlevel.checkpoint()
        assert results == []
        assert hub.settle(kept, "work") is True
    assert kept.value == "work" and results == [True]


async def test_a_handoff_is_one_commit_in_one_step(
    repo: SqlRepository, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The enqueue of a handed-off task is its claim too, in one step: on
    SQLite no thread hop at all (BEGIN IMMEDIATE, the insert, its attempt
    record and COMMIT run on the event loop: tests/test_handoff_sqlite_inline.py);
    on Postgres one statement in autocommit on the direct path."""
    job = await make_job(repo, clock.now())
    tq = TaskQueue(repo, clock=clock)
    # SQLite: the first hand-off opens the event loop's connection on a thread.
    async with running(Consumer(tq, "w0")) as first:
        await tq.create([NewTask(job)])
        await first.done()
    steps: list[str] = []
    target: Any  # what is patched: a module on SQLite, a class on Postgres
    counted: Any
    if repo.engine_name == "sqlite":
        real_hop = anyio.to_thread.run_sync

        async def hop(func: Any, *args: Any, **kwargs: Any) -> Any:
            steps.append(getattr(func, "__name__", repr(func)))
            return await real_hop(func, *args, **kwargs)

        target, name, counted = anyio.to_thread, "run_sync", hop
    else:
        from trace_core.storage.pg_direct import DirectPool

        real_fetch = DirectPool.fetch

        async def fetch(pool: DirectPool, stmt: Any, params: Any) -> Any:
            steps.append("fetch")
            return await real_fetch(pool, stmt, params)

        target, name, counted = DirectPool, "fetch", fetch
    async with running(Consumer(tq, "w1")) as consumer:
        monkeypatch.setattr(target, name, counted)
        [made] = await tq.create([NewTask(job)])
        monkeypatch.undo()
        [lease] = await consumer.done()
    assert lease.item_id == made.task_id
    assert steps == ([] if repo.engine_name == "sqlite" else ["fetch"])


async def test_a_consumer_on_another_event_loop_sharing_the_hub_is_handed_the_task(
    database_url: str, repo: SqlRepository, clock: ManualClock
) -> None:
    """Two repositories of one database sharing a hub (each event loop its
    own): the creator's commit hands the task to the other loop's consumer."""
    job = await make_job(repo, clock.now())
    shared = WakeupHub()
    got: list[Lease] = []

    def consumer_thread() -> None:
        async def run() -> None:
            mine = SqlRepository(database_url, hub=shared)
            try:
                tq = TaskQueue(mine, clock=clock)
                got.extend(await tq.claim_wait("w-thread", 5, max_wait=BOUND * 2))
            finally:
                await mine.close()

        anyio.run(run, backend="asyncio")

    creator_repo = SqlRepository(database_url, hub=shared)
    thread = threading.Thread(target=consumer_thread)
    thread.start()
    try:
        tq = TaskQueue(creator_repo, clock=clock)
        await wait_until(
            "the consumer to wait",
            lambda: shared.waiting(tq.handoff_key) == 1,
            time.monotonic() + BOUND,
            describe=str,
        )
        [made] = await tq.create([NewTask(job)])
    finally:
        await anyio.to_thread.run_sync(thread.join, BOUND)
        await creator_repo.close()
    assert [lease.item_id for lease in got] == [made.task_id]
    assert (await task_row(repo, made.task_id))["worker_id"] == "w-thread"
