"""Versioned migrations (Alembic) and the schema check.

``upgrade(url)`` brings any database to the newest revision; ``schema_diff``
compares a live database with the declared :mod:`schema` and returns the
differences (empty when they match), which the tests assert on both engines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory

from trace_core.storage.schema import metadata
from trace_core.storage.url import DatabaseURL, create_sync_engine, parse_database_url

__all__ = ["current_revision", "head_revision", "schema_diff", "upgrade"]

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
