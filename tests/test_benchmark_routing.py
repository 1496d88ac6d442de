"""Smoke test of ``python -m benchmarks.routing`` with tiny sizes, on both engines.

It checks the output contract (one JSON line per run, then a summary) and
the task count the benchmark verifies, not any speed.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from benchmarks import _routing
from benchmarks.routing import main

EVENTS, DEPENDENTS = 200, 3
ARGS = ["--events", str(EVENTS), "--dependents", str(DEPENDENTS), "--batch", "70", "--runs", "1"]


def _lines(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_routing_benchmark_counts_every_task(
    engine: str, database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--engine", engine, "--db", database_url, *ARGS]) == 0
    run, summary = _lines(capsys.readouterr().out)

    assert run["bench"] == "routing" and run["engine"] == engine
    # 30 % resampled duplicates on top of the distinct events
    assert (run["events"], run["distinct_events"]) == (EVENTS + 60, EVENTS)
    assert run["dependents"] == DEPENDENTS
    assert run["tasks_created"] == EVENTS * DEPENDENTS
    assert run["deliveries"] == run["events"]  # every redelivery counted
    assert run["verified"] is True
    assert run["requests"] == 4  # 260 events in requests of 70
    assert run["seconds"] == pytest.approx(run["accept_seconds"] + run["route_seconds"], abs=0.01)
    assert run["events_per_s"] > 0
    assert run["wakeups"] == "drained"
    assert run["outbox"]["route_event:Done"] >= 4
    assert not [k for k in run["outbox"] if not k.endswith(":Done")], run["outbox"]

    assert summary["summary"] is True and summary["all_verified"] is True
    assert summary["median_events_per_s"] == run["events_per_s"]
    assert run["overlap"] is False
    # the floor, on both engines: the same task rows written bare on a fresh database
    assert run["floor_rows_ok"] is True
    # floor_seconds is printed to the millisecond, which on a floor of a
    # few dozen ms moves the quotient by more than 1%: bound it by the rounding
    low = run["events"] / (run["floor_seconds"] + 0.0005)
    high = run["events"] / max(run["floor_seconds"] - 0.0005, 1e-9)
    assert low - 0.05 <= run["events_per_s_ceiling"] <= high + 0.05
    assert run["share_of_ceiling"] == pytest.approx(
        run["events_per_s"] / run["events_per_s_ceiling"], abs=0.002
    )
    # the required-rows floor, on both engines: every task, input and event row, written bare
    assert run["required_floor_rows_ok"] is True
    assert run["required_floor_seconds"] > 0
    assert run["share_of_required_ceiling"] == pytest.approx(
        run["events_per_s"] / run["events_per_s_required_ceiling"], abs=0.002
    )
    assert summary["median_share_of_required_ceiling"] == run["share_of_required_ceiling"]


def test_routing_while_accepting_counts_every_task(
    engine: str, database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--overlap``: the relay's service loop routes while the requests come in."""
    assert main(["--engine", engine, "--db", database_url, *ARGS, "--overlap", "--no-floor"]) == 0
    run, _ = _lines(capsys.readouterr().out)
    assert run["overlap"] is True and run["verified"] is True
    assert run["tasks_created"] == EVENTS * DEPENDENTS
    assert run["deliveries"] == run["events"]
    assert "floor_seconds" not in run and "required_floor_seconds" not in run


def test_routing_benchmark_fails_on_a_wrong_task_count(
    engine: str,
    database_url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run whose tasks table disagrees with distinct x dependents exits non-zero."""
    counts = _routing._counts

    async def one_task_short(*args: Any) -> dict[str, Any]:
        found = await counts(*args)
        return {**found, "tasks": found["tasks"] - 1}

    monkeypatch.setattr(_routing, "_counts", one_task_short)
    assert main(["--engine", engine, "--db", database_url, *ARGS]) == 1
    captured = capsys.readouterr()
    run = _lines(captured.out)[0]
    assert run["verified"] is False and run["tasks_created"] == EVENTS * DEPENDENTS - 1
    assert "routing benchmark FAILED" in captured.err
