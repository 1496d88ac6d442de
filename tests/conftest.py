"""Shared fixtures: a fresh migrated database per test, on each engine.

``engine`` is a parameter of every storage test, so the same test id runs on
``sqlite`` and ``postgres``. Postgres is a real server: a throwaway cluster
started by this test process on loopback (or ``TRACE_TEST_POSTGRES_URL``).
Each test gets a migrated database of its own, from the pool of
:mod:`tests.postgres_pool` (emptied between tests instead of copied anew).
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.postgres_pool import PostgresServer
from trace_core.clock import ManualClock
from trace_core.storage.migrate import upgrade
from trace_core.storage.sql import SqlRepository
from trace_lite.redis_server import RedisServer, find_redis_server

pytest_plugins = ["tests.spark_fixtures", "tests.cpu_report"]

ENGINES = ("sqlite", "postgres")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    server = PostgresServer()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A throwaway ``redis-server`` on loopback, one per test run (per xdist worker)."""
    if find_redis_server() is None:
        pytest.skip("redis-server is not installed (Debian package 'redis-server'; ./dev)")
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    """The URL of :func:`redis_server` (tests keep apart by key prefix)."""
    return redis_server.url


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
def database_url(engine: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty, migrated database on the engine under test, for this test alone."""
    if engine == "sqlite":
        template: Path = request.getfixturevalue("sqlite_template")
        target = tmp_path / "trace.db"
        shutil.copyfile(template, target)
        yield f"sqlite:///{target}"
        return
    server: PostgresServer = request.getfixturevalue("postgres_server")
    with server.database() as url:
        yield url


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
