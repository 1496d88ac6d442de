"""Smoke test of ``python -m benchmarks.streams`` with tiny sizes, on both engines.

It checks the output contract (one JSON line per run holding both transports'
figures) and that every task completed on each (``verified``), not any speed.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.streams import main
from trace_lite.redis_server import find_redis_server

pytestmark = pytest.mark.skipif(find_redis_server() is None, reason="redis-server not installed")


def test_streams_benchmark_measures_both_transports(
    engine: str, database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--engine", engine, "--db", database_url, "--tasks", "12", "--workers", "2"]
    assert main([*args, "--latency-samples", "2", "--runs", "1"]) == 0
    [row] = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert row["bench"] == "streams" and row["engine"] == engine and row["tasks"] == 12
    for transport in ("redis", "database"):
        assert row[f"{transport}_verified"] is True
        assert row[f"{transport}_tasks_per_s"] > 0
        assert 0 < row[f"{transport}_wakeup_p50_ms"] <= row[f"{transport}_wakeup_p99_ms"]
    # The transport's round trips per task, by command (messages were read and
    # acknowledged while the workers ran); the total is their sum.
    commands = row["redis_commands"]
    assert commands["xack"] > 0 and commands["xreadgroup"] > 0
    assert row["redis_commands_per_task"] == pytest.approx(sum(commands.values()), abs=0.05)
    assert row["redis_over_database"] == pytest.approx(
        row["redis_tasks_per_s"] / row["database_tasks_per_s"], 0.01
    )


def test_streams_benchmark_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--engine", "sqlite", "--latency-samples", "0"])
    assert "--latency-samples must be >= 1" in capsys.readouterr().err
