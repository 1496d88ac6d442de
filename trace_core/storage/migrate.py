"""Versioned migrations (Alembic) and the schema check.

``upgrade(url)`` brings any database to the newest revision; ``schema_diff``
compares a live database with the declared :mod:`schema` and returns the
differences (empty when they match), which the tests assert on both engines;
``schema_state`` says where a database stands against the shipped revisions
(never migrated, behind, current, or at a revision this Trace does not know),
so that a command can refuse a database it cannot use with a clear message.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory

from trace_core.errors import ConfigurationError, DatabaseUnavailable
from trace_core.storage.schema import metadata
from trace_core.storage.url import DatabaseURL, create_sync_engine, parse_database_url

__all__ = [
    "SchemaState",
    "SchemaStatus",
    "current_revision",
    "head_revision",
    "schema_diff",
    "schema_state",
    "upgrade",
]

_MIGRATIONS = Path(__file__).with_name("migrations")


def _config(connection: sa.Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    """The newest revision shipped with this version of Trace."""
    head = ScriptDirectory.from_config(_config()).get_current_head()
    assert head is not None, "no migrations shipped"
    return head


def upgrade(url: str | DatabaseURL, revision: str = "head") -> str:
    """Apply migrations up to ``revision``; return the revision now current.

    Safe to run concurrently on Postgres: the migration holds an advisory
    lock, so two starting processes never both create the tables.
    """
    db = url if isinstance(url, DatabaseURL) else parse_database_url(url)
    engine = create_sync_engine(db)
    try:
        with engine.begin() as conn:
            if db.engine == "postgres":
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(7426543)"))
            command.upgrade(_config(conn), revision)
        return current_revision(db) or ""
    finally:
        engine.dispose()


def current_revision(url: str | DatabaseURL) -> str | None:
    """The revision a database is at, or ``None`` if never migrated."""
    db = url if isinstance(url, DatabaseURL) else parse_database_url(url)
    engine = create_sync_engine(db)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


SchemaStatus = Literal["empty", "behind", "current", "unknown"]
"""``empty``: never migrated; ``behind``: at an older shipped revision;
``current``: at the newest; ``unknown``: at a revision not shipped with this
version of Trace (a newer one migrated it)."""


@dataclass(frozen=True)
class SchemaState:
    """Where a database's schema stands against the migrations shipped here."""

    revision: str | None
    """The database's revision (``None`` if never migrated)."""
    head: str
    """The newest revision shipped with this version of Trace."""
    status: SchemaStatus


def schema_state(url: str | DatabaseURL) -> SchemaState:
    """The revision of the database at ``url`` compared with the shipped ones.

    Only reads: a database that is not migrated is reported, never changed.
    A database that cannot be reached raises :class:`DatabaseUnavailable`, a
    file that is not a database :class:`ConfigurationError`; both name the
    URL (password masked) and the driver's reason.
    """
    db = url if isinstance(url, DatabaseURL) else parse_database_url(url)
    try:
        revision = current_revision(db)
    except sa.exc.OperationalError as exc:
        raise DatabaseUnavailable(
            f"cannot open the database {db.render()}: {_reason(exc)}"
        ) from None
    except sa.exc.DatabaseError as exc:
        raise ConfigurationError(f"database {db.render()}: {_reason(exc)}") from None
    script = ScriptDirectory.from_config(_config())
    head = script.get_current_head()
    assert head is not None, "no migrations shipped"
    status: SchemaStatus
    if revision is None:
        status = "empty"
    elif revision == head:
        status = "current"
    elif revision in {r.revision for r in script.walk_revisions()}:
        status = "behind"
    else:
        status = "unknown"
    return SchemaState(revision, head, status)


def _reason(exc: sa.exc.DBAPIError) -> str:
    """The driver's message, first line only (the rest is SQLAlchemy's help text)."""
    return str(exc.orig).strip().splitlines()[0] if exc.orig is not None else type(exc).__name__


def schema_diff(url: str | DatabaseURL) -> list[Any]:
    """Differences between the live database and the declared schema."""
    db = url if isinstance(url, DatabaseURL) else parse_database_url(url)
    engine = create_sync_engine(db)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            return list(compare_metadata(ctx, metadata))
    finally:
        engine.dispose()
