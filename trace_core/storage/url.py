"""Database URLs: what users type, and the driver URLs the engines need.

Accepted everywhere a database is named: ``sqlite:///path``,
``sqlite+aiosqlite:///path``, ``sqlite+pysqlite:///path``, ``postgresql://…``,
``postgres://…`` and ``postgresql+psycopg://…``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from trace_core.errors import ConfigurationError

__all__ = ["DatabaseURL", "create_sync_engine", "parse_database_url"]

Engine = Literal["sqlite", "postgres"]

_SQLITE_DRIVERS = {"", "aiosqlite", "pysqlite"}
_PG_DRIVERS = {"", "psycopg"}


@dataclass(frozen=True)
class DatabaseURL:
    """A validated database URL with its async and sync driver forms."""

    engine: Engine
    async_url: URL
    sync_url: URL

    def render(self) -> str:
        """The URL with any password masked, for logs and messages."""
        return self.sync_url.render_as_string(hide_password=True)

    def conninfo(self) -> str:
        """Postgres: the URL psycopg connects with directly (password included;
        never log it)."""
        return self.sync_url.set(drivername="postgresql").render_as_string(hide_password=False)


def parse_database_url(raw: str | URL) -> DatabaseURL:
    """Validate ``raw`` and derive the async (runtime) and sync (migration) URLs.

    Raises :class:`ConfigurationError` naming the URL (password masked) and
    the rule it breaks.
    """
    try:
        url = make_url(raw) if isinstance(raw, str) else raw
    except ArgumentError as exc:
        raise ConfigurationError(f"database URL {str(raw)!r} is not a URL: {exc}") from None
    backend, _, driver = url.drivername.partition("+")
    shown = url.render_as_string(hide_password=True)
    if backend == "sqlite":
        if driver not in _SQLITE_DRIVERS:
            raise ConfigurationError(
                f"database URL {shown!r}: driver {driver!r} is not supported for SQLite "
                "(use sqlite:/// or sqlite+aiosqlite:///)"
            )
        if not url.database or url.database == ":memory:":
            raise ConfigurationError(
                f"database URL {shown!r}: SQLite needs a file path (sqlite:///path/to/file.db); "
                "an in-memory database cannot be shared by the connections a queue needs"
            )
        return DatabaseURL(
            "sqlite",
            url.set(drivername="sqlite+aiosqlite"),
            url.set(drivername="sqlite+pysqlite"),
        )
    if backend in ("postgresql", "postgres"):
        if driver not in _PG_DRIVERS:
            raise ConfigurationError(
                f"database URL {shown!r}: driver {driver!r} is not supported for Postgres "
                "(use postgresql:// or postgresql+psycopg://)"
            )
        pg = url.set(drivername="postgresql+psycopg")
        return DatabaseURL("postgres", pg, pg)
    raise ConfigurationError(
        f"database URL {shown!r}: unsupported scheme {url.drivername!r} "
        "(expected sqlite:///path or postgresql://user@host/db)"
    )


def create_sync_engine(url: DatabaseURL) -> sa.Engine:
    """A synchronous engine, for migrations and schema inspection."""
    return sa.create_engine(url.sync_url, poolclass=sa.pool.NullPool)
