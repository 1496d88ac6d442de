"""SQLite: statement scopes run on a sync connection, one thread hop per step.

The same statements, fences and errors as through the async path; a scope
that fails or is cancelled rolls back and returns its connection; writers of
several repositories on one file still serialize.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import anyio
import anyio.to_thread
import pytest
import sqlalchemy as sa

from tests.factories import make_job, run_on_separate_repos, wait_until
from trace_core.clock import ManualClock
from trace_core.errors import ConfigurationError, DuplicateItem, StorageError
from trace_core.model import TASKS, ClaimOutcome, Fence
from trace_core.storage import schema
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository
from trace_core.storage.sqlite_direct import SqliteDirect
from trace_core.tasks import TaskQueue

pytestmark = pytest.mark.anyio


@pytest.fixture
def engine() -> str:
    """Statement scopes on a sync connection are SQLite's: ``repo`` and
    ``database_url`` (tests/conftest.py) are a fresh SQLite file here."""
    return "sqlite"


def direct(repo: SqlRepository) -> SqliteDirect:
    engine = repo._sqlite
    assert engine is not None
    return engine


def database_path(repo: SqlRepository) -> str:
    path = repo.url.sync_url.database
    assert path is not None
    return path


async def count_tasks(repo: SqlRepository) -> int:
    async with repo.read() as tx:
        return int(
            (
                await tx.connection.execute(sa.select(sa.func.count()).select_from(schema.tasks))
            ).scalar_one()
        )


def assert_released(repo: SqlRepository) -> None:
    """No scope holds a connection of the sync engine or the file's write lock."""
    assert direct(repo).checked_out == 0
    assert write_lock_is_free(repo)


@contextmanager
def holding_write_lock(repo: SqlRepository) -> Iterator[sqlite3.Connection]:
    """Another connection (as another process would) holding the file's write lock."""
    holder = sqlite3.connect(database_path(repo), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        yield holder
    finally:
        holder.close()


async def wait_checked_out(repo: SqlRepository) -> None:
    await wait_until(
        "the scope to check out its connection",
        lambda: direct(repo).checked_out == 1,
        time.monotonic() + 30,
        describe=lambda: f"checked out: {direct(repo).checked_out}",
    )


async def assert_rolled_back_and_usable(repo: SqlRepository, tq: TaskQueue, job: uuid.UUID) -> None:
    """Nothing the scope wrote remains, nothing is held, and the next scope works."""
    assert await count_tasks(repo) == 0
    assert_released(repo)
    await tq.create([NewTask(job)])
    assert await count_tasks(repo) == 1


def write_lock_is_free(repo: SqlRepository) -> bool:
    """True if a writer of another connection gets the lock at once."""
    conn = sqlite3.connect(database_path(repo), timeout=0, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        conn.close()


async def test_a_claim_a_completion_and_a_small_create_are_few_thread_hops(
    repo: SqlRepository, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = await make_job(repo, clock.now())
    tq = TaskQueue(repo, clock=clock)
    real = anyio.to_thread.run_sync
    hops: list[str] = []

    async def counted(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        hops.append(getattr(func, "__name__", repr(func)))
        return await real(func, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", counted)
    await tq.create([NewTask(job)])
    # BEGIN IMMEDIATE + the tasks INSERT, the wake-up outbox row, COMMIT.
    assert hops == ["_execute", "_execute", "_finish"]
    hops.clear()
    [lease] = await tq.claim_batch("w", 10)
    # BEGIN IMMEDIATE + the claim and the attempt records (job_attempts), COMMIT.
    assert hops == ["_execute_then", "_finish"]
    hops.clear()
    assert await tq.complete_many([lease.fence]) == {lease.item_id}
    # BEGIN IMMEDIATE + the fenced completion and closing the attempt records, COMMIT.
    assert hops == ["_execute_then", "_finish"]
    await tq.create([NewTask(job)])
    [second] = await tq.claim_batch("w", 10)
    hops.clear()
    await tq.complete(second.fence)
    # BEGIN IMMEDIATE + the fenced transition and closing its attempt record, COMMIT.
    assert hops == ["_execute_then", "_finish"]
    monkeypatch.undo()
    # Nothing is weakened: each claim opened its record (with the lease's id),
    # each completion closed it.
    async with repo.read() as tx:
        records = await tx.attempts.of_tasks([lease.item_id, second.item_id])
    for claimed in (lease, second):
        [record] = records[claimed.item_id]
        assert record.attempt_id == claimed.attempt_id and record.worker_id == "w"
        assert (record.attempt, record.status) == (1, "Completed")
        assert record.ended_at == clock.now()


async def test_statements_do_not_wait_for_the_default_thread_limiter(
    repo: SqlRepository, clock: ManualClock
) -> None:
    # Sync operators and other threads of the process take anyio's default
    # tokens; a claim or a heartbeat must not queue behind them.
    job = await make_job(repo, clock.now())
    tq = TaskQueue(repo, clock=clock)
    default = anyio.to_thread.current_default_thread_limiter()
    saved = default.total_tokens
    release = threading.Event()
    held: list[bool] = []

    def hold_the_token() -> None:
        # Bounded, so that a regression fails instead of hanging.
        held.append(release.wait(timeout=30))

    default.total_tokens = 1
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, hold_the_token)
            await wait_until(
                "a thread to hold the only default token",
                lambda: default.borrowed_tokens == 1,
                time.monotonic() + 30,
                describe=lambda: f"borrowed: {default.borrowed_tokens}",
            )
            await tq.create([NewTask(job)])
            [lease] = await tq.claim_batch("w", 1)
            assert await tq.heartbeat(lease.fence)
            assert not held  # all done while the token was still held
            release.set()
    finally:
        release.set()
        default.total_tokens = saved
    assert held == [True]


async def test_complete_many_completes_only_current_fences(
    repo: SqlRepository, clock: ManualClock
) -> None:
    job = await make_job(repo, clock.now())
    tq = TaskQueue(repo, clock=clock)
    await tq.create([NewTask(job) for _ in range(3)])
    leases = await tq.claim_batch("w", 3)
    assert len(leases) == 3
    current = leases[0].fence
    wrong_token = Fence(leases[1].item_id, leases[1].attempt, uuid.uuid4(), leases[1].claim_version)
    # complete_many fences on the lease token and the attempt.
    wrong_attempt = Fence(
        leases[2].item_id, leases[2].attempt + 1, leases[2].lease_token, leases[2].claim_version
    )
    assert await tq.complete_many([current, wrong_token, wrong_attempt]) == {current.item_id}
    assert await tq.heartbeat(leases[1].fence)  # the two stale ones are untouched


async def test_errors_are_the_same_as_through_the_async_path(
    repo: SqlRepository, clock: ManualClock
) -> None:
    tq = TaskQueue(repo, clock=clock)
    unknown_job = NewTask(uuid.uuid4())  # a foreign key violation
    with pytest.raises(DuplicateItem, match="constraint violated") as direct_error:
        await tq.create([unknown_job])
    with pytest.raises(DuplicateItem, match="constraint violated") as async_error:
        async with repo.transaction() as tx:
            await tq.create([unknown_job], tx=tx)
    assert str(direct_error.value) == str(async_error.value)
    naive = datetime(2026, 1, 1)
    async with repo.statement() as tx:
        with pytest.raises(StorageError, match="naive datetime") as direct_naive:
            await tx.claim(TASKS, worker_id="w", lease_seconds=5, now=naive)
    async with repo.transaction() as tx:
        with pytest.raises(StorageError, match="naive datetime") as async_naive:
            await tx.claim(TASKS, worker_id="w", lease_seconds=5, now=naive)
    assert str(direct_naive.value) == str(async_naive.value)
    assert_released(repo)


async def test_a_scope_that_raises_rolls_back_and_its_connection_is_reused(
    repo: SqlRepository, clock: ManualClock
) -> None:
    job = await make_job(repo, clock.now())
    tq = TaskQueue(repo, clock=clock)
    with pytest.raises(RuntimeError, match="boom"):
        async with repo.statement() as tx:
            created = await tx.create_tasks([NewTask(job)], now=clock.now())
            assert created[0].created
            raise RuntimeError("boom")
    assert await count_tasks(repo) == 0
    assert_released(repo)
    # A statement that fails leaves the scope's transaction to roll back too.
    with pytest.raises(DuplicateItem):
        async with repo.statement() as tx:
            await tx.create_tasks([NewTask(job)], now=clock.now())
            await tx.create_tasks([NewTask(uuid.uuid4())], now=clock.now())
    await assert_rolled_back_and_usable(repo, tq, job)
    assert [lease.item_id for lease in await tq.claim_batch("w", 1)]


async def test_a_scope_cancelled_before_its_commit_rolls_back(
    repo: SqlRepository, clock: ManualClock
) -> None:
    job = await make_job(repo, clock.now())
    with anyio.CancelScope() as scope:
        async with repo.statement() as tx:
            await tx.create_tasks([NewTask(job)], now=clock.now())
            scope.cancel()
    assert scope.cancelled_caught
    assert await count_tasks(repo) == 0
    assert_released(repo)


async def test_a_scope_cancelled_while_its_statement_waits_for_the_lock_rolls_back(
    repo: SqlRepository, clock: ManualClock
) -> None:
    job = await make_job(repo, clock.now())
    tq = TaskQueue(repo, clock=clock)
    scope = anyio.CancelScope()

    async def create() -> None:
        with scope:
            await tq.create([NewTask(job)])

    # Another process's writer holds the lock: the scope's BEGIN IMMEDIATE
    # waits on its worker thread.
    with holding_write_lock(repo) as holder:
        async with anyio.create_task_group() as tg:
            tg.start_soon(create)
            await wait_checked_out(repo)
            scope.cancel()
            holder.execute("ROLLBACK")  # the statement now runs, then rolls back
    assert scope.cancelled_caught
    await assert_rolled_back_and_usable(repo, tq, job)


async def test_a_plain_asyncio_cancel_waits_for_the_abandoned_statement_then_rolls_back(
    repo: SqlRepository, clock: ManualClock
) -> None:
    # task.cancel() is not held off by anyio's shield: the statement's thread is
    # abandoned mid-wait. The rollback must still come after it, on its connection.
    job = await make_job(repo, clock.now())
    tq = TaskQueue(repo, clock=clock)
    with holding_write_lock(repo) as holder:
        task = asyncio.get_running_loop().create_task(tq.create([NewTask(job)]))
        await wait_checked_out(repo)
        task.cancel()
        holder.execute("ROLLBACK")
        with pytest.raises(asyncio.CancelledError):
            await task
    await assert_rolled_back_and_usable(repo, tq, job)


async def test_calls_after_close_are_refused(database_url: str) -> None:
    repo = SqlRepository(database_url)
    assert await TaskQueue(repo).claim_batch("w", 1) == []
    await repo.close()
    assert direct(repo).checked_out == 0
    with pytest.raises(ConfigurationError, match="closed"):
        await TaskQueue(repo).claim_batch("w", 1)


async def test_repositories_on_one_file_claim_an_item_once(
    database_url: str, clock: ManualClock
) -> None:
    setup = SqlRepository(database_url)
    try:
        job = await make_job(setup, clock.now())
        tq = TaskQueue(setup, clock=clock)
        [one] = await tq.create([NewTask(job)])
        batch = [c.task_id for c in await tq.create([NewTask(job) for _ in range(20)])]
    finally:
        await setup.close()
    outcomes: list[ClaimOutcome] = []
    batches: list[list[uuid.UUID | int]] = []

    async def race(repo: SqlRepository, n: int) -> None:
        queue = TaskQueue(repo, clock=clock)
        outcomes.append(await queue.claim(one.task_id, f"w{n}"))
        # The batch claims of every repository split the rest between them.
        while leases := await queue.claim_batch(f"w{n}", 3):
            batches.append([lease.item_id for lease in leases])

    await run_on_separate_repos(database_url, 4, race)
    assert len(outcomes) == 4
    assert sum(o.lease is not None for o in outcomes) == 1
    claimed = [item for b in batches for item in b]
    assert len(claimed) == len(set(claimed)) == len(batch)  # each once
    assert set(claimed) == set(batch)
