"""Databases for one test: a migrated SQLite file, or a Postgres database from the pool.

Shared by the plugin's fixtures and by suites that keep fixture names of
their own (Trace's ``tests/conftest.py``); a module apart from the plugin so
importing it does not import the plugin before pytest can register it.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from trace_core.storage.sql import SqlRepository
    from trace_testing.postgres import PostgresServer

__all__ = ["ENGINES", "open_repository", "provision_database"]

ENGINES = ("sqlite", "postgres")
"""Every engine the kit knows, in the order tests run on them."""


def provision_database(
    engine: str, request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[str]:
    """Yield the URL of an empty, migrated database on ``engine`` for one test.

    SQLite: a copy of :func:`trace_sqlite_template` in ``tmp_path``. Postgres:
    a database borrowed from :func:`trace_postgres_server`'s pool and given
    back clean. A generator, for a fixture to ``yield from``.
    """
    if engine == "sqlite":
        template: Path = request.getfixturevalue("trace_sqlite_template")
        target = tmp_path / "trace.db"
        shutil.copyfile(template, target)
        yield f"sqlite:///{target}"
        return
    if engine != "postgres":
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    server: PostgresServer = request.getfixturevalue("trace_postgres_server")
    with server.database() as url:
        yield url


@asynccontextmanager
async def open_repository(url: str) -> AsyncIterator[SqlRepository]:
    """A :class:`~trace_core.storage.sql.SqlRepository` on ``url``, closed after the block."""
    from trace_core.storage.sql import SqlRepository

    repository = SqlRepository(url)
    try:
        yield repository
    finally:
        await repository.close()
