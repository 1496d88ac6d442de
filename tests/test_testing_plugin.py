"""The kit's pytest plugin: how it loads (entry point, ``-p``, ``pytest_plugins``,
all at once), its options, and its fixtures on both engines."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trace_core.clock import ManualClock
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import TaskQueue
from trace_testing.dispatcher import DispatcherFactory, NotIdle
from trace_testing.drain import create_tasks
from trace_testing.lite import LitePlatformFactory

ROOT = Path(__file__).resolve().parents[1]

ENGINE_TEST = """
def test_engine(trace_engine):
    assert trace_engine in ("sqlite", "postgres")
"""


def _entry_point(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Install the ``pytest11`` entry point of pyproject.toml for the
    subprocess, as an installed distribution would declare it."""
    dist = pytester.path / "site" / "trace_kit_probe-0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: trace-kit-probe\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(
        "[pytest11]\ntrace_testing.plugin = trace_testing.plugin\n"
    )
    paths = [str(pytester.path / "site"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)


def test_the_entry_point_loads_the_plugin(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _entry_point(pytester, monkeypatch)
    pytester.makepyfile(test_engines=ENGINE_TEST)
    result = pytester.runpytest_subprocess("--trace-engines=sqlite", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*test_engines.py .*"])


def test_every_way_of_loading_at_once_registers_it_once(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _entry_point(pytester, monkeypatch)
    pytester.makeconftest('pytest_plugins = ["trace_testing.plugin"]\n')
    pytester.makepyfile(test_engines=ENGINE_TEST)
    result = pytester.runpytest_subprocess(
        "-p", "trace_testing.plugin", "--trace-engines=sqlite,postgres", "-p", "no:cacheprovider"
    )
    assert result.ret == 0, result.stderr.str()
    result.assert_outcomes(passed=2)
    assert "already registered" not in result.stderr.str()


def test_an_unknown_engine_is_a_usage_error_naming_the_option(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_engines=ENGINE_TEST)
    result = pytester.runpytest_inprocess(
        "-p", "trace_testing.plugin", "--trace-engines=sqlite,mysql"
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--trace-engines: unknown engine 'mysql'*"])
    empty = pytester.runpytest_inprocess("-p", "trace_testing.plugin", "--trace-engines=,")
    assert empty.ret == pytest.ExitCode.USAGE_ERROR


def test_an_embedders_own_fixture_names_keep_their_meaning(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        "import pytest\n\n"
        "@pytest.fixture\ndef engine():\n    return 'mine'\n\n"
        "@pytest.fixture\ndef repo():\n    return 'my repo'\n"
    )
    pytester.makepyfile(
        test_mine="def test_mine(engine, repo, trace_clock):\n"
        "    assert (engine, repo) == ('mine', 'my repo')\n"
    )
    result = pytester.runpytest_inprocess("-p", "trace_testing.plugin")
    result.assert_outcomes(passed=1)


@pytest.mark.anyio
async def test_the_database_fixtures_give_a_migrated_database_per_engine(
    trace_engine: str, trace_database_url: str, trace_repository: SqlRepository
) -> None:
    assert trace_database_url.startswith("sqlite" if trace_engine == "sqlite" else "postgresql")
    assert await create_tasks(trace_repository, 2)
    assert await TaskQueue(trace_repository).claim_batch("w", 5)


@pytest.mark.anyio
async def test_trace_dispatcher_runs_until_idle(
    trace_dispatcher: DispatcherFactory, trace_repository: SqlRepository, trace_clock: ManualClock
) -> None:
    dispatcher = trace_dispatcher()
    assert dispatcher.dispatcher.clock is trace_clock
    await create_tasks(trace_repository, 3, clock=trace_clock)  # their wake-ups are outbox rows
    with pytest.raises(NotIdle):
        await dispatcher.run_until_idle(max_rounds=1)
    reports = await dispatcher.run_until_idle()
    assert reports[-1]["outbox_rows"] == 0
    assert (await dispatcher.run_until_idle()) == reports[-1:]


@pytest.mark.anyio
async def test_trace_lite_platform_starts_on_the_tests_database(
    trace_lite_platform: LitePlatformFactory, trace_database_url: str
) -> None:
    async with trace_lite_platform(workers=1) as lite:
        assert lite.config.state_url == trace_database_url
        assert await create_tasks(lite.repo, 1)
