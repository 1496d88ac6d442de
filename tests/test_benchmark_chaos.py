"""Smoke test of the worker and relay scenarios of ``python -m benchmarks.chaos``
at a twentieth of their size: the output contract (a JSON row per run with
the phases and the checks, then a summary) and that nothing was lost.

On SQLite only: the scenarios are the kit's functions, which
tests/test_chaos_workers.py and tests/test_chaos_relay.py run on both
engines; here a Postgres run would only add a cluster start per scenario.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.chaos import main, scenarios

PHASES = ("before_per_s", "during_per_s", "after_per_s", "fault_s", "recover_s")
CHECKS = ("lost", "duplicated", "out_of_fence", "kills")
KILLS = {"workers-sigkill": 4, "worker-pause": 0, "relay-sigkill": 3}


def test_the_scenarios_are_registered() -> None:
    found = scenarios()
    assert set(KILLS) <= set(found)
    for name in KILLS:
        assert found[name].engines == ("sqlite", "postgres")


@pytest.mark.parametrize("scenario", sorted(KILLS))
def test_a_chaos_scenario_reports_its_phases_and_loses_nothing(
    scenario: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--scenario", scenario, "--engine", "sqlite", "--runs", "1", "--scale", "0.05"]
    assert main(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    (row,), summary = lines[:-1], lines[-1]
    assert row["bench"] == "chaos" and row["scenario"] == scenario and row["engine"] == "sqlite"
    for key in (*PHASES, *CHECKS):
        assert key in row, key
    assert row["lost"] == 0 and row["out_of_fence"] == 0, row
    assert row["kills"] == KILLS[scenario], row
    assert row["before_per_s"] > 0 and row["fault_s"] > 0, row
    if scenario != "relay-sigkill":
        # Fenced completions: exactly once (the relay's deliveries are at least once).
        assert row["duplicated"] == 0, row
    if scenario == "worker-pause":
        assert row["stale_writes_accepted"] == 0 and row["stale_writes_refused"] >= 12, row
    assert summary["summary"] is True and summary["total_lost"] == 0, summary
