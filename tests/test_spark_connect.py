"""The same pipeline DAG on a Spark Connect server instead of ``local[*]``.

A real Spark Connect server (the one PySpark ships) is started on loopback;
``trace-lite run --spark-remote sc://…`` runs the chain pipeline through it in
a child process (a process holding a classic session cannot open a remote
one), and every output is checked against the pyarrow reference.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pyspark
import pytest

from tests.lite_pipeline import check_outputs, expected_alerts, small_dag, stored_alerts
from tests.spark_fixtures import TEST_JVM_OPTIONS
from tests.test_lineage_pipeline import alerts_upstream, expected_alerts_upstream
from trace_core.storage.sql import SqlRepository
from trace_lite.buffered import table_name_of
from trace_lite.spark import SparkConfig, SparkSessionProvider
from trace_lite.status import dataset_statuses

BLOCKS, SIZE = 600, 300
ROOT = Path(__file__).resolve().parent.parent
STARTUP_SECONDS = 180


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _accepting(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def connect_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Spark Connect server on a free loopback port, stopped afterwards."""
    port = _free_port()
    log = (tmp_path_factory.mktemp("spark-connect") / "server.log").open("w")
    submit = Path(pyspark.__file__).parent / "bin" / "spark-submit"
    server = subprocess.Popen(
        [
            str(submit),
            "--class",
            "org.apache.spark.sql.connect.service.SparkConnectServer",
            "--master",
            "local[1]",
            "--conf",
            f"spark.connect.grpc.binding.port={port}",
            "--conf",
            "spark.connect.grpc.binding.address=127.0.0.1",
            "--conf",
            "spark.ui.enabled=false",
            "--driver-java-options",
            TEST_JVM_OPTIONS,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # spark-submit starts a JVM: stop the whole group
    )
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while not _accepting(port):
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"Spark Connect server did not start (exit {server.poll()})")
            time.sleep(0.5)  # a process outside our control: poll it, bounded
        yield f"sc://127.0.0.1:{port}"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


@pytest.mark.anyio
async def test_the_pipeline_runs_on_spark_connect(connect_url: str, tmp_path: Path) -> None:
    dag = tmp_path / "chain.yaml"
    dag.write_text(small_dag(BLOCKS, SIZE))
    data_dir = tmp_path / "lite"
    argv = [
        sys.executable,
        "-m",
        "trace_lite.cli",
        "run",
        str(dag),
        "--data-dir",
        str(data_dir),
        "--spark-remote",
        connect_url,
        "--timeout",
        "300",
    ]
    done = await anyio.to_thread.run_sync(
        lambda: subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=400)
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "chain: finished" in done.stdout

    repo = SqlRepository(f"sqlite:///{data_dir / 'trace.db'}")
    try:
        statuses = await dataset_statuses(repo, "chain")
    finally:
        await repo.close()
    check_outputs(data_dir, statuses, BLOCKS, SIZE)
    alerts = table_name_of(next(s.location for s in statuses if s.name == "alerts"))
    stored = stored_alerts(data_dir / "data.db", alerts)
    assert set(stored) == expected_alerts(BLOCKS, SIZE) and len(stored) == len(set(stored))
    # Lineage is derived on Connect too (from the analyzed plan's text): the
    # same table as the classic session's.
    rows = await alerts_upstream(f"sqlite:///{data_dir / 'trace.db'}")
    recorded = {(r.output_name, r.output_column, r.input_name, r.input_column) for r in rows}
    assert recorded == expected_alerts_upstream()


# A child process, as above: this one holds classic sessions.
_RECOVERY = """
import sys
from trace_lite.spark import SparkConfig, SparkSessionProvider
provider = SparkSessionProvider(SparkConfig(remote=sys.argv[1]))
first = provider.get()
assert first.range(3).count() == 3
first.stop()  # closed behind the provider's back
second = provider.get()
assert second is not first and provider.get() is second
print(second.range(4).count())
provider.stop()
"""


def test_a_closed_spark_connect_session_is_replaced(connect_url: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _RECOVERY, connect_url],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["4"]
    assert "the Spark Connect session is closed; starting a new one" in done.stderr
    assert connect_url not in done.stderr  # the URL may carry a token: never logged


def test_an_unreachable_connect_url_fails_at_once_naming_host_and_port() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    provider = SparkSessionProvider(SparkConfig(remote=f"sc://127.0.0.1:{port}/;token=s3cret"))
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}") as raised:
        provider.get()
    assert "s3cret" not in str(raised.value)
    assert not provider.started
