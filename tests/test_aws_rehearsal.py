"""``./dev run --aws`` as a test: the chain pipeline on moto, Postgres, serve and two workers."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest
import yaml

from trace_aws.rehearsal import EXAMPLE, RehearsalOptions, moto_server, rehearse, with_runtime
from trace_core.errors import ConfigurationError

BLOCKS = 300


@pytest.mark.parametrize("engine", ["postgres"])
def test_the_rehearsal_runs_the_chain_pipeline_to_the_reference(
    database_url: str, tmp_path: Path
) -> None:
    out = io.StringIO()
    result = rehearse(
        RehearsalOptions(
            blocks=BLOCKS,
            work_dir=tmp_path,
            database_url=database_url,
            timeout_seconds=600,
            spark_memory="512m",
        ),
        out,
    )
    printed = out.getvalue()
    assert result.summary.finished, printed
    assert result.mismatches == [], printed
    datasets = {d["dataset"]: d for d in result.summary.datasets}
    assert set(datasets) == {"blocks", "transactions", "range_aggregates", "alerts"}
    assert all(d["dag_version"] == "current" for d in datasets.values()), printed
    assert datasets["blocks"]["rows"] == BLOCKS
    assert datasets["range_aggregates"]["rows"] == BLOCKS
    # The alert rows equal the reference's count (checked among the mismatches).
    assert result.summary.alerts == datasets["alerts"]["rows"]
    assert result.ok
    # The lines of `./dev run`: progress, then the summary, then the check.
    assert f"blocks {BLOCKS}/{BLOCKS} (100.0%)" in printed
    assert "chain: finished" in printed
    assert "outputs equal the pyarrow reference" in printed
    # serve and both workers ran as processes, wrote their logs, and are gone.
    assert {p.name for p in tmp_path.glob("*.log")} >= {
        "migrate.log",
        "serve.log",
        "worker-1.log",
        "worker-2.log",
    }
    assert len(result.pids) == 3
    for pid in result.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_the_jobs_move_to_the_worker_queue_runtime_and_nothing_else_changes() -> None:
    text = EXAMPLE.read_text()
    moved = yaml.safe_load(with_runtime(text, "ecs_platform"))
    original = yaml.safe_load(text)
    assert [j["runtime"] for j in moved["jobs"]] == ["ecs_platform"] * 3
    for job in (*moved["jobs"], *original["jobs"]):
        job.pop("runtime")
    assert moved == original


def test_without_moto_the_error_names_the_dev_dependency(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "moto.server", None)  # import fails as if absent
    refused = pytest.raises(ConfigurationError, match=r"moto's server, a dev dependency.*\[dev\]")
    with refused, moto_server():
        pass


def test_blocks_below_one_are_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="--blocks must be >= 1"):
        rehearse(RehearsalOptions(blocks=0, work_dir=tmp_path), io.StringIO())
    assert list(tmp_path.iterdir()) == []
