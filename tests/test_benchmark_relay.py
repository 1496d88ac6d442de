"""Smoke test of ``python -m benchmarks.relay`` with tiny sizes, on both engines.

It checks the output contract (one JSON line per run, then a summary) and
that both drains left every row done (the run raises otherwise), not any speed.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.relay import main


def test_relay_benchmark_drains_both_ways(
    engine: str, database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--engine", engine, "--db", database_url, "--rows", "60", "--handler-ms", "1"]
    assert main([*args, "--runs", "2"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    runs, summary = lines[:-1], lines[-1]
    assert [r["run"] for r in runs] == [0, 1]
    for r in runs:
        assert r["bench"] == "relay" and r["engine"] == engine and r["rows"] == 60
        assert r["service_rows_per_s"] > 0 and r["batches_rows_per_s"] > 0
        # the ratio is printed to 2 decimals: off by at most half a hundredth
        expected = r["service_rows_per_s"] / r["batches_rows_per_s"]
        assert r["ratio"] == pytest.approx(expected, abs=0.0051)
    assert summary["summary"] is True
    assert summary["median_ratio"] == pytest.approx(
        (runs[0]["ratio"] + runs[1]["ratio"]) / 2, abs=0.01
    )


def test_relay_benchmark_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--engine", "sqlite", "--handler-ms", "-1"])
    assert "--handler-ms must be >= 0" in capsys.readouterr().err
