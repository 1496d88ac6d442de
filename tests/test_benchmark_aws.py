"""Smoke test of ``python -m benchmarks.aws`` with tiny sizes, on moto's threaded server.

It checks the output contract (one JSON line per run, then a summary with
medians) and that the counts add up: every wake-up sent came back and was
deleted, every token was issued, on both paths. Never a speed.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.aws import main


def test_aws_benchmark_counts_add_up(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--wakeups", "23", "--tokens", "4", "--runs", "2"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    runs, summary = lines[:-1], lines[-1]
    assert [r["run"] for r in runs] == [0, 1]
    for r in runs:
        assert r["bench"] == "aws" and r["wakeups"] == 23 and r["tokens"] == 4
        assert r["wakeups_aws_received"] == r["wakeups_aws_deleted"] == 23
        assert r["wakeups_lite_received"] == 23
        assert r["tokens_aws_issued"] == r["tokens_lite_issued"] == 4
        for name in ("wakeups", "tokens"):
            assert r[f"{name}_aws_per_s"] > 0 and r[f"{name}_lite_per_s"] > 0
            assert r[f"{name}_lite_over_aws"] == pytest.approx(
                r[f"{name}_lite_per_s"] / r[f"{name}_aws_per_s"], rel=0.01
            )
    assert summary["summary"] is True and summary["runs"] == 2
    assert summary["median_tokens_lite_over_aws"] == pytest.approx(
        (runs[0]["tokens_lite_over_aws"] + runs[1]["tokens_lite_over_aws"]) / 2, abs=0.01
    )


def test_aws_benchmark_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--wakeups", "0"])
    assert "--wakeups must be >= 1" in capsys.readouterr().err
