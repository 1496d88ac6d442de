"""The lite platform under faults: ``trace-lite run`` SIGKILLed twice and
started again, and its data directory's disk full.

Each run is a real ``trace-lite run`` process (:class:`benchmarks._chaos_lite.LiteRun`)
with its own Spark JVM; the outputs are checked against the pyarrow reference
(:func:`trace_testing.lite_reference.check_outputs`) and the alerts table against the
reference's alerts, once each.
"""

from __future__ import annotations

import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from benchmarks._chaos_lite import LiteRun, staging_left
from trace_core.errors import ConfigurationError
from trace_lite.buffered import table_name_of
from trace_lite.data_dir_lock import lock_data_directory
from trace_lite.takeover import sweep_staging
from trace_testing.faults import fill_disk, small_filesystem
from trace_testing.lite_reference import (
    chain_statuses,
    check_outputs,
    expected_alerts,
    small_dag,
    stored_alerts,
)

BLOCKS, SIZE = 600, 200
SEED_ENV = "TRACE_CHAOS_SEED"
"""Set it to replay the kill moments of a failed run (the seed is printed)."""


def test_the_lock_refuses_a_live_holder_naming_it_and_keeps_the_identity(
    tmp_path: Path,
) -> None:
    first = lock_data_directory(tmp_path)
    pid = os.getpid()
    with pytest.raises(
        ConfigurationError,
        match=rf"data directory {re.escape(str(tmp_path))} is in use .*pid {pid}",
    ):
        lock_data_directory(tmp_path)
    first.release()
    again = lock_data_directory(tmp_path)
    try:
        assert again.directory_id == first.directory_id  # the directory's identity stays
        assert again.previous_pid == pid
        assert again.worker_id == f"trace-lite/{first.directory_id}/{pid}"
        assert again.worker_id.startswith(again.worker_prefix)
    finally:
        again.release()


def test_a_sigkilled_holders_lock_is_released_by_the_kernel(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from trace_lite.data_dir_lock import lock_data_directory; "
            "lock_data_directory(Path(sys.argv[1])); print('locked', flush=True); time.sleep(600)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigurationError, match=rf"pid {holder.pid}\)"):
            lock_data_directory(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
        assert holder.stdout is not None
        holder.stdout.close()
    lock = lock_data_directory(tmp_path)  # no wait: the kernel dropped the dead holder's lock
    assert lock.previous_pid == holder.pid
    lock.release()


def test_sweep_staging_removes_only_staging_directories(tmp_path: Path) -> None:
    prefix = tmp_path / "objects" / "trace-lite" / "v1"
    staging = prefix / "._staging-abc"
    staging.mkdir(parents=True)
    (staging / "part-00000.parquet").write_bytes(b"PAR1 whole part file")
    (prefix / "blocks_0_199.parquet").write_bytes(b"PAR1")
    (prefix / ".other").mkdir()
    assert sweep_staging(tmp_path / "objects") == [staging]
    assert sorted(p.name for p in prefix.iterdir()) == [".other", "blocks_0_199.parquet"]
    assert sweep_staging(tmp_path / "missing") == []


def _check_finished(database_url: str, data_dir: Path) -> None:
    """Every dataset current, outputs equal to the reference, alerts once each,
    no staging directory left."""
    statuses = chain_statuses(database_url)
    assert statuses and all(s.dag_version_status == "current" for s in statuses), statuses
    check_outputs(data_dir, statuses, BLOCKS, SIZE)
    table = table_name_of(next(s.location for s in statuses if s.name == "alerts"))
    stored = stored_alerts(data_dir / "data.db", table)
    assert len(stored) == len(set(stored)), "duplicate alert rows"
    assert set(stored) == expected_alerts(BLOCKS, SIZE)
    assert staging_left(data_dir) == []


def test_run_killed_twice_at_random_moments_finishes_like_the_reference(
    tmp_path: Path, database_url: str
) -> None:
    seed = int(os.environ.get(SEED_ENV) or random.randrange(2**32))
    print(f"kill moments seeded with {SEED_ENV}={seed}")
    rng = random.Random(seed)
    dag = tmp_path / "chain.yaml"
    dag.write_text(small_dag(BLOCKS, SIZE))
    data_dir = tmp_path / "lite"
    killed: list[dict[str, Any]] = []
    # The first kill lands while the source runs, before Spark work (its lease
    # is what a restart used to wait out); the second in the middle of Spark work.
    for n, (what, running) in enumerate(
        (("the source running", 1), ("a task running beside the source", 2)), start=1
    ):
        run = LiteRun(dag, data_dir, database_url, tmp_path / f"run-{n}.log")
        run.wait_for(what, lambda r, running=running: r.running() >= running, 300)
        delay = rng.uniform(0.0, 4.0)
        time.sleep(delay)  # the random moment of the fault, not a wait for state
        run.kill()
        killed.append({"delay": round(delay, 2), "last": run.progress[-1][2], "seed": seed})

    final = LiteRun(dag, data_dir, database_url, tmp_path / "run-3.log")
    started = time.monotonic()
    assert final.finish(600) == 0, (killed, final.tail())
    output = "\n".join(final.lines)
    assert "chain: finished" in output, (killed, final.tail())
    # The killed run's leases were taken back at start, not waited out.
    assert re.search(r"restart after pid \d+: took back [1-9]\d* task lease", output), output
    print(f"killed {killed}; the last run took {time.monotonic() - started:.1f} s")
    _check_finished(database_url, data_dir)


def _integrity(path: Path) -> str:
    # Read-only: the check must not need the space the disk lacks.
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        return str(conn.execute("PRAGMA integrity_check").fetchone()[0])


def test_full_data_directory_stops_with_a_clear_error_and_resumes_once_space_is_back(
    tmp_path: Path,
) -> None:
    dag = tmp_path / "chain.yaml"
    dag.write_text(small_dag(BLOCKS, SIZE))
    with small_filesystem(96 * 1024 * 1024) as mount:
        data_dir = mount / "lite"  # the state database is its trace.db (SQLite)
        run = LiteRun(dag, data_dir, None, tmp_path / "run-1.log")
        run.wait_for("a task running beside the source", lambda r: r.running() >= 2, 300)
        filler = fill_disk(mount)
        assert run.finish(300) == 1, run.tail()
        error = run.log_file.read_text().strip().splitlines()[-1]
        assert error.startswith(f"trace-lite: DataDirectoryFull: data directory {data_dir} is full")
        for database in ("trace.db", "data.db"):
            assert _integrity(data_dir / database) == "ok", database

        # Still full: refused at start, before anything is written.
        again = LiteRun(dag, data_dir, None, tmp_path / "run-2.log")
        assert again.finish(120) == 1, again.tail()
        assert "DataDirectoryFull: data directory" in again.log_file.read_text()

        filler.unlink()
        final = LiteRun(dag, data_dir, None, tmp_path / "run-3.log")
        assert final.finish(600) == 0, final.tail()
        assert "chain: finished" in "\n".join(final.lines)
        _check_finished(f"sqlite:///{data_dir / 'trace.db'}", data_dir)
