"""The lite platform running the chain pipeline end to end, on both engines.

Every partition the Spark operators write equals a reference computed with
plain pyarrow from the same synthetic chain; the alert table holds exactly
the reference's alerts, once each, also after retries that re-run a
partition's writes and publishes; a rematerialized version gives the same
outputs and swaps in.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import sqlalchemy as sa

from tests.crash_pipeline import CRASHING, crashing_platform
from tests.factories import wait_until
from tests.lite_pipeline import check_outputs, expected_alerts, small_dag, stored_alerts
from trace_core.authoring.context import TaskContext
from trace_core.authoring.operators import OperatorSpec
from trace_core.dispatcher.backfill import BackfillConfig
from trace_core.dispatcher.promoter import PromoterConfig
from trace_core.dispatcher.service import DispatcherConfig
from trace_core.dispatcher.sources import SourceConfig
from trace_core.storage import schema
from trace_core.storage.sql import SqlRepository
from trace_lite.buffered import SinkConfig, table_name_of
from trace_lite.cli import main
from trace_lite.platform import LiteConfig, TraceLite
from trace_lite.run_command import RunOptions, run_pipeline
from trace_lite.spark import SparkSessionProvider
from trace_lite.status import dataset_statuses, task_counts

pytestmark = pytest.mark.anyio

BLOCKS, SIZE = 1200, 400
ROOT = Path(__file__).resolve().parent.parent
FAST = DispatcherConfig(
    sources=SourceConfig(interval_seconds=0.2),
    promoter=PromoterConfig(interval_seconds=0.2),
    backfill=BackfillConfig(interval_seconds=0.2),
)


def _config(tmp_path: Path, database_url: str) -> LiteConfig:
    return LiteConfig(
        data_dir=tmp_path / "lite",
        database_url=database_url,
        workers=3,
        dispatcher=FAST,
        sink=SinkConfig(interval_seconds=0.1),
        drain_seconds=30,
    )


async def _current(database_url: str) -> list[Any]:
    repo = SqlRepository(database_url)
    try:
        return await dataset_statuses(repo, "chain")
    finally:
        await repo.close()


async def test_pipeline_outputs_equal_the_reference(
    tmp_path: Path,
    database_url: str,
    spark_provider: SparkSessionProvider,
    capsys: pytest.CaptureFixture[str],
) -> None:
    dag = tmp_path / "chain.yaml"
    dag.write_text(small_dag(BLOCKS, SIZE))
    config = _config(tmp_path, database_url)
    out = io.StringIO()
    options = RunOptions(dag, config, timeout_seconds=240, refresh_seconds=0.2)
    summary = await run_pipeline(options, out, spark=spark_provider)

    assert summary.finished, out.getvalue()
    assert summary.blocks == BLOCKS
    statuses = await _current(database_url)
    check_outputs(config.data_dir, statuses, BLOCKS, SIZE)
    alerts_table = table_name_of(next(s.location for s in statuses if s.name == "alerts"))
    stored = stored_alerts(config.data_dir / "data.db", alerts_table)
    expected = expected_alerts(BLOCKS, SIZE)
    assert expected  # the example's rules do fire on this range
    assert len(stored) == len(set(stored))
    assert set(stored) == expected
    assert summary.alerts == len(expected)
    text = out.getvalue()
    assert "chain: finished" in text and "range_aggregates" in text

    # The status commands read the same state.
    db, data_dir = ["--db", database_url], ["--data-dir", str(config.data_dir)]
    capsys.readouterr()
    outputs = []
    for argv in (
        ["status", "chain", *db],
        ["datasets", "chain", *db, *data_dir],
        ["tasks", "chain", *db, "--job", "alerts"],
    ):
        assert await anyio.to_thread.run_sync(main, argv) == 0
        outputs.append(capsys.readouterr().out)
    status, datasets, tasks = outputs
    assert re.search(r"range_aggregates\s+current\s+\S+\s+3\s+0-1199", status)
    assert re.search(r"aggregate\s+0\s+0\s+0\s+3\s+0", status)
    assert re.search(rf"alerts\s.*current\s+\d+\s+0\s+{len(expected)}\s+postgres_table:", datasets)
    assert re.search(r"transactions\s.*current\s+3\s+1200\s+\d+\s+s3://", datasets)
    assert sorted(re.findall(r"alerts\s+(\d+-\d+)\s+Completed", tasks)) == [
        "0-399",
        "400-799",
        "800-1199",
    ]


def _fail_once_after(run: Any, failures: dict[str, int]) -> Any:
    """``run``, but the first attempt of each partition raises after its writes
    and publishes (a worker dying between writing and completing)."""

    def operator(ctx: TaskContext) -> Any:
        result = run(ctx)
        key = ctx.inputs[0]["partition_key"]
        if ctx.attempt == 1:
            failures[key] = failures.get(key, 0) + 1
            raise RuntimeError(f"injected failure after writing {key}")
        return result

    return operator


async def test_retried_partitions_replace_outputs_and_add_no_alerts(
    tmp_path: Path, database_url: str, spark_provider: SparkSessionProvider
) -> None:
    config = _config(tmp_path, database_url)
    failures: dict[str, int] = {}
    async with TraceLite(config, spark=spark_provider) as lite:
        registry = lite.dispatcher.operators
        for name in ("range_aggregator", "alert_evaluate"):
            registry.register(
                OperatorSpec(f"flaky_{name}", _fail_once_after(registry.get(name).run, failures))
            )
        text = small_dag(
            BLOCKS,
            SIZE,
            operators={"aggregate": "flaky_range_aggregator", "alerts": "flaky_alert_evaluate"},
        )
        dag = tmp_path / "chain.yaml"
        dag.write_text(text)
        await lite.deploy(dag)
        await wait_until(
            "every partition retried and done",
            lambda: _all_done(lite),
            time.monotonic() + 180,
            describe=lambda: task_counts(lite.repo, "chain"),
        )
    assert sum(failures.values()) == 2 * (BLOCKS // SIZE)  # every partition, both jobs
    statuses = await _current(database_url)
    check_outputs(config.data_dir, statuses, BLOCKS, SIZE)
    alerts_table = table_name_of(next(s.location for s in statuses if s.name == "alerts"))
    stored = stored_alerts(config.data_dir / "data.db", alerts_table)
    assert len(stored) == len(set(stored)) and set(stored) == expected_alerts(BLOCKS, SIZE)


async def _all_done(lite: TraceLite) -> bool:
    counts = await task_counts(lite.repo, "chain")
    completed = {job: c.get("Completed", 0) for job, c in counts.by_job.items()}
    partitions = BLOCKS // SIZE
    return (
        completed.get("aggregate", 0) == partitions
        and completed.get("alerts", 0) == partitions
        and counts.open_except(frozenset({"follow"})) == 0
        and await lite.buffer.pending() == 0
    )


async def test_rematerialized_version_swaps_in_with_identical_outputs(
    tmp_path: Path, database_url: str, spark_provider: SparkSessionProvider
) -> None:
    dag = tmp_path / "chain.yaml"
    dag.write_text(small_dag(BLOCKS, SIZE))
    config = _config(tmp_path, database_url)
    options = RunOptions(dag, config, timeout_seconds=240, refresh_seconds=0.2)
    assert (await run_pipeline(options, io.StringIO(), spark=spark_provider)).finished
    before = {s.name: s for s in await _current(database_url)}

    # A changed aggregator config: new versions of range_aggregates and alerts.
    dag.write_text(small_dag(BLOCKS, SIZE, aggregate_config={"generation": 2}))
    summary = await run_pipeline(options, io.StringIO(), spark=spark_provider)
    assert summary.finished
    after = {s.name: s for s in await _current(database_url) if s.dag_version_status == "current"}
    for name in ("blocks", "transactions"):
        assert after[name].dataset_version == before[name].dataset_version  # kept
    for name in ("range_aggregates", "alerts"):
        assert after[name].dataset_version != before[name].dataset_version  # rebuilt
    check_outputs(config.data_dir, list(after.values()), BLOCKS, SIZE)
    stored = stored_alerts(config.data_dir / "data.db", table_name_of(after["alerts"].location))
    assert set(stored) == expected_alerts(BLOCKS, SIZE) and len(stored) == len(set(stored))


async def test_a_worker_killed_mid_partition_still_finishes_correctly(
    tmp_path: Path, database_url: str, spark_provider: SparkSessionProvider
) -> None:
    dag = tmp_path / "chain.yaml"
    dag.write_text(small_dag(BLOCKS, SIZE, operators={"aggregate": CRASHING}, heartbeat="3s"))
    config = {
        "url": database_url,
        "data_dir": str(tmp_path / "lite"),
        "dag": str(dag),
        "partition": "400-799",
    }
    root = ROOT
    child = await anyio.to_thread.run_sync(
        lambda: subprocess.run(
            [sys.executable, str(root / "tests" / "crash_pipeline.py"), json.dumps(config)],
            cwd=root,
            env={**os.environ, "PYTHONPATH": str(root)},
            capture_output=True,
            text=True,
            timeout=240,
        )
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    assert "crash point reached: mid-partition 400-799" in child.stderr

    async with crashing_platform(config, None, spark=spark_provider) as lite:
        await lite.deploy(dag)  # unchanged: the same version goes on
        await wait_until(
            "the killed partition retried and everything done",
            lambda: _all_done(lite),
            time.monotonic() + 180,
            describe=lambda: task_counts(lite.repo, "chain"),
        )
        attempts = await _attempts(lite, "aggregate")
    assert attempts["400-799"] >= 2  # the killed attempt was reclaimed and retried
    statuses = await _current(database_url)
    data_dir = tmp_path / "lite"
    check_outputs(data_dir, statuses, BLOCKS, SIZE)
    alerts_table = table_name_of(next(s.location for s in statuses if s.name == "alerts"))
    stored = stored_alerts(data_dir / "data.db", alerts_table)
    assert len(stored) == len(set(stored)) and set(stored) == expected_alerts(BLOCKS, SIZE)


async def _attempts(lite: TraceLite, job: str) -> dict[str, int]:
    t, j = schema.tasks, schema.jobs
    async with lite.repo.read() as tx:
        rows = await tx.connection.execute(
            sa.select(t.c.partitions, t.c.attempt)
            .join(j, j.c.id == t.c.job_id)
            .where(j.c.name == job)
        )
        return {r.partitions[0]: r.attempt for r in rows}
