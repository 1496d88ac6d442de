"""Shared fixtures: a fresh migrated database per test, on each engine.

``engine`` is a parameter of every storage test, so the same test id runs on
``sqlite`` and ``postgres``. Postgres is a real server: a throwaway cluster
started by this test process on loopback (or ``TRACE_TEST_POSTGRES_URL``).
Each test gets its own database, copied from a migrated template.
"""

from __future__ import annotations

import itertools
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from trace_core.clock import ManualClock
from trace_core.storage.migrate import upgrade
from trace_core.storage.sql import SqlRepository
from trace_lite.pgcluster import PostgresCluster, external_postgres_url

pytest_plugins = ["tests.spark_fixtures"]

ENGINES = ("sqlite", "postgres")
_TEMPLATE_DB = "trace_template"
_counter = itertools.count()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class PostgresServer:
    """A server for this test process, with a migrated template database."""

    def __init__(self) -> None:
        self._cluster: PostgresCluster | None = None
        external = external_postgres_url()
        if external is None:
            self._cluster = PostgresCluster()
            self._cluster.start()
        self._base = external
        self._prefix = f"t{os.getpid()}_{uuid.uuid4().hex[:6]}"
        self.create_database(_TEMPLATE_DB + self._prefix)
        upgrade(self.url(_TEMPLATE_DB + self._prefix))

    def url(self, dbname: str) -> str:
        if self._cluster is not None:
            return self._cluster.url(dbname)
        assert self._base is not None
        head, _, _ = self._base.rpartition("/")
        return f"{head}/{dbname}"

    def create_database(self, name: str, template: str | None = None) -> None:
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            stmt = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
            if template:
                stmt += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
            conn.execute(stmt)

    def fresh_database(self) -> str:
        name = f"{self._prefix}_{next(_counter)}"
        self.create_database(name, template=_TEMPLATE_DB + self._prefix)
        return self.url(name)

    def stop(self) -> None:
        if self._cluster is not None:
            self._cluster.stop()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    server = PostgresServer()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sqlite-template") / "template.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    """The engine under test: ``sqlite`` or ``postgres``."""
    return str(request.param)


@pytest.fixture
def database_url(engine: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, migrated database on the engine under test."""
    if engine == "sqlite":
        template: Path = request.getfixturevalue("sqlite_template")
        target = tmp_path / "trace.db"
        shutil.copyfile(template, target)
        return f"sqlite:///{target}"
    server: PostgresServer = request.getfixturevalue("postgres_server")
    return server.fresh_database()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def repo(database_url: str) -> AsyncIterator[SqlRepository]:
    repository = SqlRepository(database_url)
    try:
        yield repository
    finally:
        await repository.close()
