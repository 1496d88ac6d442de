"""Lineage reported in a completion's outputs is recorded with the completion,
and only with an accepted one, on both engines."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa
from factories import JobDef, build_dag, stable_id

from trace_core.clock import ManualClock
from trace_core.dispatcher.control import TaskControl
from trace_core.errors import InvalidInput, StaleClaim
from trace_core.model import Fence
from trace_core.storage import schema
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import TaskQueue

pytestmark = pytest.mark.anyio


def ds(name: str) -> uuid.UUID:
    return stable_id("dataset", "acme", name)


async def test_a_completion_records_its_outputs_lineage_and_a_stale_one_nothing(
    repo: SqlRepository, clock: ManualClock
) -> None:
    jobs = await build_dag(repo, clock.now(), [JobDef("agg", inputs=("tx",), outputs=("out",))])
    async with repo.transaction() as tx:
        (created,) = await tx.create_tasks([NewTask(jobs["agg"])], now=clock.now())
    tq = TaskQueue(repo, clock=clock)
    control = TaskControl(repo, clock=clock, tasks=tq)
    lease = (await tq.claim(created.task_id, "w")).lease
    assert lease is not None
    lineage = [["total", str(ds("tx")), "value", "AGGREGATION"]]
    outputs = [{"rows": 3, "lineage": lineage}]

    other = [{"lineage": [["total", str(ds("out")), "value", "AGGREGATION"]]}]
    with pytest.raises(InvalidInput, match="not inputs of the job"):
        await control.complete(
            Fence(created.task_id, lease.attempt, lease.lease_token), outputs=other
        )

    stale = Fence(created.task_id, lease.attempt, uuid.uuid4())
    with pytest.raises(StaleClaim):
        await control.complete(stale, outputs=outputs)
    async with repo.read() as tx:
        assert await tx.lineage.upstream(ds("out")) == []

    await control.complete(
        Fence(created.task_id, lease.attempt, lease.lease_token), outputs=outputs
    )
    async with repo.read() as tx:
        (row,) = await tx.lineage.upstream(ds("out"))
        stored = await tx.connection.execute(
            sa.select(schema.tasks.c.outputs).where(schema.tasks.c.id == created.task_id)
        )
    assert (row.output_column, row.input_name, row.input_column, row.job_id, row.kind) == (
        "total",
        "tx",
        "value",
        jobs["agg"],
        "AGGREGATION",
    )
    # recorded for the version of the output the task's DAG version points at
    assert row.dataset_version == stable_id("dataset-version", "acme", "dex", "current", "out")
    # the task keeps its outputs without the lineage
    assert stored.scalar_one() == [{"rows": 3}]


async def test_lineage_of_an_output_without_a_version_does_not_fail_the_completion(
    repo: SqlRepository, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    jobs = await build_dag(repo, clock.now(), [JobDef("agg", inputs=("tx",), outputs=("out",))])
    async with repo.transaction() as tx:
        # an output no version was made for (its pointer and version gone)
        await tx.connection.execute(sa.delete(schema.dag_version_datasets))
        await tx.connection.execute(sa.delete(schema.dataset_versions))
        (created,) = await tx.create_tasks([NewTask(jobs["agg"])], now=clock.now())
    tq = TaskQueue(repo, clock=clock)
    control = TaskControl(repo, clock=clock, tasks=tq)
    lease = (await tq.claim(created.task_id, "w")).lease
    assert lease is not None
    outputs = [{"rows": 3, "lineage": [["total", str(ds("tx")), "value", "AGGREGATION"]]}]

    await control.complete(
        Fence(created.task_id, lease.attempt, lease.lease_token), outputs=outputs
    )

    async with repo.read() as tx:
        assert await tx.lineage.upstream(ds("out")) == []
        status = await tx.connection.execute(
            sa.select(schema.tasks.c.status).where(schema.tasks.c.id == created.task_id)
        )
    assert status.scalar_one() == "Completed"
    assert "not recorded: no version" in caplog.text
