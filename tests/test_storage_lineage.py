"""The lineage area of the port (``tx.lineage``), on both engines."""

from __future__ import annotations

import argparse
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from factories import JobDef, build_dag, stable_id

from trace_core.clock import ManualClock
from trace_core.errors import NotFound
from trace_core.storage import schema
from trace_core.storage.migrate import head_revision, schema_diff, upgrade
from trace_core.storage.ports import LineageRow, NewLineageEdge
from trace_core.storage.sql import SqlRepository
from trace_core.storage.url import create_sync_engine, parse_database_url
from trace_lite.lineage_cli import LINEAGE_COMMANDS, lineage_lines

pytestmark = pytest.mark.anyio

CHAIN = [
    JobDef("follow", outputs=("blocks", "transactions")),
    JobDef("aggregate", inputs=("blocks", "transactions"), outputs=("range_aggregates",)),
    JobDef("alerts", inputs=("range_aggregates",), outputs=("alerts",)),
]


def ds(name: str) -> uuid.UUID:
    return stable_id("dataset", "acme", name)


def version(name: str, status: str = "current") -> uuid.UUID:
    """The dataset version :func:`build_dag` made for ``name`` in DAG version ``status``."""
    return stable_id("dataset-version", "acme", "dex", status, name)


async def chain(repo: SqlRepository, clock: ManualClock) -> dict[str, object]:
    jobs = await build_dag(repo, clock.now(), CHAIN)
    async with repo.transaction() as tx:
        await tx.lineage.record(
            ds("range_aggregates"),
            jobs["aggregate"],
            [
                NewLineageEdge("block_number", ds("blocks"), "block_number", "IDENTITY"),
                NewLineageEdge("tx_count", ds("transactions"), "*", "AGGREGATION"),
                NewLineageEdge("failed_count", ds("transactions"), "success", "AGGREGATION"),
                NewLineageEdge("*", ds("transactions"), "value", "FILTER"),
                # one input column can decide the rows in two ways
                NewLineageEdge("*", ds("transactions"), "block_number", "GROUP_BY"),
                NewLineageEdge("*", ds("transactions"), "block_number", "JOIN"),
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
    got = {
        (r.depth, r.output_name, r.output_column, r.input_name, r.input_column, r.kind)
        for r in rows
    }
    assert got == {
        (1, "alerts", "value", "range_aggregates", "tx_count", "TRANSFORMATION"),
        (1, "alerts", "value", "range_aggregates", "failed_count", "TRANSFORMATION"),
        (2, "range_aggregates", "tx_count", "transactions", "*", "AGGREGATION"),
        (2, "range_aggregates", "failed_count", "transactions", "success", "AGGREGATION"),
        (2, "range_aggregates", "*", "transactions", "value", "FILTER"),
        (2, "range_aggregates", "*", "transactions", "block_number", "GROUP_BY"),
        (2, "range_aggregates", "*", "transactions", "block_number", "JOIN"),
    }
    # recorded without a version: the dataset's (only, newest) version
    assert {r.dataset_version for r in rows if r.depth == 1} == {version("alerts")}
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


async def test_recording_a_version_again_replaces_its_lineage(
    repo: SqlRepository, clock: ManualClock
) -> None:
    jobs = await chain(repo, clock)
    async with repo.transaction() as tx:
        await tx.lineage.record(
            ds("alerts"),
            jobs["alerts"],
            [NewLineageEdge("value", ds("range_aggregates"), "tx_count", "IDENTITY")],
            dataset_version=version("alerts"),
        )
    async with repo.read() as tx:
        rows = await tx.lineage.upstream(ds("alerts"), max_depth=1)
    assert [(r.output_column, r.input_column, r.kind) for r in rows] == [
        ("value", "tx_count", "IDENTITY")
    ]


async def _record_building_alerts(
    repo: SqlRepository, clock: ManualClock
) -> tuple[uuid.UUID, uuid.UUID]:
    """A new DAG version builds a new version of alerts, with another operator,
    and records its lineage: ``alerts.level`` ← ``range_aggregates.failed_count``.
    Returns (that dataset version, its producing job)."""
    building = await build_dag(repo, clock.now(), [CHAIN[2]], status="building")
    new = version("alerts", "building")
    async with repo.transaction() as tx:
        await tx.lineage.record(
            ds("alerts"),
            building["alerts"],
            [NewLineageEdge("level", ds("range_aggregates"), "failed_count", "IDENTITY")],
            dataset_version=new,
        )
    return new, building["alerts"]


async def test_a_rematerialization_records_its_own_and_reads_answer_the_current_version(
    repo: SqlRepository, clock: ManualClock
) -> None:
    await chain(repo, clock)
    org = stable_id("org", "acme")
    async with repo.transaction() as tx:
        await tx.deploy.set_current_version(
            org, "dex", stable_id("dag", "acme", "dex", "current"), now=clock.now()
        )
    new, building_job = await _record_building_alerts(repo, clock)

    def edges(rows: list[LineageRow]) -> set[tuple[str, str, uuid.UUID | None]]:
        return {(r.output_column, r.input_column, r.dataset_version) for r in rows}

    old = {("value", "tx_count", version("alerts")), ("value", "failed_count", version("alerts"))}
    async with repo.read() as tx:
        # still building: the current version's lineage is read, the new one on request
        assert edges(await tx.lineage.upstream(ds("alerts"), max_depth=1)) == old
        assert edges(await tx.lineage.upstream(ds("alerts"), max_depth=1, dataset_version=new)) == {
            ("level", "failed_count", new)
        }
        down = await tx.lineage.downstream(ds("range_aggregates"), "failed_count")
    assert {(r.output_name, r.output_column) for r in down} == {("alerts", "value")}

    async with repo.transaction() as tx:
        await tx.deploy.set_current_version(
            org, "dex", stable_id("dag", "acme", "dex", "building"), now=clock.now()
        )
    async with repo.read() as tx:
        current = await tx.lineage.upstream(ds("alerts"), max_depth=1)
        older = await tx.lineage.upstream(
            ds("alerts"), max_depth=1, dataset_version=version("alerts")
        )
        down = await tx.lineage.downstream(ds("range_aggregates"), "failed_count")
    assert edges(current) == {("level", "failed_count", new)}
    assert {r.job_id for r in current} == {building_job}
    assert edges(older) == old  # the old version's lineage was not overwritten
    assert {(r.output_name, r.output_column) for r in down} == {("alerts", "level")}


async def test_recording_for_a_dataset_without_a_version_is_refused(
    repo: SqlRepository, clock: ManualClock
) -> None:
    jobs = await chain(repo, clock)
    raw = await build_dag(
        repo, clock.now(), [JobDef("load", inputs=("raw",), outputs=("loaded",))], dag="etl"
    )
    assert raw
    with pytest.raises(NotFound, match="no version"):
        async with repo.transaction() as tx:
            await tx.lineage.record(
                stable_id("dataset", "acme", "raw"),
                jobs["follow"],
                [NewLineageEdge("x", ds("blocks"), "block_number")],
            )


@pytest.fixture
def url_at_0006(engine: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A database of the engine under test migrated only to revision 0006."""
    if engine == "sqlite":
        url = f"sqlite:///{tmp_path / 'behind.db'}"
    else:
        server: Any = request.getfixturevalue("postgres_server")
        name = f"lineage_0006_{uuid.uuid4().hex[:8]}"
        server.create_database(name)
        url = str(server.url(name))
    upgrade(url, "0006")
    return url


def test_migration_0007_backfills_versions_and_kinds(url_at_0006: str, clock: ManualClock) -> None:
    """Rows recorded before 0007 get their dataset's current version (the
    producer's pointer, else the newest version) and a kind without subtype;
    rows of a dataset that has no version are dropped."""
    org, dag_version = uuid.uuid4(), uuid.uuid4()
    ids = {name: uuid.uuid4() for name in ("tx", "agg", "alerts", "orphan")}
    now = clock.now()
    older, newer, pointed, newest = (uuid.uuid4() for _ in range(4))
    eng = create_sync_engine(parse_database_url(url_at_0006))
    try:
        with eng.begin() as conn:
            conn.execute(sa.insert(schema.orgs).values(id=org, name="o", slug="o", created_at=now))
            for name, dataset in ids.items():
                conn.execute(
                    sa.insert(schema.datasets).values(
                        id=dataset,
                        org_id=org,
                        name=name,
                        producer_dag_name="chain" if name != "alerts" else "alerting",
                        producer_job_name=name,
                        producer_output_index=0,
                        created_at=now,
                        updated_at=now,
                    )
                )
            versions = [
                # agg: the producer's current version points at the older one
                (pointed, "agg", now - timedelta(hours=1)),
                (newest, "agg", now),
                # alerts: no current pointer, so the newest version
                (older, "alerts", now - timedelta(hours=1)),
                (newer, "alerts", now),
            ]
            for version_id, name, created in versions:
                conn.execute(
                    sa.insert(schema.dataset_versions).values(
                        id=version_id,
                        dataset_uuid=ids[name],
                        created_at=created,
                        storage_location=f"mem://{version_id}/",
                        config_hash=str(version_id),
                    )
                )
            conn.execute(
                sa.insert(schema.dag_versions).values(
                    id=dag_version,
                    org_id=org,
                    dag_name="chain",
                    yaml_hash="h",
                    status="current",
                    created_at=now,
                )
            )
            conn.execute(
                sa.insert(schema.dag_current_versions).values(
                    org_id=org, dag_name="chain", dag_version_id=dag_version, updated_at=now
                )
            )
            conn.execute(
                sa.insert(schema.dag_version_datasets).values(
                    dag_version_id=dag_version, dataset_uuid=ids["agg"], dataset_version=pointed
                )
            )
            old_rows = [
                ("agg", "total", "tx", "value"),
                ("agg", "*", "tx", "block_number"),
                ("alerts", "value", "agg", "total"),
                ("orphan", "x", "tx", "value"),
            ]
            cols = ("output_dataset_uuid", "output_column", "input_dataset_uuid", "input_column")
            conn.execute(
                sa.text(
                    f"INSERT INTO column_lineage ({', '.join(cols)}) "
                    f"VALUES ({', '.join(':' + c for c in cols)})"
                ).bindparams(
                    sa.bindparam("output_dataset_uuid", type_=schema.datasets.c.id.type),
                    sa.bindparam("input_dataset_uuid", type_=schema.datasets.c.id.type),
                ),
                [
                    dict(zip(cols, (ids[out], oc, ids[inp], ic), strict=True))
                    for out, oc, inp, ic in old_rows
                ],
            )
        assert upgrade(url_at_0006) == head_revision()
        assert schema_diff(url_at_0006) == []
        cl = schema.column_lineage
        with eng.connect() as conn:
            got = conn.execute(
                sa.select(
                    cl.c.output_dataset_uuid, cl.c.output_column, cl.c.dataset_version, cl.c.kind
                )
            ).all()
    finally:
        eng.dispose()
    assert sorted(got, key=str) == sorted(
        [
            (ids["agg"], "total", pointed, "DIRECT"),
            (ids["agg"], "*", pointed, "INDIRECT"),
            (ids["alerts"], "value", newer, "DIRECT"),
        ],
        key=str,
    )


async def test_the_cli_shows_kinds_and_reads_an_asked_version(
    repo: SqlRepository, clock: ManualClock
) -> None:
    await chain(repo, clock)
    new, _ = await _record_building_alerts(repo, clock)

    def args(*extra: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        (command,) = LINEAGE_COMMANDS
        command.arguments(parser)
        return parser.parse_args(["alerts", "--org", "acme", "--direction", "up", *extra])

    current = "\n".join(await lineage_lines(repo, args("--depth", "1")))
    asked = "\n".join(
        await lineage_lines(repo, args("--depth", "1", "--dataset-version", str(new)))
    )
    assert "alerts.value  range_aggregates.tx_count      TRANSFORMATION" in current
    assert "level" not in current
    assert "alerts.level  range_aggregates.failed_count  IDENTITY" in asked
    assert "alerts.value" not in asked
    with pytest.raises(SystemExit):
        args("--dataset-version", "not-a-version")
