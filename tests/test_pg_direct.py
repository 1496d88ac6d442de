"""Postgres: the protocol's single statements run on the driver directly.

The same statements, fences and errors as through SQLAlchemy; a connection
that is not cleanly idle after a call is never reused.
"""

from __future__ import annotations

import time
import uuid
from datetime import datetime

import anyio
import pytest
import sqlalchemy as sa

from tests.factories import make_job, wait_until
from trace_core.clock import ManualClock
from trace_core.errors import (
    ConfigurationError,
    DatabaseUnavailable,
    DuplicateItem,
    StorageError,
)
from trace_core.model import TASKS
from trace_core.storage.pg_direct import DirectPool
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import TaskQueue

pytestmark = pytest.mark.anyio


@pytest.fixture
def engine() -> str:
    """The direct driver path is Postgres's: ``repo`` (tests/conftest.py) is a
    fresh Postgres database here."""
    return "postgres"


def direct_pool(repo: SqlRepository) -> DirectPool:
    pool = repo._direct
    assert pool is not None
    return pool


async def test_driver_errors_are_translated_as_through_sqlalchemy(
    repo: SqlRepository, clock: ManualClock
) -> None:
    tq = TaskQueue(repo, clock=clock)
    unknown_job = NewTask(uuid.uuid4())
    with pytest.raises(DuplicateItem, match="constraint violated"):
        await tq.create([unknown_job])  # direct: one statement
    with pytest.raises(DuplicateItem, match="constraint violated"):
        async with repo.transaction() as tx:
            await tq.create([unknown_job], tx=tx)
    naive = datetime(2026, 1, 1)
    async with repo.statement() as tx:
        with pytest.raises(StorageError, match="naive datetime"):
            await tx.claim(TASKS, worker_id="w", lease_seconds=5, now=naive)


async def test_a_connection_killed_under_it_is_dropped_not_reused(
    repo: SqlRepository, clock: ManualClock
) -> None:
    tq = TaskQueue(repo, clock=clock)
    assert await tq.claim_batch("w", 1) == []
    assert direct_pool(repo).idle == 1
    async with repo.autocommit() as tx:
        await tx.connection.execute(
            sa.text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        )
    with pytest.raises(DatabaseUnavailable):
        await tq.claim_batch("w", 1)
    assert direct_pool(repo).idle == 0
    assert await tq.claim_batch("w", 1) == []  # a new connection
    assert direct_pool(repo).idle == 1


async def test_a_cancelled_statement_closes_its_connection(
    repo: SqlRepository, clock: ManualClock
) -> None:
    job = await make_job(repo, clock.now())
    tq = TaskQueue(repo, clock=clock)
    await tq.create([NewTask(job)])
    [lease] = await tq.claim_batch("w", 1)
    assert await tq.heartbeat(lease.fence)
    assert direct_pool(repo).idle == 1
    # Hold the row lock so the next heartbeat waits inside the server.
    async with repo.transaction() as locker:
        await locker.connection.execute(
            sa.text("SELECT 1 FROM tasks WHERE id = :id FOR UPDATE"), {"id": lease.item_id}
        )

        async def waiting_on_the_lock() -> bool:
            async with repo.autocommit() as tx:
                count = await tx.connection.execute(
                    sa.text(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                        "AND datname = current_database()"
                    )
                )
                return bool(count.scalar())

        async with anyio.create_task_group() as tg:
            scope = anyio.CancelScope()

            async def heartbeat() -> None:
                with scope:
                    await tq.heartbeat(lease.fence)

            tg.start_soon(heartbeat)
            await wait_until(
                "the heartbeat to wait on the row lock",
                waiting_on_the_lock,
                time.monotonic() + 30,
                describe=lambda: "no backend waits on a lock",
            )
            scope.cancel()
        assert scope.cancelled_caught
        assert direct_pool(repo).idle == 0  # the interrupted connection was closed
        await locker.connection.execute(sa.text("SELECT 1"))
    assert await tq.heartbeat(lease.fence)  # a fresh connection, the fence still holds


async def test_calls_after_close_are_refused(database_url: str) -> None:
    repo = SqlRepository(database_url)
    assert await TaskQueue(repo).claim_batch("w", 1) == []
    await repo.close()
    assert direct_pool(repo).idle == 0
    with pytest.raises(ConfigurationError, match="closed"):
        await TaskQueue(repo).claim_batch("w", 1)


async def test_pipelined_statements_answer_in_order_on_one_reused_connection(
    repo: SqlRepository, clock: ManualClock
) -> None:
    # fetch_many sends its statements in ONE round trip; the rows come back
    # per statement, in order, and the connection stays reusable.
    pool = direct_pool(repo)
    first, second = sa.text("SELECT 1 AS a"), sa.text("SELECT CAST(:v AS integer) + 1 AS n")
    answers = await pool.fetch_many([(first, {}), (second, {"v": 41})])
    assert [list(rows) for rows in answers] == [[(1,)], [(42,)]]
    assert pool.idle == 1
    # A failing statement fails the call, translated as every direct call is,
    # and its connection is not reused (nothing runs after it).
    broken = sa.text("SELECT CAST('x' AS integer)")
    with pytest.raises(StorageError, match="invalid input syntax for type integer"):
        async with repo.statement() as tx:
            await tx._fetch_many([(first, {}), (broken, {}), (second, {"v": 1})])
    assert pool.idle == 0
    assert await pool.fetch_many([(second, {"v": 1})]) == [[(2,)]]
