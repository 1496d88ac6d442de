"""SQLite: the one-commit hand-off's transaction on a raw ``sqlite3`` connection
(:class:`~trace_core.storage.sqlite_direct.RawWriter`).

Its connection is kept out of the sync engine's pool, yet has Trace's
settings; a transaction that fails rolls back, frees the write lock and its
connection is replaced; the repository's close closes it.
"""

from __future__ import annotations

import sqlite3
import uuid
from datetime import timedelta
from typing import Any

import anyio.to_thread
import pytest

from tests.factories import make_job
from trace_core.clock import ManualClock
from trace_core.errors import ConfigurationError, StorageError
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository
from trace_core.storage.sql_errors import translate_errors
from trace_core.storage.sql_handoff import handoff_insert
from trace_core.storage.sqlite_direct import RawWriter

pytestmark = pytest.mark.anyio


@pytest.fixture
def engine() -> str:
    """The raw writer is SQLite's: ``repo`` (tests/conftest.py) is a fresh SQLite file."""
    return "sqlite"


def writer(repo: SqlRepository) -> RawWriter:
    assert repo._sqlite is not None
    return repo._sqlite._raw


def lock_is_free(repo: SqlRepository) -> bool:
    """True if a writer of another connection gets the write lock at once."""
    path = repo.url.sync_url.database
    assert path is not None
    conn = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        conn.close()


async def insert_claimed(repo: SqlRepository, clock: ManualClock, job: uuid.UUID) -> list[Any]:
    """The hand-off's insert (no attempt record) run by the raw writer."""
    now = clock.now()
    stmt, params = handoff_insert(
        "sqlite", [NewTask(job)], now=now, expires_at=now + timedelta(seconds=30)
    )
    params["b_worker_id"] = "w1"
    return await anyio.to_thread.run_sync(writer(repo).run, stmt, params, lambda rows: None)


def kept(repo: SqlRepository) -> sqlite3.Connection:
    fairy = writer(repo)._kept
    assert fairy is not None
    db: Any = fairy.dbapi_connection
    assert isinstance(db, sqlite3.Connection)
    return db


async def test_the_kept_connection_has_trace_settings_outside_the_pool(
    repo: SqlRepository, clock: ManualClock
) -> None:
    job = await make_job(repo, clock.now())
    [row] = await insert_claimed(repo, clock, job)
    assert isinstance(row[0], uuid.UUID) and row[1:3] == (1, 1)
    db = kept(repo)
    assert db.execute("PRAGMA foreign_keys").fetchone() == (1,)
    assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert not db.in_transaction and lock_is_free(repo)
    assert repo._sqlite is not None and repo._sqlite.checked_out == 0
    await insert_claimed(repo, clock, job)
    assert kept(repo) is db  # reused, not reopened

    await repo.close()
    with pytest.raises(sqlite3.ProgrammingError):
        db.execute("SELECT 1")
    with pytest.raises(ConfigurationError, match="closed"):
        await insert_claimed(repo, clock, job)


async def test_a_failed_transaction_rolls_back_and_its_connection_is_replaced(
    repo: SqlRepository, clock: ManualClock
) -> None:
    job = await make_job(repo, clock.now())
    await insert_claimed(repo, clock, job)
    first = kept(repo)
    with pytest.raises(sqlite3.IntegrityError):  # no such job: the foreign key refuses it
        await insert_claimed(repo, clock, uuid.uuid4())
    assert writer(repo)._kept is None and lock_is_free(repo)
    with pytest.raises(sqlite3.ProgrammingError):
        first.execute("SELECT 1")
    await insert_claimed(repo, clock, job)
    assert kept(repo) is not first
    # The two that committed; nothing of the refused one.
    assert kept(repo).execute("SELECT count(*) FROM tasks").fetchone() == (2,)


async def test_a_value_the_column_type_refuses_is_a_storage_error(
    repo: SqlRepository, clock: ManualClock
) -> None:
    """As through SQLAlchemy: a naive datetime is refused before the transaction."""
    job = await make_job(repo, clock.now())
    stmt, params = handoff_insert("sqlite", [NewTask(job)], now=clock.now(), expires_at=clock.now())
    params |= {"b_worker_id": "w1", "now": clock.now().replace(tzinfo=None)}
    with (
        pytest.raises(StorageError, match="create claimed tasks"),
        translate_errors("create claimed tasks"),
    ):
        await anyio.to_thread.run_sync(writer(repo).run, stmt, params, lambda rows: None)
    assert lock_is_free(repo)
