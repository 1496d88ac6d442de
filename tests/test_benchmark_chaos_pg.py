"""Smoke test of the Postgres scenarios of ``python -m benchmarks.chaos``, tiny.

It checks the output contract (one JSON row per run with the frame's keys
and the scenario's own, then a summary) and that nothing was lost, never a
speed. Postgres only: the runner skips these scenarios on SQLite, where the
faults do not exist.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.chaos import main

PHASE_KEYS = ("before_per_s", "during_per_s", "after_per_s", "fault_s", "recover_s", "lost")


def _rows(capsys: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


def test_the_postgres_scenarios_report_their_phases_and_lose_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["--scenario", "pg-crash-restart", "--scenario", "pg-idle-snapshot"]
    assert main([*args, "--runs", "1", "--scale", "0.02"]) == 0
    rows = _rows(capsys)
    runs = {r["scenario"]: r for r in rows if not r.get("summary")}
    summaries = {r["scenario"]: r for r in rows if r.get("summary")}
    assert set(runs) == set(summaries) == {"pg-crash-restart", "pg-idle-snapshot"}
    for name, row in runs.items():
        assert row["engine"] == "postgres" and row["run"] == 0, row
        assert all(key in row for key in PHASE_KEYS), (name, row)
        assert row["lost"] == 0, row
        assert summaries[name]["total_lost"] == 0

    crash = runs["pg-crash-restart"]
    assert crash["duplicate_effects"] == crash["out_of_fence"] == crash["unexpected"] == 0
    assert isinstance(crash["fault_s"], float) and crash["fault_s"] > 0
    assert isinstance(crash["before_per_s"], float) and crash["before_per_s"] > 0

    snapshot = runs["pg-idle-snapshot"]
    assert isinstance(snapshot["held_xmin"], int), snapshot  # the hold really held a snapshot
    for run in ("control", "held"):
        for phase in ("before", "during", "after"):
            for pct in ("p50", "p95"):
                assert f"{run}_claim_{phase}_{pct}_ms" in snapshot, (run, phase, pct)
    for phase in ("before", "during", "after"):
        assert f"control_{phase}_per_s" in snapshot
    for key in ("throughput", "claim_p50"):
        assert f"{key}_ratio_after" in snapshot and f"{key}_after_vs_before" in snapshot


def test_the_postgres_scenarios_are_skipped_on_sqlite(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--scenario", "pg-crash-restart", "--scenario", "pg-idle-snapshot"]
    assert main([*args, "--engine", "sqlite", "--runs", "1"]) == 0
    assert _rows(capsys) == []
