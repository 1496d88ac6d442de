"""docs/testing.md stays true: its example, taken from the page, is a green
two-engine test in under 30 lines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trace_testing.postgres import PostgresServer

PAGE = Path(__file__).resolve().parents[1] / "docs" / "testing.md"
MARKER = "<!-- test_my_handler.py"


def _example() -> str:
    text = PAGE.read_text(encoding="utf-8")
    match = re.search(re.escape(MARKER) + r"[^\n]*\n```py\n(.*?)```", text, flags=re.S)
    assert match, f"{PAGE.name}: no ```py block after {MARKER!r}"
    return match.group(1)


def test_the_example_is_under_30_lines() -> None:
    code = _example()
    assert len(code.strip().splitlines()) < 30
    assert "trace_database_url" in code and "drain_tasks" in code


def test_the_pages_example_passes_on_both_engines(
    pytester: pytest.Pytester, trace_postgres_server: PostgresServer
) -> None:
    pytester.makepyfile(test_my_handler=_example())
    result = pytester.runpytest_inprocess(
        "-p",
        "trace_testing.plugin",
        "-p",
        "no:cacheprovider",
        f"--trace-postgres-url={trace_postgres_server.url('postgres')}",
    )
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*test_my_handler.py ..*"])
