"""Smoke test of ``python -m benchmarks.aws`` with tiny sizes, on moto's threaded server.

It checks the output contract (one JSON line per run, then a summary with
medians) and that the counts add up: every wake-up sent came back and was
deleted, every token was issued, every claim->complete task was completed
(by the SQS worker over HTTP against ``trace-aws serve`` on a throwaway
Postgres, and on the lite in-process path), on both paths. Never a speed.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.aws import main


def test_aws_benchmark_counts_add_up(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--wakeups", "23", "--tokens", "4", "--tasks", "7", "--concurrency", "2"]
    assert main([*argv, "--runs", "2"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    runs, summary = lines[:-1], lines[-1]
    assert [r["run"] for r in runs] == [0, 1]
    for r in runs:
        assert r["bench"] == "aws" and r["wakeups"] == 23 and r["tokens"] == 4
        assert r["tasks"] == 7 and r["concurrency"] == 2
        assert r["wakeups_aws_received"] == r["wakeups_aws_deleted"] == 23
        assert r["wakeups_lite_received"] == 23
        assert r["tokens_aws_issued"] == r["tokens_lite_issued"] == 4
        for side in ("aws", "lite"):
            assert r[f"claim_complete_{side}_outcomes"] == {"completed": 7}
            assert r[f"claim_complete_{side}_completed"] == 7
            # Read back from each path's database: every task of the runs so far.
            assert r[f"claim_complete_{side}_tasks_completed"] == 7 * (r["run"] + 1)
        for name in ("wakeups", "tokens", "claim_complete"):
            assert r[f"{name}_aws_per_s"] > 0 and r[f"{name}_lite_per_s"] > 0
            assert r[f"{name}_lite_over_aws"] == pytest.approx(
                r[f"{name}_lite_per_s"] / r[f"{name}_aws_per_s"], rel=0.01
            )
    assert summary["summary"] is True and summary["runs"] == 2
    for name in ("tokens", "claim_complete"):
        assert summary[f"median_{name}_lite_over_aws"] == pytest.approx(
            (runs[0][f"{name}_lite_over_aws"] + runs[1][f"{name}_lite_over_aws"]) / 2, abs=0.01
        )
    assert {"median_claim_complete_aws_per_s", "median_claim_complete_lite_per_s"} <= set(summary)


def test_aws_benchmark_without_tasks_skips_claim_complete(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--wakeups", "3", "--tokens", "2", "--tasks", "0", "--runs", "1"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert lines[0]["wakeups_aws_received"] == 3
    assert not any(key.startswith("claim_complete") for key in lines[0])
    assert "median_claim_complete_lite_over_aws" not in lines[-1]


def test_aws_benchmark_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--wakeups", "0"])
    assert "--wakeups must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--tasks", "-1"])
    assert "--tasks must be >= 0" in capsys.readouterr().err
