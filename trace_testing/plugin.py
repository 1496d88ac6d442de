"""The pytest plugin of the kit: engines, databases, a repository, a clock, a
Dispatcher that runs until idle and an in-process lite platform.

It is registered through the ``pytest11`` entry point under the name
``trace_testing.plugin``, so it loads by itself wherever ``trace-pipelines``
is installed; ``-p trace_testing.plugin`` (or ``pytest_plugins`` in a
conftest) loads it where entry points are turned off
(``PYTEST_DISABLE_PLUGIN_AUTOLOAD``). Both ways register one module under one
name, so loading it twice is a no-op.

Loading it costs nothing a suite does not ask for: its fixtures are all named
``trace_*`` (an embedder's own ``engine`` or ``repo`` keeps its meaning),
none is autouse, and the throwaway Postgres cluster starts only when a test
first asks for a Postgres database.

Options:

``--trace-engines=sqlite,postgres``
    The engines :func:`trace_engine` runs each test on (default: both).
``--trace-postgres-url=postgresql://user@host/db``
    Test on this server instead of a throwaway cluster (default: the
    ``TRACE_TEST_POSTGRES_URL`` environment variable). The role needs
    ``CREATEDB``: each test borrows a migrated database of its own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from trace_core.clock import ManualClock
from trace_testing.databases import ENGINES, open_repository, provision_database

if TYPE_CHECKING:
    from trace_core.storage.sql import SqlRepository
    from trace_testing.dispatcher import DispatcherFactory
    from trace_testing.lite import LitePlatformFactory
    from trace_testing.postgres import PostgresServer

__all__ = [
    "ENGINES",
    "provision_database",
    "selected_engines",
    "trace_clock",
    "trace_database_url",
    "trace_dispatcher",
    "trace_lite_platform",
    "trace_postgres_server",
    "trace_repository",
    "trace_sqlite_template",
]


_ENGINES_OPTION = "--trace-engines"
_URL_OPTION = "--trace-postgres-url"


def pytest_addoption(parser: pytest.Parser) -> None:
    """The kit's command-line options (see the module docstring)."""
    group = parser.getgroup("trace", "Trace test kit (trace_testing)")
    group.addoption(
        _ENGINES_OPTION,
        dest="trace_engines",
        default=",".join(ENGINES),
        metavar="ENGINES",
        help="comma-separated engines for trace_engine: sqlite, postgres (default: both)",
    )
    group.addoption(
        _URL_OPTION,
        dest="trace_postgres_url",
        default=None,
        metavar="URL",
        help="test on this Postgres server (a role with CREATEDB) instead of a throwaway "
        "cluster; default: $TRACE_TEST_POSTGRES_URL",
    )


def selected_engines(config: pytest.Config) -> tuple[str, ...]:
    """The engines named by ``--trace-engines``; a usage error names a bad one."""
    raw = str(config.getoption("trace_engines"))
    names = tuple(dict.fromkeys(part.strip() for part in raw.split(",") if part.strip()))
    if not names:
        raise pytest.UsageError(f"{_ENGINES_OPTION}: name at least one of {', '.join(ENGINES)}")
    unknown = [name for name in names if name not in ENGINES]
    if unknown:
        raise pytest.UsageError(
            f"{_ENGINES_OPTION}: unknown engine {unknown[0]!r}; choose from {', '.join(ENGINES)}"
        )
    return names


def _engine_fixture(engines: tuple[str, ...]) -> object:
    """A holder of :func:`trace_engine`, whose parameters come from the command
    line: a fixture's ``params`` are fixed where it is defined, so it is
    defined here, once the options are parsed (pytest reads fixtures from a
    plugin's class, hence a class made per run)."""

    class EngineFixture:
        @pytest.fixture(params=engines)
        def trace_engine(self, request: pytest.FixtureRequest) -> str:
            """The engine under test: ``sqlite`` or ``postgres`` (see ``--trace-engines``)."""
            return str(request.param)

    return EngineFixture()


def pytest_configure(config: pytest.Config) -> None:
    """Register :func:`trace_engine` with the engines of ``--trace-engines``."""
    config.pluginmanager.register(
        _engine_fixture(selected_engines(config)), "trace_testing.plugin.engines"
    )


@pytest.fixture(scope="session")
def trace_sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated SQLite database file, copied for each test (migrating is slower)."""
    from trace_core.storage.migrate import upgrade

    path = tmp_path_factory.mktemp("trace-sqlite-template") / "template.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture(scope="session")
def trace_postgres_server(request: pytest.FixtureRequest) -> Iterator[PostgresServer]:
    """The run's Postgres: the user's server (``--trace-postgres-url`` or
    ``TRACE_TEST_POSTGRES_URL``) or a throwaway cluster, with the pool of
    migrated databases. Started on first use, once per test process."""
    from trace_testing.postgres import PostgresServer

    server = PostgresServer(external_url=request.config.getoption("trace_postgres_url"))
    yield server
    server.stop()


@pytest.fixture
def trace_database_url(
    trace_engine: str, request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[str]:
    """An empty, migrated database on the engine under test, for this test alone."""
    yield from provision_database(trace_engine, request, tmp_path)


@pytest.fixture
def trace_clock() -> ManualClock:
    """A :class:`~trace_core.clock.ManualClock`: time moves only when the test says."""
    return ManualClock()


@pytest.fixture
async def trace_repository(trace_database_url: str) -> AsyncIterator[SqlRepository]:
    """A :class:`~trace_core.storage.sql.SqlRepository` on :func:`trace_database_url`."""
    async with open_repository(trace_database_url) as repository:
        yield repository


@pytest.fixture
def trace_dispatcher(
    trace_repository: SqlRepository, trace_clock: ManualClock
) -> DispatcherFactory:
    """Make a Dispatcher on :func:`trace_repository` and :func:`trace_clock`:
    ``trace_dispatcher(operators)`` returns an
    :class:`~trace_testing.dispatcher.IdleDispatcher` (``run_until_idle()``)."""
    from trace_testing.dispatcher import DispatcherFactory

    return DispatcherFactory(trace_repository, trace_clock)


@pytest.fixture
def trace_lite_platform(trace_database_url: str, tmp_path: Path) -> LitePlatformFactory:
    """Start an in-process lite platform on :func:`trace_database_url`:
    ``async with trace_lite_platform(operators=[...]) as lite:`` (a
    :class:`~trace_lite.platform.TraceLite`, stopped on leaving the block)."""
    from trace_testing.lite import LitePlatformFactory

    return LitePlatformFactory(trace_database_url, tmp_path / "trace-lite")
