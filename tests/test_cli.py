"""The ``trace-lite`` CLI, on both engines (the README's and docs' examples: test_docs.py)."""

from __future__ import annotations

import io
from pathlib import Path

import anyio
import pytest

from trace_core.storage.migrate import head_revision
from trace_lite.cli import main
from trace_lite.demo import DemoConfig, run_demo


def test_db_upgrade_and_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    assert main(["db", "upgrade", "--db", url]) == 0
    assert head_revision() in capsys.readouterr().out
    assert main(["db", "check", "--db", url]) == 0
    assert '"differences": 0' in capsys.readouterr().out


def test_bad_database_url_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["db", "upgrade", "--db", "mysql://h/db"]) == 2
    err = capsys.readouterr().err
    assert "database URL 'mysql://h/db'" in err and "unsupported scheme" in err


def test_bad_option_names_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--tasks", "0"])
    assert "--tasks must be >= 1" in capsys.readouterr().err


def test_demo_finishes_every_task(database_url: str) -> None:
    out = io.StringIO()
    summary = anyio.run(run_demo, DemoConfig(database_url, tasks=120, workers=3, batch=10), out)
    assert summary["tasks_by_status"] == {"Completed": 120}
    assert summary["stale_writes_refused"] == 1
    assert "refused as stale" in out.getvalue()
    # A second run against the same database works too (fresh dedupe keys).
    summary = anyio.run(run_demo, DemoConfig(database_url, tasks=30, workers=2), io.StringIO())
    assert summary["tasks_by_status"] == {"Completed": 30}


MANUAL_DAG = """
dag: ops
jobs:
  - name: kick
    activation: source
    runtime: ecs_platform
    operator: block_follower
    source: { kind: manual }
    outputs: [ { dataset: kicks } ]
  - name: react
    activation: reactive
    runtime: ecs_platform
    operator: range_aggregator
    execution_strategy: PerUpdate
    inputs: [ { from: { dataset: kicks } } ]
    outputs: [ { dataset: reacted } ]
"""


def test_trigger_explain_and_metrics(
    database_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dag_file = tmp_path / "ops.yaml"
    dag_file.write_text(MANUAL_DAG)
    assert main(["dag", "deploy", str(dag_file), "--db", database_url]) == 0
    capsys.readouterr()
    assert main(["trigger", "kick", "--key", "run-1", "--db", database_url]) == 0
    first = capsys.readouterr().out
    assert main(["trigger", "ops/kick", "--key", "run-1", "--db", database_url]) == 0
    again = capsys.readouterr().out
    assert first.split(":")[0] == again.split(":")[0]  # the same task, once
    assert "created" in first and "already exists" in again

    assert main(["metrics", "--db", database_url]) == 0
    assert 'trace_job_queue_depth{dag="ops",job="kick"} 1' in capsys.readouterr().out

    assert main(["explain", "ops", "react", "--db", database_url]) == 0
    out = capsys.readouterr().out
    assert "ops/react (reactive" in out and "no events have arrived on its inputs" in out
    assert main(["explain", "ops", "nope", "--db", database_url]) == 1
    assert "no job 'nope' in DAG 'ops'" in capsys.readouterr().err
    assert main(["trigger", "kick", "--event", "{bad", "--db", database_url]) == 2
    assert "--event is not JSON" in capsys.readouterr().out
