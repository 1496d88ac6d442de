"""The shared Spark session comes back after its driver dies.

Real ``local[2]`` sessions on this test's own provider (see
``tests/spark_fixtures.py``): the driver JVM is SIGKILLed, or its context
stopped behind the provider's back, and the next ``get()`` hands out a new,
working session, started once however many threads ask. A lite pipeline run
whose JVM is killed mid-partition finishes with outputs equal to the
reference, on both engines.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.factories import wait_until
from tests.lite_pipeline import check_outputs, expected_alerts, small_dag, stored_alerts
from tests.spark_fixtures import kill_driver
from tests.test_lite_pipeline import BLOCKS, SIZE, _all_done, _attempts, _config, _current
from trace_core.authoring.context import TaskContext
from trace_core.authoring.operators import OperatorSpec
from trace_lite.buffered import table_name_of
from trace_lite.platform import TraceLite
from trace_lite.spark import SparkSessionProvider
from trace_lite.status import task_counts

CALLERS = 8
JOIN_SECONDS = 300  # a JVM start takes seconds, far more on a loaded machine
KILLED_PARTITION = "400-799"


def _restarts(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "trace_lite.spark" and r.levelno == logging.WARNING
    ]


def _driver_pid(session: Any) -> int:
    return int(session.sparkContext._gateway.proc.pid)


def test_a_killed_driver_is_replaced_once_for_concurrent_callers(
    own_spark_provider: SparkSessionProvider, caplog: pytest.LogCaptureFixture
) -> None:
    provider = own_spark_provider
    first = provider.get()
    assert first.range(3).count() == 3
    assert provider.get() is first  # alive: handed out again, nothing restarted
    pid = kill_driver(first)

    barrier = threading.Barrier(CALLERS)
    got: list[Any] = []

    def call() -> None:
        barrier.wait(timeout=JOIN_SECONDS)  # every caller asks after the death, at once
        got.append(provider.get())

    with caplog.at_level(logging.WARNING, logger="trace_lite.spark"):
        threads = [threading.Thread(target=call) for _ in range(CALLERS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(JOIN_SECONDS)
    assert len(got) == CALLERS
    second = got[0]
    assert all(session is second for session in got)
    assert second is not first
    assert _driver_pid(second) != pid  # a new JVM, not the dead one dialed again
    assert _restarts(caplog) == [
        f"Spark session 'trace-tests': the driver JVM (pid {pid}) exited with code -9; "
        "starting a new one"
    ]
    frame = second.createDataFrame([(1,), (2,), (3,)], "n long")
    assert frame.groupBy().sum("n").collect()[0][0] == 6
    assert provider.get() is second


@pytest.mark.parametrize("side", ["python", "jvm"])
def test_a_context_stopped_behind_the_providers_back_is_replaced(
    own_spark_provider: SparkSessionProvider, caplog: pytest.LogCaptureFixture, side: str
) -> None:
    provider = own_spark_provider
    first = provider.get()
    pid = _driver_pid(first)
    if side == "python":
        first.stop()
    else:
        first.sparkContext._jsc.sc().stop()  # as Spark does on a fatal error
    with caplog.at_level(logging.WARNING, logger="trace_lite.spark"):
        second = provider.get()
    assert second is not first
    assert second.range(5).count() == 5
    assert _driver_pid(second) == pid  # the JVM lives on: only the context is new
    assert _restarts(caplog) == [
        "Spark session 'trace-tests': its SparkContext was stopped; starting a new one"
    ]


def _kill_the_driver_mid_partition(
    run: Any, provider: SparkSessionProvider, killed: list[int]
) -> Any:
    """``run``, but the first attempt of one partition has its driver JVM killed
    while it uses Spark: that attempt fails as any task on the dead JVM would."""

    def operator(ctx: TaskContext) -> Any:
        if ctx.inputs[0]["partition_key"] == KILLED_PARTITION and ctx.attempt == 1:
            session = provider.get()
            killed.append(kill_driver(session))
            session.range(10).count()  # raises: the JVM is gone
        return run(ctx)

    return operator


@pytest.mark.anyio
async def test_a_pipeline_run_survives_its_driver_jvm_being_killed(
    tmp_path: Path,
    database_url: str,
    own_spark_provider: SparkSessionProvider,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = _config(tmp_path, database_url)
    killed: list[int] = []
    caplog.set_level(logging.WARNING, logger="trace_lite.spark")
    async with TraceLite(config, spark=own_spark_provider) as lite:
        registry = lite.dispatcher.operators
        registry.register(
            OperatorSpec(
                "killing_range_aggregator",
                _kill_the_driver_mid_partition(
                    registry.get("range_aggregator").run, own_spark_provider, killed
                ),
            )
        )
        dag = tmp_path / "chain.yaml"
        dag.write_text(small_dag(BLOCKS, SIZE, operators={"aggregate": "killing_range_aggregator"}))
        await lite.deploy(dag)
        await wait_until(
            "every partition done after the driver JVM was killed",
            lambda: _all_done(lite),
            time.monotonic() + JOIN_SECONDS,
            describe=lambda: task_counts(lite.repo, "chain"),
        )
        attempts = await _attempts(lite, "aggregate")
    assert len(killed) == 1
    assert attempts[KILLED_PARTITION] >= 2  # the attempt on the dead JVM failed and was retried
    [restart] = _restarts(caplog)  # one new session, whatever the threads in flight did
    assert f"pid {killed[0]}" in restart
    statuses = await _current(database_url)
    check_outputs(config.data_dir, statuses, BLOCKS, SIZE)
    alerts_table = table_name_of(next(s.location for s in statuses if s.name == "alerts"))
    stored = stored_alerts(config.data_dir / "data.db", alerts_table)
    assert len(stored) == len(set(stored)) and set(stored) == expected_alerts(BLOCKS, SIZE)
