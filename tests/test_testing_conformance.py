"""Trace's own suite runs the kit's conformance suite on both engines, as an
embedder would (``pytest --pyargs trace_testing.conformance``), in-process and
on this run's Postgres server (no second cluster)."""

from __future__ import annotations

import pytest

from trace_testing.postgres import PostgresServer

CONFORMANCE_TESTS = 25
"""Tests per engine in trace_testing.conformance (a new one must be counted here)."""


def test_the_conformance_suite_passes_on_both_engines(
    pytester: pytest.Pytester, trace_postgres_server: PostgresServer
) -> None:
    result = pytester.runpytest_inprocess(
        "-p",
        "trace_testing.plugin",
        "-p",
        "no:cacheprovider",
        "--pyargs",
        "trace_testing.conformance",
        "--trace-engines=sqlite,postgres",
        f"--trace-postgres-url={trace_postgres_server.url('postgres')}",
    )
    result.assert_outcomes(passed=2 * CONFORMANCE_TESTS)
    result.stdout.fnmatch_lines(["*test_fencing.py*", "*test_idempotency.py*"])
