"""Concurrency limits at claim time, on both engines, with real concurrent claimers."""

from __future__ import annotations

import uuid
from collections import Counter
from datetime import timedelta

import anyio
import anyio.lowlevel
import pytest
import sqlalchemy as sa

from tests.factories import JobDef, build_dag, queue_tasks, run_on_separate_repos
from trace_core.clock import ManualClock
from trace_core.dispatcher.concurrency import (
    CONCURRENCY_WAIT,
    ConcurrencyConfig,
    ConcurrencyGate,
    JobLimits,
)
from trace_core.dispatcher.journal import read_journal
from trace_core.errors import ConfigurationError
from trace_core.model import NotClaimedReason
from trace_core.storage import schema
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import TaskQueue

pytestmark = pytest.mark.anyio

JOBS = [
    JobDef("limited", outputs=("a",), scaling={"max_concurrency": 2}, operator="spark"),
    JobDef("free", outputs=("b",), operator="lambda_op"),
]


async def running(repo: SqlRepository, job_id: uuid.UUID) -> int:
    t = schema.tasks
    async with repo.read() as tx:
        return int(
            (
                await tx.connection.execute(
                    sa.select(sa.func.count()).where(t.c.job_id == job_id, t.c.status == "Running")
                )
            ).scalar_one()
        )


async def waits(repo: SqlRepository, job_id: uuid.UUID) -> int:
    async with repo.read() as tx:
        entries = await read_journal(tx, job_id)
    return sum(1 for e in entries if e["kind"] == CONCURRENCY_WAIT)


def gate(
    repo: SqlRepository, clock: ManualClock, config: ConcurrencyConfig | None = None
) -> ConcurrencyGate:
    return ConcurrencyGate(TaskQueue(repo, clock=clock), config=config)


async def test_simultaneous_claims_grant_exactly_the_limit(
    database_url: str, repo: SqlRepository, clock: ManualClock
) -> None:
    ids = await build_dag(repo, clock.now(), JOBS)
    tasks = await queue_tasks(TaskQueue(repo, clock=clock), ids["limited"], 8)
    outcomes: list[NotClaimedReason | None] = []

    async def claimer(r: SqlRepository, n: int) -> None:
        outcome = await gate(r, clock).claim(tasks[n], f"w{n}")
        outcomes.append(outcome.reason)

    await run_on_separate_repos(database_url, len(tasks), claimer)
    assert outcomes.count(None) == 2
    assert outcomes.count(NotClaimedReason.CONCURRENCY_LIMIT) == 6
    assert await running(repo, ids["limited"]) == 2


async def test_churning_claimers_never_exceed_the_limit(
    database_url: str, repo: SqlRepository, clock: ManualClock
) -> None:
    ids = await build_dag(repo, clock.now(), JOBS)
    tasks = await queue_tasks(TaskQueue(repo, clock=clock), ids["limited"], 20)
    done: set[uuid.UUID] = set()
    held = 0
    peak = 0

    async def claimer(r: SqlRepository, n: int) -> None:
        nonlocal held, peak
        g = gate(r, clock)
        while len(done) < len(tasks):
            for task_id in tasks:
                if task_id in done:
                    continue
                outcome = await g.claim(task_id, f"w{n}")
                if outcome.lease is None:
                    continue
                held += 1
                peak = max(peak, held)
                for _ in range(3):  # hold it a few round trips while the others try
                    assert await running(r, ids["limited"]) <= 2
                    await anyio.lowlevel.checkpoint()
                held -= 1  # before completing: "held" never exceeds what the DB has
                done.add(task_id)
                await g.tasks.complete(outcome.lease.fence)

    await run_on_separate_repos(database_url, 6, claimer)
    assert len(done) == 20
    assert 1 <= peak <= 2
    assert await running(repo, ids["limited"]) == 0


async def test_unlimited_jobs_take_the_plain_path(repo: SqlRepository, clock: ManualClock) -> None:
    ids = await build_dag(repo, clock.now(), JOBS)
    tasks = await queue_tasks(TaskQueue(repo, clock=clock), ids["free"], 5)
    g = gate(repo, clock)
    assert all([(await g.claim(t, "w1")).claimed for t in tasks])
    async with repo.read() as tx:
        rows = (await tx.connection.execute(sa.select(schema.job_states.c.job_id))).all()
    assert rows == []  # no lock row for a job without a limit
    assert await g.job_limits([ids["free"]]) == {ids["free"]: JobLimits(None, None)}


async def test_refusals_other_than_the_limit_keep_their_reason(
    repo: SqlRepository, clock: ManualClock
) -> None:
    ids = await build_dag(repo, clock.now(), JOBS)
    tq = TaskQueue(repo, clock=clock)
    tasks = await queue_tasks(tq, ids["limited"], 3)
    g = gate(repo, clock)
    first = await g.claim(tasks[0], "w1")
    assert first.lease is not None
    assert (await g.claim(tasks[1], "w1")).claimed
    assert (await g.claim(tasks[0], "w2")).reason is NotClaimedReason.ALREADY_RUNNING
    assert (await g.claim(tasks[2], "w2")).reason is NotClaimedReason.CONCURRENCY_LIMIT
    await tq.cancel([tasks[2]])
    assert (await g.claim(tasks[2], "w2")).reason is NotClaimedReason.CANCELED
    assert (await g.claim(uuid.uuid4(), "w2")).reason is NotClaimedReason.NOT_FOUND
    await tq.complete(first.lease.fence)
    assert (await g.claim(tasks[0], "w2")).reason is NotClaimedReason.COMPLETED


async def test_waits_are_journaled_at_most_once_per_interval(
    repo: SqlRepository, clock: ManualClock
) -> None:
    ids = await build_dag(repo, clock.now(), JOBS)
    tasks = await queue_tasks(TaskQueue(repo, clock=clock), ids["limited"], 4)
    g = gate(repo, clock, ConcurrencyConfig(journal_interval_seconds=60))
    for t in tasks[:2]:
        assert (await g.claim(t, "w1")).claimed
    for _ in range(3):
        assert (await g.claim(tasks[2], "w2")).reason is NotClaimedReason.CONCURRENCY_LIMIT
    assert await waits(repo, ids["limited"]) == 1
    clock.advance(59)
    await g.claim(tasks[3], "w2")
    assert await waits(repo, ids["limited"]) == 1
    clock.advance(1)
    await g.claim(tasks[3], "w2")
    assert await waits(repo, ids["limited"]) == 2
    async with repo.read() as tx:
        [entry, *_] = await read_journal(tx, ids["limited"])
    assert entry["message"] == "claim refused: 2 tasks running, max_concurrency 2"
    assert entry["detail"] == {"running": 2, "max_concurrency": 2}


async def test_lease_length_is_the_jobs_heartbeat_timeout(
    repo: SqlRepository, clock: ManualClock
) -> None:
    jobs = [
        JobDef("slow", outputs=("s",), heartbeat_timeout_seconds=120),
        JobDef("slow_limited", outputs=("t",), heartbeat_timeout_seconds=90, scaling={}),
    ]
    ids = await build_dag(repo, clock.now(), jobs)
    tq = TaskQueue(repo, clock=clock)
    [a] = await queue_tasks(tq, ids["slow"], 1)
    [b] = await queue_tasks(tq, ids["slow_limited"], 1)
    g = gate(repo, clock)
    lease = (await g.claim(a, "w1")).lease
    assert lease is not None
    assert lease.expires_at == clock.now() + timedelta(seconds=120)
    [batch] = await g.claim_batch("w1", 5)
    assert batch.item_id == b
    assert batch.expires_at == clock.now() + timedelta(seconds=90)


async def test_claim_batch_respects_every_limit(repo: SqlRepository, clock: ManualClock) -> None:
    ids = await build_dag(repo, clock.now(), JOBS)
    tq = TaskQueue(repo, clock=clock)
    await queue_tasks(tq, ids["limited"], 10)  # older than all of "free"'s
    clock.advance(1)
    free = await queue_tasks(tq, ids["free"], 3)
    g = gate(repo, clock, ConcurrencyConfig(batch_scan_factor=4))
    first = await g.claim_batch("w1", 2)
    assert [le.data["job_id"] for le in first] == [ids["limited"]] * 2
    # "limited" is full now: the scan skips its tasks and reaches the others.
    second = await g.claim_batch("w1", 10)
    assert sorted(le.item_id for le in second) == sorted(free)
    assert await g.claim_batch("w1", 10) == []
    await tq.complete(first[0].fence)
    [third] = await g.claim_batch("w1", 10)
    assert third.data["job_id"] == ids["limited"]
    assert await running(repo, ids["limited"]) == 2
    with pytest.raises(ConfigurationError):
        await g.claim_batch("w1", 0)


async def test_concurrent_batch_claimers_never_exceed_the_limit(
    database_url: str, repo: SqlRepository, clock: ManualClock
) -> None:
    ids = await build_dag(repo, clock.now(), JOBS)
    tq = TaskQueue(repo, clock=clock)
    await queue_tasks(tq, ids["limited"], 12)
    free = await queue_tasks(tq, ids["free"], 12)
    got: list[object] = []
    jobs_of: list[uuid.UUID] = []

    async def poller(r: SqlRepository, n: int) -> None:
        g = gate(r, clock)
        for _ in range(6):
            for lease in await g.claim_batch(f"w{n}", 3):
                got.append(lease.item_id)
                jobs_of.append(lease.data["job_id"])

    await run_on_separate_repos(database_url, 4, poller)
    assert len(got) == len(set(got))  # never twice
    assert jobs_of.count(ids["limited"]) == 2
    assert set(free) <= set(got)
    assert await running(repo, ids["limited"]) == 2


async def test_in_flight_by_operator(repo: SqlRepository, clock: ManualClock) -> None:
    ids = await build_dag(repo, clock.now(), JOBS)
    tq = TaskQueue(repo, clock=clock)
    g = gate(repo, clock)
    for t in await queue_tasks(tq, ids["limited"], 3):
        await g.claim(t, "w1")
    for t in await queue_tasks(tq, ids["free"], 3):
        await g.claim(t, "w1")
    await queue_tasks(tq, ids["free"], 2)  # queued, not in flight
    assert await g.in_flight_by_operator() == {"spark": 2, "lambda_op": 3}


def test_limits_and_config_are_validated() -> None:
    job = uuid.uuid4()
    assert JobLimits.from_row(job, None, None) == JobLimits(None, None)
    assert JobLimits.from_row(job, {"max_concurrency": 3}, 30) == JobLimits(3, 30.0)
    for bad in ({"max_concurrency": 0}, {"max_concurrency": True}, {"max_concurrency": "2"}):
        with pytest.raises(ConfigurationError, match="max_concurrency"):
            JobLimits.from_row(job, bad, None)
    with pytest.raises(ConfigurationError):
        ConcurrencyConfig(journal_interval_seconds=-1)
    with pytest.raises(ConfigurationError):
        ConcurrencyConfig(batch_scan_factor=0)


async def wakeups(repo: SqlRepository) -> Counter[tuple[str, ...]]:
    """The task ids of every wake-up outbox row."""
    o = schema.outbox
    async with repo.read() as tx:
        rows = await tx.connection.execute(sa.select(o.c.payload).where(o.c.kind == "enqueue_task"))
        return Counter(tuple(r.payload["task_ids"]) for r in rows)


async def test_a_freed_slot_wakes_the_oldest_waiting_tasks(
    repo: SqlRepository, clock: ManualClock
) -> None:
    """Wake-up driven claims refused at the limit are dropped; finishing a
    task must wake the waiting ones, oldest first, as many as slots are free."""
    ids = await build_dag(repo, clock.now(), JOBS)
    tq = TaskQueue(repo, clock=clock)
    tasks = []
    for _ in range(5):  # one at a time, so their queue order is known
        tasks += await queue_tasks(tq, ids["limited"], 1)
        clock.advance(1)
    g = gate(repo, clock)
    leases = [(await g.claim(t, "w1")).lease for t in tasks[:2]]
    assert (await g.claim(tasks[2], "w1")).reason is NotClaimedReason.CONCURRENCY_LIMIT
    before = await wakeups(repo)

    assert await g.wake_waiting(tasks[0]) == []  # nothing finished: no free slot
    assert leases[0] is not None and leases[1] is not None
    await tq.complete(leases[0].fence)
    assert await g.wake_waiting(tasks[0]) == [tasks[2]]  # one slot: the oldest waiter
    await tq.fail(leases[1].fence, "boom")
    assert await g.wake_waiting(tasks[1]) == [tasks[2], tasks[3]]  # two slots now
    added = await wakeups(repo) - before
    assert added == Counter({(str(tasks[2]),): 1, (str(tasks[2]), str(tasks[3])): 1})
    assert await g.wake_waiting(uuid.uuid4()) == []  # an unknown task wakes nothing
    free = await queue_tasks(tq, ids["free"], 1)
    assert await g.wake_waiting(free[0]) == []  # an unlimited job has no waiters
