"""The ``trace-lite`` CLI, on both engines (the README's and docs' examples: test_docs.py)."""

from __future__ import annotations

import io
import os
import queue
import re
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest

from trace_core.storage.migrate import head_revision, schema_state, upgrade
from trace_lite.cli import main
from trace_lite.demo import DemoConfig, run_demo
from trace_lite.state_database import locate

ROOT = Path(__file__).resolve().parent.parent


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


# --- one CLI: where the state database is, and who may create it -----------------------

EXAMPLE = str(ROOT / "examples" / "chain_pipeline.yaml")

# Every command that reads or operates a deployed system: none may create a database.
NO_CREATE = [
    ["status", "chain"],
    ["datasets", "chain"],
    ["tasks", "chain"],
    ["explain", "chain", "follow"],
    ["metrics"],
    ["trigger", "kick", "--key", "k"],
    ["dag", "deploy", EXAMPLE],
    ["dag", "rollback", "chain"],
    ["dag", "validate", EXAMPLE],
    ["db", "check"],
]


@pytest.fixture
def no_database_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``$TRACE_DATABASE_URL`` from the caller's environment."""
    monkeypatch.delenv("TRACE_DATABASE_URL", raising=False)


@pytest.mark.usefixtures("no_database_env")
@pytest.mark.parametrize("where", ["--data-dir", "--db", "default"])
@pytest.mark.parametrize("argv", NO_CREATE, ids=" ".join)
def test_a_read_command_never_creates_a_database(
    argv: list[str],
    where: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    if where == "--data-dir":
        options, expected = ["--data-dir", "state"], tmp_path / "state" / "trace.db"
    elif where == "--db":
        expected = tmp_path / "nested" / "x.db"
        options = ["--db", f"sqlite:///{expected}"]
    else:
        options, expected = [], tmp_path / ".trace" / "trace.db"
    code = main([*argv, *options])
    err = capsys.readouterr().err
    if argv[:2] == ["dag", "validate"] and where == "default":
        assert code == 0, err  # validation alone needs no database, and opens none
    else:
        assert code == 2
        assert f"no state database at {expected.resolve()}" in err
        assert "nothing was created" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.usefixtures("no_database_env")
def test_a_missing_database_is_one_line_on_stderr_without_traceback(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "trace_lite.cli", "status", "chain", "--data-dir", "nowhere"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert done.returncode == 2
    assert done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith(f"trace-lite: error: no state database at {tmp_path / 'nowhere'}")
    assert "trace-lite db upgrade --data-dir nowhere" in line
    assert list(tmp_path.iterdir()) == []


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRACE_DATABASE_URL"}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


@pytest.mark.usefixtures("no_database_env")
@pytest.mark.parametrize(
    "argv", [["status", "chain"], ["metrics"], ["dag", "deploy", EXAMPLE]], ids=" ".join
)
def test_an_unmigrated_sqlite_file_is_refused_with_the_command(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "trace.db").touch()  # an empty SQLite database: never migrated
    assert main([*argv, "--data-dir", str(state)]) == 2
    err = capsys.readouterr().err
    assert f"{state / 'trace.db'} is at schema revision none" in err
    assert f"run `trace-lite db upgrade --data-dir {state}` first" in err
    assert (state / "trace.db").stat().st_size == 0  # left as it was
    assert sorted(p.name for p in state.iterdir()) == ["trace.db"]


@pytest.mark.usefixtures("no_database_env")
def test_a_database_behind_or_ahead_is_refused_by_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    behind = tmp_path / "behind.db"
    upgrade(f"sqlite:///{behind}", "0002")
    assert main(["tasks", "chain", "--db", f"sqlite:///{behind}"]) == 2
    err = capsys.readouterr().err
    assert f"is at schema revision 0002, not the newest ({head_revision()})" in err
    assert f"`trace-lite db upgrade --db sqlite:///{behind}`" in err
    assert schema_state(f"sqlite:///{behind}").revision == "0002"  # not migrated by a read

    ahead = _at_revision(tmp_path / "ahead.db", "f00dfeed")
    for argv in (["status", "chain"], ["run", EXAMPLE], ["db", "upgrade"]):
        assert main([*argv, "--db", f"sqlite:///{ahead}"]) == 2
        assert "schema revision f00dfeed, which this trace-lite does not know" in (
            capsys.readouterr().err
        )
    assert schema_state(f"sqlite:///{ahead}").revision == "f00dfeed"


def _at_revision(path: Path, revision: str) -> Path:
    """A SQLite file that claims an Alembic revision (here: one no release shipped)."""
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) PRIMARY KEY)")
        conn.execute("INSERT INTO alembic_version VALUES (?)", (revision,))
    conn.close()
    return path


def test_schema_state_reads_without_migrating(database_url: str) -> None:
    state = schema_state(database_url)
    assert (state.revision, state.status) == (head_revision(), "current")


WAITING_DAG = """
dag: waits
jobs:
  - name: kick
    activation: source
    runtime: ecs_platform
    operator: block_follower
    source: { kind: manual }
    outputs:
      - { dataset: blocks, kind: parquet, range: { start: 0, end: 9 } }
"""


@pytest.mark.usefixtures("no_database_env")
def test_data_dir_alone_finds_the_database_run_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "waits.yaml").write_text(WAITING_DAG)
    # Nothing produces the range (its source waits for a manual trigger), so the run
    # stops at its timeout: what matters here is where it put the state.
    assert main(["run", "waits.yaml", "--data-dir", "lite", "--timeout", "1"]) == 1
    out = capsys.readouterr().out
    assert "waits: deployed" in out and "STOPPED BEFORE FINISHING" in out
    assert (tmp_path / "lite" / "trace.db").is_file()

    assert main(["status", "waits", "--data-dir", "lite"]) == 0
    assert re.search(r"blocks\s+current", capsys.readouterr().out)
    assert main(["datasets", "waits", "--data-dir", "lite"]) == 0
    assert re.search(r"blocks\s+\S+\s+current\s+0\s+0\s+0\s+s3://", capsys.readouterr().out)
    assert main(["explain", "waits", "kick", "--data-dir", "lite"]) == 0
    assert "waits/kick" in capsys.readouterr().out
    assert main(["trigger", "waits/kick", "--key", "k1", "--data-dir", "lite"]) == 0
    assert "created" in capsys.readouterr().out
    assert main(["tasks", "waits", "--data-dir", "lite"]) == 0
    assert re.search(r"kick\s+-\s+Queued", capsys.readouterr().out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lite", "waits.yaml"]


def _lines(process: subprocess.Popen[str]) -> queue.Queue[str | None]:
    """The process's output, line by line (``None`` at its end), read by a thread."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _wait_for(lines: queue.Queue[str | None], text: str) -> None:
    seen: list[str] = []
    while True:  # bounded: each line within the timeout, and the output ends
        line = lines.get(timeout=90)
        assert line is not None, f"exited before {text!r}:\n" + "".join(seen)
        seen.append(line)
        if text in line:
            return


def _start(argv: list[str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "trace_lite.cli", *argv],
        cwd=cwd,
        env=_env(TRACE_INTERNAL_TOKEN=TOKEN),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


TOKEN = "cli-test-token-0123456789abcdef"
STREAM = "trace-ecs-platform"


def test_serve_migrates_a_new_sqlite_file_and_a_worker_opens_none(tmp_path: Path) -> None:
    data_dir, worker_dir = tmp_path / "lite", tmp_path / "worker"
    worker_dir.mkdir()
    port = _free_port()
    # At debug, serve logs every request: the worker's first claim shows it is running.
    serve = ["serve", "--data-dir", str(data_dir), "--port", str(port), "--log-level", "debug"]
    server = _start(serve, tmp_path)
    processes = [server]
    try:
        server_lines = _lines(server)
        _wait_for(server_lines, "Application startup complete")
        state = schema_state(f"sqlite:///{data_dir / 'trace.db'}")
        assert (state.revision, state.status) == (head_revision(), "current")
        assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700

        api = f"http://127.0.0.1:{port}"
        worker = _start(
            ["worker", "--api", api, "--streams", STREAM, "--max-wait-ms", "500"], worker_dir
        )
        processes.append(worker)
        worker_lines = _lines(worker)
        _wait_for(server_lines, "POST /internal/worker/claim")
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0
        _wait_for(worker_lines, "stopped after 0 task(s)")
        assert list(worker_dir.iterdir()) == []  # a worker opens no database

        refused = _start(["worker", "--api", api, "--streams", "nope"], worker_dir)
        processes.append(refused)
        assert refused.wait(timeout=60) == 2
        assert refused.stdout is not None
        output = refused.stdout.read()
        assert "refused the worker" in output and "'nope' is not a worker queue" in output
        assert "Traceback" not in output

        refused = _start(["worker", "--api", api, "--streams", "nope"], worker_dir)
        processes.append(refused)
        assert refused.wait(timeout=60) == 2
        assert refused.stdout is not None
        output = refused.stdout.read()
        assert "refused the worker" in output and "'nope' is not a worker queue" in output
        assert "Traceback" not in output
    finally:
        for process in reversed(processes):
            if process.poll() is None:
                process.terminate()
            process.wait(timeout=60)
            assert process.stdout is not None
            process.stdout.close()


def test_every_starter_documents_the_one_rule(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("run", "serve", "demo"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "SQLite state database is migrated by this command" in text
        assert "trace-lite db upgrade --db URL" in text
    with pytest.raises(SystemExit):
        main(["worker", "--help"])
    assert "A worker opens no database" in " ".join(capsys.readouterr().out.split())


@pytest.fixture
def empty_postgres(postgres_server: Any) -> str:
    """A Postgres database with no tables: never migrated."""
    name = f"cli_empty_{uuid.uuid4().hex[:8]}"
    postgres_server.create_database(name)
    return str(postgres_server.url(name))


@pytest.mark.usefixtures("no_database_env")
def test_postgres_not_migrated_names_the_command_and_stays_empty(
    empty_postgres: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRACE_INTERNAL_TOKEN", TOKEN)
    wanted = f"run `trace-lite db upgrade --db {empty_postgres}` first"
    for argv in (
        ["status", "chain"],
        ["metrics"],
        ["serve"],  # starters too: Postgres is migrated only by `db upgrade`
        ["run", EXAMPLE],
        ["demo", "--tasks", "1"],
    ):
        assert main([*argv, "--db", empty_postgres]) == 2, argv
        err = capsys.readouterr().err
        assert "is at schema revision none (never migrated)" in err and wanted in err, argv
    assert schema_state(empty_postgres).status == "empty"
    assert list(tmp_path.iterdir()) == []  # and no data directory either

    upgrade(empty_postgres, "0002")  # behind: as after installing a newer Trace
    for argv in (["serve"], ["tasks", "chain"]):
        assert main([*argv, "--db", empty_postgres]) == 2
        err = capsys.readouterr().err
        assert "is at schema revision 0002, not the newest" in err and wanted in err
    assert schema_state(empty_postgres).status == "behind"

    assert main(["db", "upgrade", "--db", empty_postgres]) == 0
    assert main(["status", "chain", "--db", empty_postgres]) == 0
    assert "chain: not deployed" in capsys.readouterr().out


@pytest.mark.usefixtures("no_database_env")
def test_the_environment_names_the_database_and_is_named_in_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRACE_DATABASE_URL", "mysql://h/db")
    assert main(["status", "chain"]) == 2
    assert "$TRACE_DATABASE_URL: database URL 'mysql://h/db'" in capsys.readouterr().err
    monkeypatch.setenv("TRACE_DATABASE_URL", f"sqlite:///{tmp_path / 'env.db'}")
    assert main(["metrics"]) == 2
    assert f"no state database at {tmp_path / 'env.db'} (from $TRACE_DATABASE_URL)" in (
        capsys.readouterr().err
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["tasks", "chain", "--limit", "0"], "--limit must be >= 1"),
        (["explain", "chain", "follow", "--limit", "x"], "--limit must be an integer"),
        (["serve", "--port", "70000"], "--port must be within 1..65535"),
        (["run", EXAMPLE, "--blocks", "0"], "--blocks must be >= 1"),
        (["worker", "--api", "http://h", "--streams", "s", "--max-tasks", "0"], "--max-tasks"),
        (["status"], "the following arguments are required: dag_name"),
        (["status", "chain", "--nope"], "unrecognized arguments: --nope"),
        (["worker", "--streams", "s"], "the following arguments are required: --api"),
    ],
)
def test_bad_arguments_name_the_option(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.usefixtures("no_database_env")
def test_a_bad_data_database_url_is_named_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["run", EXAMPLE, "--data-db", "mysql://h/d"]) == 2
    assert "database URL 'mysql://h/d'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_one_rule_locates_the_state_database() -> None:
    env = {"TRACE_DATABASE_URL": "sqlite:///env.db"}
    assert locate("sqlite:///flag.db", "dir", env).raw == "sqlite:///flag.db"
    assert locate(None, "dir", env).raw == "sqlite:///env.db"  # the default of --db
    assert locate(None, "dir", {}).raw == "sqlite:///dir/trace.db"
    assert locate(None, None, {}).raw == "sqlite:///.trace/trace.db"
    assert locate(None, "dir", {}).upgrade_command() == "trace-lite db upgrade --data-dir dir"
    assert locate(None, None, env).upgrade_command() == "trace-lite db upgrade"
    with_password = locate("postgresql://u:hunter2@h/db", None, {}).upgrade_command()
    assert "hunter2" not in with_password and "postgresql://u:***@h/db" in with_password


@pytest.mark.usefixtures("no_database_env")
def test_an_unreachable_postgres_is_named_without_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"postgresql://nobody:hunter2@127.0.0.1:{_free_port()}/nothing"
    assert main(["status", "chain", "--db", url]) == 1
    err = capsys.readouterr().err
    assert "DatabaseUnavailable: cannot open the database" in err
    assert "postgresql+psycopg://nobody:***@127.0.0.1" in err and "hunter2" not in err
