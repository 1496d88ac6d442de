"""Smoke test of ``python -m benchmarks.chaos --scenario lite-kill``, small.

It checks the output contract (one JSON row per run with the phases, then a
summary) and that the killed run lost nothing, not any speed.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.chaos import main, scenarios


def test_lite_kill_scenario_reports_phases_and_loses_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert "lite-kill" in scenarios()
    argv = ["--scenario", "lite-kill", "--engine", "sqlite", "--runs", "1", "--scale", "0.25"]
    assert main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    [run, summary] = lines
    assert (run["scenario"], run["engine"], run["run"]) == ("lite-kill", "sqlite", 0)
    for key in ("before_per_s", "during_per_s", "after_per_s", "fault_s", "recover_s"):
        assert key in run, key
    if not (run["finished"] is True and run["blocks"] == 300):
        # pytest.fail, not an assert message: the restart's output is shown whole.
        pytest.fail(f"restart did not finish (seed {run['seed']}):\n{run['restart_tail']}")
    assert run["lost"] == 0, run["lost_detail"]
    assert run["blocks_at_kill"] > 0 and run["before_per_s"] > 0  # killed mid-run
    assert run["resume_s"] >= run["source_resume_s"] > 0
    assert run["staging_left"] == 0
    assert run["takeover"].startswith("restart after pid")  # leases taken back at once
    assert summary["summary"] is True and summary["runs"] == 1 and summary["total_lost"] == 0
