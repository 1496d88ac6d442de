"""Smoke test of ``python -m benchmarks.euterpe`` with tiny sizes, on both engines.

It checks the output contract (one JSON line per engine and run, then a
summary per engine) and that the counts add up: every job enqueued through
the Intake succeeded, every event (six a job) was processed exactly once by
the receiver process, the ffmpeg job's time splits into ffmpeg's and
Euterpe's. Never a speed. A run whose deliveries are refused fails loudly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import anyio
import pytest

from benchmarks._euterpe_receiver import ReceiverProcess
from benchmarks._euterpe_run import REQUESTER, BenchmarkFailed, Params, run_engine
from benchmarks.euterpe import main
from trace_core.security.webhook_signing import MasterSecret, WebhookSigner
from trace_testing.postgres import PostgresServer

JOBS = 3
STAGES = 6  # queued, claimed, fetching, processing, uploading, succeeded


def test_euterpe_benchmark_counts_add_up_on_both_engines(
    postgres_server: PostgresServer, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--runs", "1", "--jobs", str(JOBS), "--pg-url", postgres_server.url("postgres")]
    argv += ["--poll-max-seconds", "0.05", "--clip-seconds", "1", "--timeout", "120"]
    assert main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    runs, summaries = lines[:2], lines[2:]
    assert [(r["engine"], r["run"]) for r in runs] == [("sqlite", 0), ("postgres", 0)]
    for r in runs:
        assert r["bench"] == "euterpe" and r["verified"] is True
        assert r["jobs"] == r["jobs_succeeded"] == JOBS
        assert r["events"] == r["events_processed_once"] == JOBS * STAGES
        assert r["events_per_job"] == STAGES and r["duplicate_deliveries"] == 0
        for key in ("jobs_per_s", "enqueue_per_s", "processing_per_s", "deliveries_per_s"):
            assert r[key] > 0, key
        total = r["enqueue_s"] + r["processing_s"]
        assert r["jobs_per_s"] == pytest.approx(JOBS / total, rel=0.05)
        assert r["deliveries_per_s"] == pytest.approx(r["events"] / r["delivery_s"], rel=0.05)
        assert r["ffmpeg_ms"] > 0 and r["ffmpeg_output_bytes"] > 0
        assert r["ffmpeg_job_ms"] == pytest.approx(
            r["ffmpeg_ms"] + r["euterpe_overhead_ms"], abs=0.1
        )
        assert r["overhead_ratio"] == pytest.approx(
            r["euterpe_overhead_ms"] / r["ffmpeg_ms"], rel=0.01
        )
        assert r["overhead_state_writes_ms"] > 0 and r["overhead_claim_ms"] > 0
    assert [(s["engine"], s["summary"], s["runs"]) for s in summaries] == [
        ("sqlite", True, 1),
        ("postgres", True, 1),
    ]
    for summary, run in zip(summaries, runs, strict=True):
        assert summary["all_verified"] is True
        assert summary["median_jobs_per_s"] == pytest.approx(run["jobs_per_s"], abs=0.01)
        assert summary["median_overhead_ratio"] == pytest.approx(run["overhead_ratio"], abs=0.001)


def test_a_run_whose_deliveries_are_refused_fails_loudly(tmp_path: Path) -> None:
    from trace_core.storage.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'trace.db'}"
    upgrade(url)
    signer = WebhookSigner([MasterSecret("bench", os.urandom(32))])
    # The receiver knows another secret: every signature is refused (401).
    other = WebhookSigner([MasterSecret("other", os.urandom(32))]).requester_secrets(REQUESTER)
    params = Params(
        jobs=2,
        source_bytes=64,
        enqueue_concurrency=2,
        concurrency=2,
        batch_size=2,
        deliverer_batch=10,
        deliverer_concurrency=5,
        poll_max_seconds=0.05,
        timeout_seconds=60,
        clip=None,
    )
    with ReceiverProcess(tmp_path / "r.db", other, tmp_path / "r.log") as receiver:
        with pytest.raises(BenchmarkFailed, match="non-2xx: \\['401'"):
            anyio.run(run_engine, params, url, tmp_path / "run", receiver, signer)
        stats = anyio.run(receiver.stats)
    assert stats.total_processed == 0 and stats.rejected >= 1


def test_euterpe_benchmark_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    for bad, said in [
        (["--jobs", "0"], "--jobs must be >= 1"),
        (["--engines", "sqlite,mysql"], "--engines must list distinct engines"),
        (["--deliverer-batch", "26"], "--deliverer-batch must be within 1..25"),
        (["--clip-seconds", "-1"], "--clip-seconds must be >= 0"),
    ]:
        with pytest.raises(SystemExit):
            main(bad)
        assert said in capsys.readouterr().err
