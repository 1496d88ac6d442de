"""Smoke test of ``python -m benchmarks.pipeline`` at a tiny size, on SQLite.

It runs the entry point in-process on the tests' shared Spark session and
checks the output contract and that both sides wrote the same data, not any
speed.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.pipeline import main
from trace_lite.spark import SparkSessionProvider

ARGS = [
    "--engine",
    "sqlite",
    "--blocks",
    "400",
    "--partition-size",
    "200",
    "--runs",
    "1",
    "--workers",
    "3",
    "--warmup-blocks",
    "0",
    "--refresh",
    "0.1",
]


def test_pipeline_benchmark_compares_equal_outputs(
    spark_provider: SparkSessionProvider, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(ARGS, spark=spark_provider) == 0
    assert spark_provider.started  # the shared session outlives the benchmark
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1
    result = lines[0]

    assert result["bench"] == "pipeline" and result["engine"] == "sqlite"
    assert (result["blocks"], result["runs"]) == (400, 1)
    assert (result["partition_size"], result["partitions"], result["workers"]) == (200, 2, 3)
    assert result["finished"] is True
    assert result["outputs_equal"] is True
    for key in ("seconds", "blocks_per_s", "plain_spark_seconds", "overhead_ratio"):
        assert result[key] > 0, key
    assert result["seconds_all"] == [result["seconds"]]
    assert result["plain_spark_seconds_all"] == [result["plain_spark_seconds"]]
    assert result["overhead_ratio_all"] == [result["overhead_ratio"]]

    (run,) = result["per_run"]
    outputs = run["outputs"]
    assert outputs["blocks"] == {"files": 2, "rows": 400, "plain_rows": 400, "equal": True}
    assert outputs["range_aggregates"]["rows"] == 400
    assert outputs["transactions"]["rows"] == run["transactions"] > 0
    assert outputs["alerts"]["equal"] is True
    assert outputs["alerts"]["rows"] == run["alerts"]
    timeline = run["pipeline_timeline"]
    assert (timeline["aggregate_tasks"], timeline["alerts_tasks"]) == (2, 2)
    assert timeline["follower"] > 0
