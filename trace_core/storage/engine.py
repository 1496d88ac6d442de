"""Engines with the per-engine settings the ownership protocol relies on.

SQLite: WAL (readers never block the writer), a busy timeout (writers from
other processes wait instead of failing at once), foreign keys on, and
``BEGIN IMMEDIATE`` for write transactions so the write lock is taken at the
start rather than upgraded mid-transaction (the upgrade is what deadlocks and
produces huey's ``database is locked``); the same settings on the async
engine and on the sync one of statement scopes
(:mod:`~trace_core.storage.sqlite_direct`). Postgres: psycopg, READ COMMITTED.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from trace_core.errors import ConfigurationError
from trace_core.storage.url import DatabaseURL

__all__ = [
    "EngineSettings",
    "configure_sqlite",
    "create_engine",
    "create_sqlite_sync_engine",
]

# Execution option read by the "begin" hook: which BEGIN a SQLite
# transaction starts with. Writes take the lock up front; reads do not.
SQLITE_BEGIN = "trace_sqlite_begin"


@dataclass(frozen=True)
class EngineSettings:
    """Connection settings; the defaults suit a worker process."""

    pool_size: int = 5
    """Connections kept open per repository, by each of its two pools:
    SQLAlchemy's async one, and the one of statement scopes (Postgres:
    :mod:`~trace_core.storage.pg_direct`; SQLite: the sync engine of
    :mod:`~trace_core.storage.sqlite_direct`). Both open connections on demand."""
    max_overflow: int = 10
    sqlite_busy_timeout_ms: int = 30_000
    """How long a SQLite writer waits for another process's write lock."""
    sqlite_synchronous: str = "NORMAL"
    """``NORMAL`` is the WAL-mode setting SQLite recommends: durable against a
    process crash, may lose the last commits on power loss. ``FULL`` trades
    write throughput for power-loss durability."""

    def __post_init__(self) -> None:
        if self.pool_size < 1:
            raise ConfigurationError("EngineSettings.pool_size must be >= 1")
        if self.sqlite_busy_timeout_ms < 0:
            raise ConfigurationError("EngineSettings.sqlite_busy_timeout_ms must be >= 0")
        if self.sqlite_synchronous.upper() not in {"OFF", "NORMAL", "FULL", "EXTRA"}:
            raise ConfigurationError(
                "EngineSettings.sqlite_synchronous must be OFF, NORMAL, FULL or EXTRA"
            )


def create_engine(url: DatabaseURL, settings: EngineSettings | None = None) -> AsyncEngine:
    """Create the async engine for ``url`` with the settings above."""
    settings = settings or EngineSettings()
    if url.engine == "sqlite":
        return _sqlite_engine(url, settings)
    return create_async_engine(
        url.async_url,
        pool_size=settings.pool_size,
        max_overflow=settings.max_overflow,
        pool_pre_ping=False,
        isolation_level="READ COMMITTED",
    )


def _sqlite_engine(url: DatabaseURL, settings: EngineSettings) -> AsyncEngine:
    engine = create_async_engine(
        url.async_url,
        connect_args={"timeout": settings.sqlite_busy_timeout_ms / 1000},
        pool_size=settings.pool_size,
        max_overflow=settings.max_overflow,
    )
    configure_sqlite(engine.sync_engine, settings)
    return engine


def create_sqlite_sync_engine(url: DatabaseURL, settings: EngineSettings) -> sa.Engine:
    """A synchronous pysqlite engine on the same file, with the same settings,
    whose connections may be used from any thread, one thread at a time
    (:mod:`~trace_core.storage.sqlite_direct` runs them on worker threads)."""
    engine = sa.create_engine(
        url.sync_url,
        connect_args={
            "timeout": settings.sqlite_busy_timeout_ms / 1000,
            # Successive statements of one scope may run on different worker
            # threads; the scope never lets two use a connection at once.
            "check_same_thread": False,
        },
        poolclass=sa.pool.QueuePool,
        pool_size=settings.pool_size,
        max_overflow=settings.max_overflow,
    )
    configure_sqlite(engine, settings)
    return engine


def configure_sqlite(engine: sa.Engine, settings: EngineSettings) -> None:
    """Install the connection settings and the ``BEGIN`` of every SQLite engine
    (the async engine's sync core, or a sync engine of the same file)."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let us issue BEGIN ourselves (pysqlite's implicit BEGIN is deferred).
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA synchronous={settings.sqlite_synchronous.upper()}")
        cursor.execute(f"PRAGMA busy_timeout={int(settings.sqlite_busy_timeout_ms)}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: sa.Connection) -> None:
        mode = conn.get_execution_options().get(SQLITE_BEGIN, "IMMEDIATE")
        conn.exec_driver_sql(f"BEGIN {mode}")
