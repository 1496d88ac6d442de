"""Shared fixtures: a fresh migrated database per test, on each engine.

They are the kit's (:mod:`trace_testing.plugin`) under the names this suite
has always used: ``engine`` is :func:`~trace_testing.plugin.trace_engine`, a
parameter of every storage test, so the same test id runs on ``sqlite`` and
``postgres`` (``--trace-engines`` narrows it). Postgres is a real server: a
throwaway cluster started by this test process on loopback (or
``TRACE_TEST_POSTGRES_URL`` / ``--trace-postgres-url``). Each test gets a
migrated database of its own, from the pool of :mod:`trace_testing.postgres`
(emptied between tests instead of copied anew).

``database_url`` depends on ``engine`` (not on ``trace_engine``), so a module
that pins ``engine`` (a fixture of its own, or ``parametrize("engine", ...)``)
still picks the engine of its databases.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from trace_core.clock import ManualClock
from trace_core.storage.sql import SqlRepository
from trace_lite.redis_server import RedisServer, find_redis_server
from trace_testing.databases import open_repository, provision_database
from trace_testing.postgres import PostgresServer

# The kit's plugin first: loaded here by name, it is the same registration as
# the pytest11 entry point's (pytest skips a plugin name it already has).
pytest_plugins = ["trace_testing.plugin", "pytester", "tests.spark_fixtures", "tests.cpu_report"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def postgres_server(trace_postgres_server: PostgresServer) -> PostgresServer:
    """The run's Postgres server and its pool (the kit's ``trace_postgres_server``)."""
    return trace_postgres_server


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
def sqlite_template(trace_sqlite_template: Path) -> Path:
    """The migrated SQLite file databases are copied from (the kit's)."""
    return trace_sqlite_template


@pytest.fixture
def engine(trace_engine: str) -> str:
    """The engine under test: ``sqlite`` or ``postgres``."""
    return trace_engine


@pytest.fixture
def database_url(engine: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty, migrated database on the engine under test, for this test alone."""
    yield from provision_database(engine, request, tmp_path)


@pytest.fixture
def clock(trace_clock: ManualClock) -> ManualClock:
    return trace_clock


@pytest.fixture
async def repo(database_url: str) -> AsyncIterator[SqlRepository]:
    async with open_repository(database_url) as repository:
        yield repository


@pytest.fixture(autouse=True)
def _logging_restored(request: pytest.FixtureRequest) -> Iterator[None]:
    """A benchmark's ``main`` run in-process configures logging for a command
    line (``benchmarks._common.configure_logging``: a stderr handler, whole
    packages such as ``trace_core.euterpe`` quieted to WARNING). Undo it after
    each benchmark test, or a later test on the same xdist worker that asserts
    an INFO line of those packages (``caplog``) sees nothing."""
    if not request.node.module.__name__.rsplit(".", 1)[-1].startswith("test_benchmark"):
        yield
        return
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    levels = {
        name: logger.level
        for name, logger in logging.root.manager.loggerDict.items()
        if isinstance(logger, logging.Logger)
    }
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger):
            logger.setLevel(levels.get(name, logging.NOTSET))
