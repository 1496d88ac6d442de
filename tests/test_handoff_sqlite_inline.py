"""SQLite: the one-commit hand-off on the event loop itself, and what bounds it.

With ``synchronous`` NORMAL (the default; the WAL commit writes without an
fsync) a hand-off runs its transaction on the event loop, on a connection
that never waits for a lock and never checkpoints. These tests hold it to
that: a write lock held elsewhere sends it to the thread (the loop keeps
running meanwhile), every ``INLINE_CHECKPOINT_EVERY``-th goes through the
thread (whose commit checkpoints), and a ``synchronous`` FULL repository
never runs it on the loop.
"""

from __future__ import annotations

import sqlite3
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest

from tests.factories import make_job, wait_until
from tests.test_handoff import BOUND, Consumer, running, task_row
from trace_core.clock import ManualClock
from trace_core.errors import TraceError
from trace_core.storage import sqlite_direct
from trace_core.storage.engine import EngineSettings
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import TaskQueue

pytestmark = pytest.mark.anyio


@pytest.fixture
def engine() -> str:
    """The hand-off on the event loop is SQLite's (Postgres has no thread hop)."""
    return "sqlite"


@asynccontextmanager
async def counted_hops(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[list[str]]:
    """The names of the functions sent to a worker thread within the block."""
    hops: list[str] = []
    real = anyio.to_thread.run_sync

    async def hop(func: Any, *args: Any, **kwargs: Any) -> Any:
        hops.append(getattr(func, "__name__", repr(func)))
        return await real(func, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(anyio.to_thread, "run_sync", hop)
        yield hops


def inline_connection(repo: SqlRepository) -> Any:
    """The connection the hand-off keeps for the event loop (None: none open)."""
    direct = repo._sqlite
    assert direct is not None
    return direct._raw._inline_kept


async def hand_off(repo: SqlRepository, tq: TaskQueue, job: Any, worker: str) -> Any:
    """One task handed to a consumer waiting for it; the consumer's lease."""
    async with running(Consumer(tq, worker)) as consumer:
        [made] = await tq.create([NewTask(job)])
        [lease] = await consumer.done()
    assert lease.item_id == made.task_id
    return lease


async def test_a_handoff_runs_on_the_loop_on_a_connection_that_never_waits_or_checkpoints(
    repo: SqlRepository, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = await make_job(repo, clock.now())
    tq = TaskQueue(repo, clock=clock)
    await hand_off(repo, tq, job, "w0")  # the first opens the loop's connection
    async with running(Consumer(tq, "w1")) as consumer:
        async with counted_hops(monkeypatch) as hops:
            [made] = await tq.create([NewTask(job)])
        [lease] = await consumer.done()
    assert hops == []
    assert lease.item_id == made.task_id
    assert (await task_row(repo, made.task_id))["worker_id"] == "w1"
    kept = inline_connection(repo)
    assert kept is not None
    db: Any = kept.dbapi_connection
    assert db.execute("PRAGMA busy_timeout").fetchone() == (0,)
    assert db.execute("PRAGMA wal_autocheckpoint").fetchone() == (0,)


async def test_a_write_lock_held_elsewhere_sends_the_handoff_to_the_thread_and_the_loop_runs_on(
    repo: SqlRepository, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = await make_job(repo, clock.now())
    tq = TaskQueue(repo, clock=clock)
    path = repo.url.sync_url.database
    assert path is not None
    await hand_off(repo, tq, job, "w0")  # the first opens the loop's connection
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    ticks = 0
    made: list[Any] = []

    async def ticker() -> None:
        nonlocal ticks
        while not made:
            ticks += 1
            await anyio.lowlevel.checkpoint()

    async def create() -> None:
        made.extend(await tq.create([NewTask(job)]))

    try:
        async with running(Consumer(tq, "w1")) as consumer:
            other.execute("BEGIN IMMEDIATE")  # another process's writer, say
            async with counted_hops(monkeypatch) as hops, anyio.create_task_group() as tg:
                tg.start_soon(create)
                await wait_until(
                    "the hand-off to wait on its thread",
                    lambda: hops == ["_execute_then_commit"],
                    time.monotonic() + BOUND,
                    describe=lambda: f"hops {hops}",
                )
                seen = ticks
                tg.start_soon(ticker)
                # The loop is free while the hand-off waits for the lock.
                await wait_until(
                    "the event loop to run meanwhile",
                    lambda: ticks >= seen + 50,
                    time.monotonic() + BOUND,
                    describe=lambda: f"{ticks - seen} ticks",
                )
                assert not made
                other.execute("COMMIT")
            [lease] = await consumer.done()
    finally:
        other.close()
    assert lease.item_id == made[0].task_id
    assert (await task_row(repo, made[0].task_id))["worker_id"] == "w1"


async def test_every_nth_handoff_goes_through_the_thread_whose_commit_checkpoints(
    repo: SqlRepository, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_direct, "INLINE_CHECKPOINT_EVERY", 2)
    job = await make_job(repo, clock.now())
    tq = TaskQueue(repo, clock=clock)
    await hand_off(repo, tq, job, "w0")  # the 1st: opens the loop's connection
    per_handoff: list[list[str]] = []
    for n in range(1, 5):
        async with counted_hops(monkeypatch) as hops:
            await hand_off(repo, tq, job, f"w{n}")
        # The consumer's own claim_batch hops too; only the hand-off's counts.
        per_handoff.append([h for h in hops if h == "_execute_then_commit"])
    # The 2nd, 3rd, 4th, 5th: every 2nd through the thread.
    assert per_handoff == [["_execute_then_commit"], [], ["_execute_then_commit"], []]


async def test_a_synchronous_full_repository_never_hands_off_on_the_loop(
    database_url: str, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``synchronous`` FULL every commit fsyncs: that stays off the loop."""
    full = SqlRepository(database_url, EngineSettings(sqlite_synchronous="FULL"))
    try:
        job = await make_job(full, clock.now())
        tq = TaskQueue(full, clock=clock)
        async with running(Consumer(tq, "w1")) as consumer:
            async with counted_hops(monkeypatch) as hops:
                [made] = await tq.create([NewTask(job)])
            [lease] = await consumer.done()
        assert hops == ["_execute_then_commit"]
        assert lease.item_id == made.task_id
    finally:
        await full.close()


async def test_a_refused_handoff_on_the_loop_closes_its_connection_and_the_next_runs_there(
    repo: SqlRepository, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = await make_job(repo, clock.now())
    tq = TaskQueue(repo, clock=clock)
    await hand_off(repo, tq, job, "w0")  # the first opens the loop's connection
    async with running(Consumer(tq, "w1")) as consumer:
        async with counted_hops(monkeypatch) as hops:
            with pytest.raises(TraceError):  # no such job: the foreign key refuses it
                await tq.create([NewTask(uuid.uuid4())])
        assert hops == [] and inline_connection(repo) is None
        await consumer.waiting()
        # The next opens a new one on its thread, the one after runs on it.
        async with counted_hops(monkeypatch) as hops:
            [made] = await tq.create([NewTask(job)])
        [lease] = await consumer.done()
    assert hops == ["_execute_then_commit"] and inline_connection(repo) is not None
    assert lease.item_id == made.task_id
    async with counted_hops(monkeypatch) as hops:
        await hand_off(repo, tq, job, "w2")
    assert [h for h in hops if h == "_execute_then_commit"] == []
