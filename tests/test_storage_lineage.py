"""The lineage area of the port (``tx.lineage``), on both engines."""

from __future__ import annotations

import uuid

import pytest
from factories import JobDef, build_dag, stable_id

from trace_core.clock import ManualClock
from trace_core.storage.ports import NewLineageEdge
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio

CHAIN = [
    JobDef("follow", outputs=("blocks", "transactions")),
    JobDef("aggregate", inputs=("blocks", "transactions"), outputs=("range_aggregates",)),
    JobDef("alerts", inputs=("range_aggregates",), outputs=("alerts",)),
]


def ds(name: str) -> uuid.UUID:
    return stable_id("dataset", "acme", name)


async def chain(repo: SqlRepository, clock: ManualClock) -> dict[str, object]:
    jobs = await build_dag(repo, clock.now(), CHAIN)
    async with repo.transaction() as tx:
        await tx.lineage.record(
            ds("range_aggregates"),
            jobs["aggregate"],
            [
                NewLineageEdge("block_number", ds("blocks"), "block_number"),
                NewLineageEdge("tx_count", ds("transactions"), "*"),
                NewLineageEdge("failed_count", ds("transactions"), "success"),
                NewLineageEdge("*", ds("transactions"), "value"),
            ],
        )
        await tx.lineage.record(
            ds("alerts"),
            jobs["alerts"],
            [
                NewLineageEdge("value", ds("range_aggregates"), "tx_count"),
                NewLineageEdge("value", ds("range_aggregates"), "failed_count"),
            ],
        )
    return dict(jobs)


async def test_upstream_of_a_column_follows_its_inputs_transitively(
    repo: SqlRepository, clock: ManualClock
) -> None:
    jobs = await chain(repo, clock)
    async with repo.read() as tx:
        rows = await tx.lineage.upstream(ds("alerts"), "value")
    got = {(r.depth, r.output_name, r.output_column, r.input_name, r.input_column) for r in rows}
    assert got == {
        (1, "alerts", "value", "range_aggregates", "tx_count"),
        (1, "alerts", "value", "range_aggregates", "failed_count"),
        (2, "range_aggregates", "tx_count", "transactions", "*"),
        (2, "range_aggregates", "failed_count", "transactions", "success"),
        (2, "range_aggregates", "*", "transactions", "value"),
    }
    assert {r.job_id for r in rows if r.depth == 1} == {jobs["alerts"]}
    async with repo.read() as tx:
        shallow = await tx.lineage.upstream(ds("alerts"), "value", max_depth=1)
    assert {r.depth for r in shallow} == {1}


async def test_downstream_of_a_column_reaches_what_reads_it(
    repo: SqlRepository, clock: ManualClock
) -> None:
    await chain(repo, clock)
    async with repo.read() as tx:
        rows = await tx.lineage.downstream(ds("transactions"), "success")
        value = await tx.lineage.downstream(ds("transactions"), "value")
        blocks = await tx.lineage.downstream(ds("blocks"), "timestamp")
    got = {(r.depth, r.output_name, r.output_column, r.input_column) for r in rows}
    assert got == {
        (1, "range_aggregates", "failed_count", "success"),
        # the transactions '*' edge: count(*) reads every row, whatever the column
        (1, "range_aggregates", "tx_count", "*"),
        (2, "alerts", "value", "failed_count"),
        (2, "alerts", "value", "tx_count"),
    }
    # a filter column decides every output row: everything downstream
    wide = {(r.depth, r.output_name, r.output_column) for r in value}
    assert (1, "range_aggregates", "*") in wide
    assert {(r.output_name, r.output_column) for r in value if r.depth == 2} >= {
        ("alerts", "value")
    }
    assert blocks == []


async def test_a_new_version_replaces_the_recorded_lineage(
    repo: SqlRepository, clock: ManualClock
) -> None:
    jobs = await chain(repo, clock)
    async with repo.transaction() as tx:
        await tx.lineage.record(
            ds("alerts"),
            jobs["alerts"],
            [NewLineageEdge("value", ds("range_aggregates"), "tx_count")],
        )
    async with repo.read() as tx:
        rows = await tx.lineage.upstream(ds("alerts"), max_depth=1)
    assert [(r.output_column, r.input_column) for r in rows] == [("value", "tx_count")]
