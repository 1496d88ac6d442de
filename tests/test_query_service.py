"""The Query Service (``POST /v1/task/query``) on Spark, on both engines.

A DAG whose source ``follow`` writes three Parquet datasets (``blocks``,
``txs``, ``secret``) and a buffered Postgres table (``alerts``), and a
reactive ``join`` reading ``blocks`` (filtered ``number > 10``), ``txs`` and
``alerts`` (filtered by severity and value). The tests write the Parquet
objects under the lite object store root at the datasets' locations, publish
alerts as ``follow`` through the real buffer and sink into the data database
(a SQLite file, or the test's Postgres database), then query as ``join``'s
attempt: its token attaches ``blocks``, ``txs`` and ``alerts``. ``secret``
holds a marker that no answer may ever contain, whatever the query tries;
so do the alert rows of another org written into the same table.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa

from tests.api_fixtures import AUTH, TOKEN
from tests.capability_fixtures import HEADER, Kit, make_kit
from trace_core.api import create_app
from trace_core.api.query import dataset_views
from trace_core.authoring.operators import OperatorRegistry, OperatorSpec
from trace_core.clock import ManualClock
from trace_core.dag import DeployResult, parse_dag
from trace_core.dispatcher.service import Dispatcher
from trace_core.errors import ConfigurationError, DatabaseUnavailable, InvalidInput
from trace_core.security.claims import DatasetInput
from trace_core.storage import schema
from trace_core.storage.sql import SqlRepository
from trace_lite.buffered import BufferSink, DataDatabase, SqlDatasetBuffer, table_name_of
from trace_lite.pipeline.operators import ALERT_SCHEMA
from trace_lite.pipeline.predicate import parse_where
from trace_lite.query_service import SparkQueryService, _check_analyzed
from trace_lite.query_tables import TableViews, _Column, _column, _kind, _pushdown
from trace_lite.spark import SparkConfig, SparkSessionProvider

pytestmark = pytest.mark.anyio

BASE = "http://trace.test"
SECRET = "TOP-SECRET-7f3a"
LEASE_EXPIRY = 61.0
BACKOFF = 120.0

QUERY_DAG = """
dag: q
jobs:
  - name: follow
    activation: source
    runtime: ecs_udf
    operator: follow
    source: { kind: manual }
    heartbeat_timeout_seconds: 60
    outputs:
      - { dataset: blocks }
      - { dataset: txs }
      - { dataset: secret }
      - { dataset: alerts, kind: postgres_table }
  - name: join
    activation: reactive
    runtime: ecs_udf
    operator: join
    execution_strategy: PerUpdate
    heartbeat_timeout_seconds: 60
    inputs:
      - from: { dataset: blocks }
        where: "number > 10"
      - from: { dataset: txs }
      - from: { dataset: alerts }
        where: "severity IN ('warning', 'critical') AND value > 1.5"
    outputs:
      - { dataset: joined }
"""


def _not_in_process(ctx: Any) -> None:
    raise AssertionError("ecs_udf tasks are run by the test, not in-process")


OPERATORS = OperatorRegistry(
    [OperatorSpec("follow", _not_in_process, source=True), OperatorSpec("join", _not_in_process)]
)

BLOCKS = pa.table({"number": [5, 11, 12, 20], "hash": ["h5", "h11", "h12", "h20"]})
TXS = pa.table(
    {
        "block_number": [5, 11, 11, 20],
        "value": [1, 2, 3, 4],
        "ratio": [0.5, float("nan"), float("inf"), None],
    }
)


@dataclass
class Attempt:
    task_id: uuid.UUID
    attempt: int
    lease_token: str
    token: str
    task: dict[str, Any]


def alert(key: str, severity: str, value: float | None, **extra: Any) -> dict[str, Any]:
    """An alert record as ``alert_evaluate`` publishes it."""
    return {
        "dedupe_key": key,
        "rule": "busy_block",
        "severity": severity,
        "block_number": 11,
        "metric": "tx_count",
        "value": value,
        "threshold": 1.5,
        "partition_key": "0-99",
        **extra,
    }


# The join's filter keeps warning and critical alerts with a value above 1.5.
ALERTS = [
    alert("a1", "warning", 2.0),
    alert("a2", "critical", 5.0, block_number=20),
    alert("a3", "info", 9.0),  # dropped by the filter's term run in SQL
    alert("a4", "warning", 1.0),  # dropped by the term Spark runs (a float column)
    alert("a5", "critical", None),
]


@dataclass
class QueryWorld:
    dispatcher: Dispatcher
    deployed: DeployResult
    kit: Kit
    app: Any
    client: httpx.AsyncClient
    root: Path
    locations: dict[str, str]
    """Dataset name -> its location."""
    follow: Attempt
    join: Attempt
    data: DataDatabase | None

    def dataset(self, name: str) -> uuid.UUID:
        return self.deployed.datasets[name].dataset_uuid

    def path(self, name: str) -> Path:
        return _local(self.root, self.locations[name])

    async def query(
        self, sql: str, attempt: Attempt | None = None, token: str | None = None, **extra: Any
    ) -> httpx.Response:
        who = attempt or self.join
        body = {"task_id": str(who.task_id), "attempt": who.attempt, "sql": sql, **extra}
        return await self.client.post(
            "/v1/task/query", json=body, headers={HEADER: token or who.token}
        )

    async def rows(self, sql: str, **extra: Any) -> list[list[Any]]:
        response = await self.query(sql, **extra)
        assert response.status_code == 200, response.text
        rows: list[list[Any]] = response.json()["rows"]
        return rows

    async def claim(self, task_id: uuid.UUID, worker: str = "worker-1") -> Attempt:
        return await _claim(self.client, task_id, worker)

    async def publish_alerts(self, records: list[dict[str, Any]]) -> None:
        """Publish as ``follow`` through the buffer, then drain it with the sink."""
        assert self.data is not None
        clock = self.kit.clock
        await SqlDatasetBuffer(self.data, clock=clock).publish(
            self.dataset("alerts"),
            records,
            producer_task_id=self.follow.task_id,
            attempt=self.follow.attempt,
            schema_hash=ALERT_SCHEMA.schema_hash,
        )
        sink = BufferSink(
            self.data,
            self.dispatcher.repo,
            [ALERT_SCHEMA],
            gateway=self.dispatcher.gateway,
            clock=clock,
        )
        report = await sink.run_once()
        assert report.dead == 0 and report.rows_written == len(records), report

    async def write_other_org_alerts(self, org: uuid.UUID, records: list[dict[str, Any]]) -> None:
        """Rows of another org in the same table (the sink never lets one org's
        producer write them: this stands for a table two orgs share)."""
        assert self.data is not None
        table = ALERT_SCHEMA.table(table_name_of(self.locations["alerts"]))
        now = self.kit.clock.now()
        async with self.data.engine.begin() as conn:
            await self.data.ensure_table(conn, table)
            await conn.execute(
                self.data.insert_ignoring_duplicates(table),
                [{**record, "org_id": str(org), "created_at": now} for record in records],
            )

    async def reclaim(self, claimed: Attempt) -> Attempt:
        clock = self.kit.clock
        clock.advance(LEASE_EXPIRY)
        await self.dispatcher.reaper.run_once()
        clock.advance(BACKOFF)
        await self.dispatcher.retries.run_once()
        second = await self.claim(claimed.task_id, "worker-2")
        assert second.attempt == claimed.attempt + 1
        return second


async def _claim(client: httpx.AsyncClient, task_id: uuid.UUID, worker: str) -> Attempt:
    response = await client.post(
        "/internal/task-claim", json={"task_id": str(task_id), "worker_id": worker}, headers=AUTH
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "Claimed", body
    task = body["task"]
    return Attempt(task_id, body["attempt"], body["lease_token"], task["capability_token"], task)


def _local(root: Path, location: str) -> Path:
    bucket, _, key = location.removeprefix("s3://").partition("/")
    return root / bucket / key


def _write(path: Path, table: pa.Table, name: str = "part-0.parquet") -> None:
    path.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path / name)


@pytest.fixture
async def data(repo: SqlRepository, tmp_path: Path, engine: str) -> AsyncIterator[DataDatabase]:
    """The data database: a SQLite file, or the test's Postgres database."""
    url = (
        f"sqlite:///{tmp_path / 'data.db'}"
        if engine == "sqlite"
        else repo.url.sync_url.render_as_string(hide_password=False)
    )
    database = DataDatabase(url)
    await database.open()
    try:
        yield database
    finally:
        await database.close()


@pytest.fixture
def service(
    spark_provider: SparkSessionProvider, tmp_path: Path, data: DataDatabase, repo: SqlRepository
) -> SparkQueryService:
    return SparkQueryService(
        spark_provider, tmp_path / "objects", data=data, state=repo, timeout_seconds=300
    )


@asynccontextmanager
async def open_world(
    repo: SqlRepository,
    clock: ManualClock,
    service: SparkQueryService,
    root: Path,
    data: DataDatabase | None = None,
) -> AsyncIterator[QueryWorld]:
    """The DAG deployed, the Parquet objects written, ``join`` claimed."""
    kit = make_kit(clock)
    dispatcher = Dispatcher(repo, operators=OPERATORS, clock=clock, capabilities=kit.issuer(repo))
    deployed = await dispatcher.deploy(parse_dag(QUERY_DAG, operators=OPERATORS.names()))
    app = create_app(
        dispatcher,
        internal_token=TOKEN,
        jwks=kit.ring.jwks,
        verifier=kit.verifier,
        minter=kit.minter,
        buffer=kit.buffer,
        query=service,
    )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE) as client:
        trigger = await client.post(
            "/internal/trigger", json={"job": "q/follow", "key": "run-1"}, headers=AUTH
        )
        assert trigger.status_code == 200, trigger.text
        follow = await _claim(client, uuid.UUID(trigger.json()["task_id"]), "worker-1")
        locations = {o["dataset"]: o["location"] for o in follow.task["outputs"]}
        for name, table in (
            ("blocks", BLOCKS),
            ("txs", TXS),
            ("secret", pa.table({"number": [99], "value": [SECRET]})),
        ):
            _write(_local(root, locations[name]), table)
        blocks = deployed.datasets["blocks"]
        event = {
            "dataset_uuid": str(blocks.dataset_uuid),
            "dataset_version": str(blocks.dataset_version),
            "cursor": 20,
        }
        emitted = await client.post(
            "/v1/task/events",
            json={"task_id": str(follow.task_id), "attempt": 1, "events": [event]},
            headers={HEADER: follow.token},
        )
        assert emitted.status_code == 200, emitted.text
        await dispatcher.run_once()
        t = schema.tasks
        async with repo.read() as tx:
            join_id = (
                await tx.connection.execute(
                    sa.select(t.c.id).where(t.c.job_id == deployed.jobs["join"])
                )
            ).scalar_one()
        join = await _claim(client, join_id, "worker-1")
        yield QueryWorld(
            dispatcher, deployed, kit, app, client, root, locations, follow, join, data
        )


@pytest.fixture
async def world(
    repo: SqlRepository,
    clock: ManualClock,
    service: SparkQueryService,
    tmp_path: Path,
    data: DataDatabase,
) -> AsyncIterator[QueryWorld]:
    async with open_world(repo, clock, service, tmp_path / "objects", data) as opened:
        yield opened


@pytest.fixture
def leak(spark_provider: SparkSessionProvider) -> Iterator[str]:
    """A global temporary view of the shared session holding the marker."""
    spark = spark_provider.get()
    spark.createDataFrame([(SECRET,)], ["v"]).createOrReplaceGlobalTempView("leak")
    try:
        yield "global_temp.leak"
    finally:
        spark.catalog.dropGlobalTempView("leak")


def _refused(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    assert body["field"] == "sql", body
    assert SECRET not in response.text
    return body


# --- reading the token's datasets ---------------------------------------------------------


async def test_a_task_joins_its_two_parquet_inputs(world: QueryWorld) -> None:
    response = await world.query(
        "SELECT b.number, count(t.value) AS n, sum(t.value) AS total "
        "FROM blocks b LEFT JOIN txs t ON t.block_number = b.number "
        "GROUP BY b.number ORDER BY b.number"
    )
    assert response.status_code == 200, response.text
    assert response.headers["cache-control"] == "no-store"
    assert response.json() == {
        "columns": [
            {"name": "number", "type": "bigint"},
            {"name": "n", "type": "bigint"},
            {"name": "total", "type": "bigint"},
        ],
        "rows": [[11, 2, 5], [12, 0, None], [20, 1, 4]],
        "truncated": False,
    }


async def test_every_view_name_of_an_input_reads_it(world: QueryWorld) -> None:
    blocks, txs = world.dataset("blocks"), world.dataset("txs")
    expected = [[11], [12], [20]]
    for name in ("blocks", "BLOCKS", "input_0", f"ds_{blocks.hex}", f"`ds_{blocks.hex}`"):
        assert await world.rows(f"SELECT number FROM {name} ORDER BY 1") == expected, name
    for name in ("txs", "input_1", f"DS_{txs.hex.upper()}"):
        assert await world.rows(f"SELECT count(*) FROM {name}") == [[4]], name
    # Plain query forms: TABLE, VALUES, WITH, pipe syntax, subqueries.
    assert len(await world.rows("TABLE blocks")) == 3
    assert await world.rows("VALUES (1, 'a')") == [[1, "a"]]
    assert await world.rows(
        "WITH big AS (SELECT * FROM blocks WHERE number > 11) SELECT count(*) FROM big"
    ) == [[2]]
    assert await world.rows("FROM blocks |> WHERE number = 12 |> SELECT hash") == [["h12"]]
    assert await world.rows(
        "SELECT hash FROM blocks WHERE number IN (SELECT block_number FROM txs) ORDER BY 1"
    ) == [["h11"], ["h20"]]


async def test_a_consumer_sees_only_the_rows_its_filter_keeps(world: QueryWorld) -> None:
    assert await world.rows("SELECT count(*), min(number) FROM blocks") == [[3, 11]]
    assert await world.rows("SELECT * FROM blocks WHERE number <= 10") == []
    assert await world.rows("SELECT * FROM input_0 WHERE number = 5") == []
    # A join through the unfiltered input does not bring the filtered rows back.
    assert await world.rows(
        "SELECT b.number FROM txs t LEFT JOIN blocks b ON b.number = t.block_number "
        "WHERE t.block_number = 5"
    ) == [[None]]


async def test_values_are_rendered_as_json(world: QueryWorld) -> None:
    response = await world.query(
        "SELECT ratio, 1.50BD AS d, X'0102' AS b, array(1, 2) AS a, map('k', 1) AS m, "
        "named_struct('x', 1) AS s, DATE'2024-01-02' AS dt, "
        "TIMESTAMP'2024-01-02 03:04:05' AS ts, 1 AS dup, 2 AS dup, "
        "'${env:HOME}' AS substituted "
        "FROM txs ORDER BY value"
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert [c["name"] for c in body["columns"]][-3:] == ["dup", "dup", "substituted"]
    first = body["rows"][0]
    assert first[:8] == [
        0.5,
        1.5,
        "AQI=",
        [1, 2],
        {"k": 1},
        {"x": 1},
        "2024-01-02",
        "2024-01-02T03:04:05.000Z",
    ]
    assert first[8:] == [1, 2, "${env:HOME}"]  # no variable substitution
    assert [row[0] for row in body["rows"]] == [0.5, "NaN", "Infinity", None]


async def test_rows_are_limited_and_truncation_reported(world: QueryWorld) -> None:
    response = await world.query("SELECT * FROM txs ORDER BY value", limit=2)
    assert response.status_code == 200, response.text
    body = response.json()
    assert [row[1] for row in body["rows"]] == [1, 2] and body["truncated"] is True
    exact = (await world.query("SELECT * FROM txs", limit=4)).json()
    assert len(exact["rows"]) == 4 and exact["truncated"] is False
    default = (await world.query("SELECT explode(sequence(1, 1500))")).json()
    assert len(default["rows"]) == 1000 and default["truncated"] is True
    for limit in (0, 10_001, "5", 2.0, True):
        refused = await world.query("SELECT 1", limit=limit)
        assert refused.status_code == 400, (limit, refused.text)
        assert refused.json()["field"] == "limit"


async def test_an_input_without_parquet_objects_is_not_attachable(world: QueryWorld) -> None:
    assert await world.rows("SELECT count(*) FROM txs") == [[4]]
    for part in world.path("txs").iterdir():
        part.unlink()
    body = _refused(await world.query("SELECT * FROM txs"), 400)
    assert body["reason"] == "view txs cannot be attached: the dataset has no Parquet objects yet"
    # Queries not referencing it still work.
    assert await world.rows("SELECT count(*) FROM blocks") == [[3]]


# --- buffered Postgres-table inputs --------------------------------------------------------


async def test_a_task_queries_its_alert_rows_filtered(world: QueryWorld) -> None:
    await world.publish_alerts(ALERTS)
    response = await world.query("SELECT * FROM alerts ORDER BY dedupe_key")
    assert response.status_code == 200, response.text
    body = response.json()
    # Every column but org_id, typed; created_at is when the sink wrote the row.
    assert body["columns"] == [
        {"name": "dedupe_key", "type": "string"},
        {"name": "rule", "type": "string"},
        {"name": "severity", "type": "string"},
        {"name": "block_number", "type": "bigint"},
        {"name": "metric", "type": "string"},
        {"name": "value", "type": "double"},
        {"name": "threshold", "type": "double"},
        {"name": "partition_key", "type": "string"},
        {"name": "created_at", "type": "timestamp"},
    ]
    written = "2026-01-01T00:00:00.000Z"  # the ManualClock's time
    assert body["rows"] == [
        ["a1", "busy_block", "warning", 11, "tx_count", 2.0, 1.5, "0-99", written],
        ["a2", "busy_block", "critical", 20, "tx_count", 5.0, 1.5, "0-99", written],
    ]
    # Every view name of the input, and joins with the Parquet inputs.
    alerts = world.dataset("alerts")
    for name in ("input_2", f"ds_{alerts.hex}", "ALERTS"):
        assert await world.rows(f"SELECT count(*) FROM {name}") == [[2]], name
    assert await world.rows(
        "SELECT a.dedupe_key, b.hash FROM alerts a JOIN blocks b ON b.number = a.block_number "
        "ORDER BY 1"
    ) == [["a1", "h11"], ["a2", "h20"]]
    # The filtered rows are nowhere, whatever the query asks.
    assert await world.rows("SELECT * FROM alerts WHERE severity = 'info' OR value <= 1.5") == []
    # A later publish is seen by the next query (nothing is cached).
    await world.publish_alerts([alert("a6", "critical", 7.5)])
    assert await world.rows("SELECT dedupe_key FROM alerts ORDER BY 1") == [["a1"], ["a2"], ["a6"]]


async def test_an_org_never_sees_another_orgs_rows_in_the_same_table(world: QueryWorld) -> None:
    other = uuid.uuid4()
    await world.write_other_org_alerts(
        other,
        [
            alert("a1", "critical", 99.0, rule=SECRET),  # the same dedupe key as ours
            alert("b1", "warning", 99.0, rule=SECRET),
        ],
    )
    # The other org's rows alone: for us the dataset has no rows yet.
    body = _refused(await world.query("SELECT * FROM alerts"), 400)
    assert body["reason"] == "view alerts cannot be attached: the dataset has no rows yet"
    await world.publish_alerts(ALERTS)
    table = table_name_of(world.locations["alerts"])
    expected = [["a1", "busy_block"], ["a2", "busy_block"]]
    assert await world.rows("SELECT dedupe_key, rule FROM alerts ORDER BY 1") == expected
    by_id = f"ds_{world.dataset('alerts').hex}"
    union = (
        "SELECT dedupe_key, rule FROM alerts UNION {} SELECT dedupe_key, rule FROM {} ORDER BY 1"
    )
    assert await world.rows(union.format("", "input_2")) == expected
    assert await world.rows(union.format("ALL", by_id)) == [
        expected[0],
        expected[0],
        *expected[1:] * 2,
    ]
    assert await world.rows(f"SELECT count(*) FROM alerts WHERE rule = '{SECRET}'") == [[0]]
    # org_id is not a column of the view: no query can select or filter on it.
    for sql in (
        f"SELECT * FROM alerts WHERE org_id = '{other}'",
        f"SELECT * FROM alerts WHERE org_id = '{other}' OR 1 = 1",
        "SELECT org_id FROM alerts",
        "SELECT a.* FROM alerts a UNION SELECT a.* FROM alerts a WHERE a.org_id IS NOT NULL",
    ):
        assert "UNRESOLVED_COLUMN" in _refused(await world.query(sql), 400)["reason"], sql
    # Nor can it name the table, the buffer, or any other relation of the data database.
    for sql in (
        f"SELECT * FROM {table}",
        f"SELECT * FROM alerts UNION ALL SELECT * FROM {table}",
        "SELECT * FROM trace_buffer_batches",
        f"SELECT * FROM jdbc.`{table}`",
    ):
        assert _refused(await world.query(sql), 403)["error"] == "not_attached", sql


async def test_a_table_not_written_yet_or_all_filtered_out(world: QueryWorld) -> None:
    body = _refused(await world.query("SELECT * FROM alerts"), 400)
    assert body["reason"] == "view alerts cannot be attached: the dataset has no rows yet"
    assert await world.rows("SELECT count(*) FROM blocks") == [[3]]  # the others still work
    # Rows, none of which the filter keeps: an empty view with the table's columns.
    await world.publish_alerts([alert("i1", "info", 3.0), alert("w1", "warning", 0.5)])
    response = await world.query("SELECT dedupe_key, created_at FROM alerts")
    assert response.status_code == 200, response.text
    assert response.json()["rows"] == []
    assert response.json()["columns"][1] == {"name": "created_at", "type": "timestamp"}


async def test_a_table_past_the_row_limit_is_refused_never_truncated(
    world: QueryWorld, spark_provider: SparkSessionProvider, data: DataDatabase
) -> None:
    await world.publish_alerts(ALERTS)
    await world.write_other_org_alerts(
        uuid.uuid4(), [alert(f"o{i}", "warning", 2.0) for i in range(5)]
    )
    claims = await world.kit.verifier.verify(world.join.token)
    views = dataset_views(claims.inputs, {world.dataset("alerts"): "alerts"})

    def bounded(rows: int) -> SparkQueryService:
        return SparkQueryService(
            spark_provider, world.root, data=data, state=world.dispatcher.repo, max_table_rows=rows
        )

    # The filter's severity term runs in SQL: 4 of our 5 rows are loaded (all but
    # a3), then Spark drops a4 and a5. Other orgs' rows do not count.
    result = await bounded(4).query(claims, "SELECT count(*) FROM alerts", limit=1, views=views)
    assert result.rows == [[2]]
    with pytest.raises(InvalidInput) as refused:
        await bounded(3).query(claims, "SELECT count(*) FROM alerts", limit=1, views=views)
    assert refused.value.field == "sql"
    assert refused.value.reason == (
        "view alerts cannot be attached: more than 3 rows of the task's org would be loaded "
        "(the limit per attached table is 3 rows)"
    )
    # A query that does not read the table is not affected.
    assert (
        await bounded(3).query(claims, "SELECT count(*) FROM input_1", limit=1, views=views)
    ).rows == [[4]]


async def test_without_a_data_database_a_table_input_is_a_clear_400(
    world: QueryWorld, spark_provider: SparkSessionProvider
) -> None:
    await world.publish_alerts(ALERTS)
    plain = SparkQueryService(spark_provider, world.root)
    claims = await world.kit.verifier.verify(world.join.token)
    with pytest.raises(InvalidInput) as refused:
        await plain.query(claims, "SELECT * FROM input_2", limit=1)
    assert refused.value.reason == (
        "view input_2 cannot be attached: it is a Postgres-table dataset and this Query "
        "Service has no data database"
    )
    assert (await plain.query(claims, "SELECT count(*) FROM input_1", limit=1)).rows == [[4]]


async def test_a_data_database_that_is_down_is_unavailable_not_a_server_error(
    world: QueryWorld,
) -> None:
    views = TableViews("postgresql://trace@127.0.0.1:1/trace", world.dispatcher.repo)
    with pytest.raises(DatabaseUnavailable):
        views.read("postgres_table:alerts", "org", None, field="where", check=lambda: None)


def test_only_filter_terms_sql_evaluates_like_spark_are_pushed() -> None:
    from sqlalchemy.dialects.postgresql.base import PGDialect

    table = ALERT_SCHEMA.table("t")
    columns: dict[str, _Column] = {
        c.name: _column(table.c[c.name], _kind(c.name, c.type), postgres=True)
        for c in table.columns
        if c.name not in ("org_id", "created_at")  # created_at: a TypeDecorator, not reflected
    }
    predicate = parse_where(
        "severity IN ('warning') AND value > 1.5 AND NOT (block_number BETWEEN 1 AND 5) "
        "AND (rule = 'x' OR value > 1) AND dedupe_key IS NOT NULL AND block_number > 1.5"
    )
    dialect = PGDialect()  # type: ignore[no-untyped-call]
    pushed = [
        str(term.compile(dialect=dialect, compile_kwargs={"literal_binds": True}))
        for term in _pushdown(predicate, columns)
    ]
    assert pushed == [
        "(t.severity COLLATE \"C\") IN ('warning')",
        "t.block_number NOT BETWEEN 1 AND 5",
        "t.dedupe_key IS NOT NULL",
    ]


# --- failing closed ------------------------------------------------------------------------


async def test_another_dataset_is_unreachable_by_any_name_or_path(
    world: QueryWorld, leak: str
) -> None:
    secret = world.dataset("secret")
    secret_dir = world.path("secret")
    secret_file = secret_dir / "part-0.parquet"
    attempts = [
        "SELECT * FROM secret",
        f"SELECT * FROM ds_{secret.hex}",
        f"SELECT * FROM blocks JOIN ds_{secret.hex} USING (number)",
        f"SELECT * FROM blocks WHERE number IN (SELECT number FROM ds_{secret.hex})",
        f"WITH x AS (SELECT * FROM ds_{secret.hex}) SELECT * FROM x",
        f"SELECT * FROM parquet.`{secret_dir}`",
        f"SELECT * FROM parquet.`{secret_file}`",
        f"SELECT * FROM parquet.`file://{secret_file}`",
        f"SELECT * FROM `parquet`.`{secret_dir}/*`",
        "SELECT * FROM text.`/etc/passwd`",
        "SELECT * FROM csv.`/etc/hostname`",
        f"SELECT * FROM json.`{world.root}`",
        "SELECT * FROM default.secret",
        "SELECT * FROM spark_catalog.default.secret",
        "SELECT * FROM global_temp.leak",
        "SELECT * FROM IDENTIFIER('global_temp.leak')",
        f"SELECT * FROM IDENTIFIER('ds_{secret.hex}')",
        "SELECT * FROM nosuch",
    ]
    for sql in attempts:
        body = _refused(await world.query(sql), 403)
        assert body["error"] == "not_attached", (sql, body)
        assert str(world.root) not in body["reason"], (sql, body)
    # The same answer whether or not the named dataset exists.
    absent = uuid.uuid4()
    existing = (await world.query(f"SELECT * FROM ds_{secret.hex}")).json()
    missing = (await world.query(f"SELECT * FROM ds_{absent.hex}")).json()
    assert existing == {
        **missing,
        "reason": missing["reason"].replace(absent.hex, secret.hex),
    }


async def test_table_functions_file_functions_and_reflection_fail(world: QueryWorld) -> None:
    secret_file = world.path("secret") / "part-0.parquet"
    attempts = [
        f"SELECT * FROM read_files('{secret_file}')",
        "SELECT * FROM range(10)",
        "SELECT * FROM explode(array(1))",
        "SELECT reflect('java.lang.System', 'getenv', 'HOME')",
        "SELECT java_method('java.lang.System', 'getProperty', 'user.dir')",
        "SELECT try_reflect('java.lang.System', 'exit', 1)",
        "SELECT IDENTIFIER('refl' || 'ect')('java.lang.System', 'getenv', 'HOME')",
        "SELECT system.builtin.reflect('java.lang.System', 'getenv', 'HOME')",
        "SELECT * FROM VALUES (reflect('java.lang.System', 'getenv', 'HOME'))",
        "SELECT input_file_name() FROM blocks",
        "SELECT input_file_block_start() FROM blocks",
        "SELECT _metadata FROM blocks",
        "SELECT _metadata.file_path FROM blocks",
        f"SELECT from_protobuf(X'00', 'M', '{secret_file}')",
        "SELECT nosuch_function(1)",
        "SELECT * FROM blocks LATERAL VIEW nosuch_udtf(array(1)) t AS x",
        "SELECT TRANSFORM(number) USING 'cat /etc/passwd' FROM blocks",
        "SELECT * FROM blocks VERSION AS OF 1",
        "SELECT * FROM STREAM blocks",
    ]
    for sql in attempts:
        response = await world.query(sql)
        assert response.status_code in (400, 403), (sql, response.text)
        assert response.json()["field"] == "sql", sql
        assert SECRET not in response.text and str(world.root) not in response.text, sql
        assert str(Path.home()) not in response.text, (sql, response.text)  # no getenv
        assert "root:x:0:0" not in response.text, sql


async def test_only_a_single_read_only_query_runs(world: QueryWorld) -> None:
    statements = [
        "DROP VIEW blocks",
        "CREATE TEMP VIEW v AS SELECT * FROM blocks",
        "CREATE TABLE t AS SELECT 1",
        "INSERT INTO blocks VALUES (1, 'x')",
        "INSERT OVERWRITE DIRECTORY '/tmp/q' SELECT * FROM blocks",
        "DELETE FROM blocks",
        "UPDATE blocks SET number = 1",
        "SET spark.sql.runSQLOnFiles=true",
        "RESET",
        "CACHE TABLE blocks",
        "EXPLAIN SELECT * FROM blocks",
        "DESCRIBE blocks",
        "SHOW TABLES",
        "ADD JAR /tmp/x.jar",
        "EXECUTE IMMEDIATE 'SELECT 1'",
        "DECLARE VARIABLE v INT",
        "USE global_temp",
        "SELECT 1; SELECT 2",
        "SELECT 1; DROP VIEW blocks",
        "SET spark.sql.runSQLOnFiles=true; SELECT * FROM parquet.`/tmp`",
        "BEGIN SELECT 1; END",
    ]
    for sql in statements:
        body = _refused(await world.query(sql), 400)
        assert body["error"] == "invalid_request", (sql, body)
    # Nothing changed: the views still read the same rows.
    assert await world.rows("SELECT count(*) FROM blocks") == [[3]]


async def test_bad_sql_is_a_400_naming_sql(world: QueryWorld) -> None:
    cases = {
        "SELEC 1": "PARSE_SYNTAX_ERROR",
        "SELECT nosuch FROM blocks": "UNRESOLVED_COLUMN",
        "SELECT 1/0": "DIVIDE_BY_ZERO",
        "SELECT CAST(hash AS INT) FROM blocks": "CAST_INVALID_INPUT",
        "SELECT " + "(" * 5000 + "1" + ")" * 5000: "",
    }
    for sql, condition in cases.items():
        body = _refused(await world.query(sql), 400)
        assert body["error"] == "invalid_request" and condition in body["reason"], body
        assert "JVM stacktrace" not in body["reason"]
        assert "SubqueryAlias" not in body["reason"]  # no analyzed plan in messages
        assert str(world.root) not in body["reason"]
    for sql in ("", "   ", "SELECT '\x00'"):
        response = await world.query(sql)
        assert response.status_code == 400 and response.json()["field"] == "sql", sql


async def test_a_name_defined_by_an_inner_with_cannot_reach_the_catalog(
    world: QueryWorld, spark_provider: SparkSessionProvider
) -> None:
    # A WITH name is a legitimate reference (layer 1), but referenced outside
    # its scope it resolves to the catalog: the analyzed plan check refuses it.
    spark = spark_provider.get()
    view = f"q_leak_{uuid.uuid4().hex[:8]}"
    spark.sql(f"CREATE OR REPLACE VIEW default.{view} AS SELECT '{SECRET}' AS v")
    try:
        assert (await world.query(f"SELECT * FROM {view}")).status_code == 403
        body = _refused(
            await world.query(
                f"SELECT * FROM (WITH {view} AS (SELECT 1 AS v) SELECT * FROM {view}) x, {view}"
            ),
            403,
        )
        assert body["error"] == "not_attached"
    finally:
        spark.sql(f"DROP VIEW IF EXISTS default.{view}")


def test_the_analyzed_plan_check_refuses_what_the_first_layer_would_miss(
    spark_provider: SparkSessionProvider, leak: str
) -> None:
    # Layer 3 alone, on plans layer 1 never lets through.
    session = spark_provider.get().newSession()
    session.createDataFrame([(1,)], ["n"]).createOrReplaceTempView("mine")
    for sql, attached in [
        ("SELECT * FROM global_temp.leak", {"leak"}),
        ("SELECT * FROM mine", set()),
        ("SELECT * FROM mine WHERE n IN (SELECT 1 FROM global_temp.leak)", {"mine"}),
        ("SELECT * FROM range(3)", set()),
    ]:
        plan = session.sql(sql)._jdf.queryExecution().analyzed()
        with pytest.raises(Exception, match="not one of the task's datasets"):
            _check_analyzed(plan, attached)
    _check_analyzed(session.sql("SELECT * FROM mine")._jdf.queryExecution().analyzed(), {"mine"})
    # A view of rows read into Arrow (a Postgres-table input) is accepted when
    # attached, refused otherwise, like a view of Parquet objects.
    session.createDataFrame(pa.table({"n": [1]})).createOrReplaceTempView("rows")
    plan = session.sql("SELECT * FROM rows JOIN mine USING (n)")._jdf.queryExecution().analyzed()
    _check_analyzed(plan, {"rows", "mine"})
    with pytest.raises(Exception, match="not one of the task's datasets"):
        _check_analyzed(plan, {"mine"})


# --- the token ---------------------------------------------------------------------------------


async def test_a_superseded_or_finished_attempt_cannot_query(world: QueryWorld) -> None:
    first = world.join
    second = await world.reclaim(first)
    stale = await world.query("SELECT count(*) FROM blocks", attempt=first)
    assert stale.status_code == 401 and stale.json()["reason"] == "superseded", stale.text
    borrowed = await world.query("SELECT count(*) FROM blocks", attempt=second, token=first.token)
    assert borrowed.status_code == 401 and borrowed.json()["reason"] == "wrong_task"
    assert await world.rows("SELECT count(*) FROM blocks", attempt=second) == [[3]]
    done = await world.client.post(
        "/v1/task/complete",
        json={
            "task_id": str(second.task_id),
            "attempt": second.attempt,
            "lease_token": second.lease_token,
            "status": "Completed",
            "outputs": [{"output_index": 0}],
        },
        headers={HEADER: second.token},
    )
    assert done.status_code == 200, done.text
    finished = await world.query("SELECT count(*) FROM blocks", attempt=second)
    assert finished.status_code == 409 and finished.json()["error"] == "not_running"


async def test_another_tasks_token_or_none_is_refused(world: QueryWorld) -> None:
    trigger = await world.client.post(
        "/internal/trigger", json={"job": "q/follow", "key": "run-2"}, headers=AUTH
    )
    other = await world.claim(uuid.UUID(trigger.json()["task_id"]))
    response = await world.query("SELECT * FROM blocks", token=other.token)
    assert response.status_code == 401 and response.json()["reason"] == "wrong_task"
    anonymous = await world.client.post(
        "/v1/task/query",
        json={"task_id": str(world.join.task_id), "attempt": 1, "sql": "SELECT 1"},
    )
    assert anonymous.status_code == 401 and anonymous.json()["reason"] == "missing"
    # The source's own token has no inputs: it can attach nothing.
    body = (await world.query("SELECT * FROM blocks", attempt=other)).json()
    assert body["error"] == "not_attached"


# --- the service on its own ---------------------------------------------------------------------


async def test_a_query_running_too_long_is_cancelled(
    world: QueryWorld, spark_provider: SparkSessionProvider, tmp_path: Path
) -> None:
    quick = SparkQueryService(spark_provider, tmp_path / "objects", timeout_seconds=2)
    claims = await world.kit.verifier.verify(world.join.token)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(0.05)
            ticks += 1

    started = time.monotonic()
    async with anyio.create_task_group() as group:
        group.start_soon(tick)
        with pytest.raises(InvalidInput, match="longer than 2 s"):
            # The shuffle (DISTRIBUTE BY) makes every streamed row pass a
            # kill check. Without it the whole cross join is one generated loop
            # that never polls its task's kill flag: Spark drops the cancelled
            # job at once but its task runs on, holding an executor slot for
            # minutes (under C1) and stalling the next Spark test.
            await quick.query(
                claims,
                "SELECT count(*) FROM (SELECT explode(sequence(1, 100000)) a DISTRIBUTE BY a) "
                "CROSS JOIN (SELECT explode(sequence(1, 100000)) b)",
                limit=1,
            )
        group.cancel_scope.cancel()
    assert time.monotonic() - started < 10
    assert ticks >= 20  # the event loop was not blocked while Spark ran
    tracker = spark_provider.get().sparkContext.statusTracker()

    def busy() -> str:
        """What of the cancelled query still runs ("" once nothing does)."""
        running = sum(info.numRunningTasks for info in tracker.getExecutorInfos())
        jobs = list(tracker.getActiveJobsIds())
        return f"active jobs {jobs}, running tasks {running}" if jobs or running else ""

    # The interrupted jobs and their tasks end within seconds, but a loaded
    # 2-core CI machine once took over 20 s; a task that never polls its kill
    # flag runs for many minutes, so a minute still tells the two apart.
    for _ in range(300):  # every 0.2 s, a minute
        left = busy()
        if not left:
            break
        await anyio.sleep(0.2)
    assert not left, left
    assert (await world.rows("SELECT count(*) FROM txs")) == [[4]]


async def test_rendered_rows_are_capped_in_bytes(
    world: QueryWorld, spark_provider: SparkSessionProvider
) -> None:
    small = SparkQueryService(spark_provider, world.root, max_result_bytes=1024)
    claims = await world.kit.verifier.verify(world.join.token)
    result = await small.query(claims, "SELECT repeat('x', 600) FROM input_1", limit=10)
    assert len(result.rows) == 1 and result.truncated


def test_the_service_refuses_spark_connect_and_glob_roots(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="Spark Connect"):
        SparkQueryService(SparkSessionProvider(SparkConfig(remote="sc://x:1")), tmp_path)
    with pytest.raises(ConfigurationError, match="glob"):
        SparkQueryService(SparkSessionProvider(), tmp_path / "a[b]")


def test_view_names_are_unambiguous() -> None:
    a, b, c = (uuid.uuid4() for _ in range(3))
    v = uuid.uuid4()

    def item(dataset: uuid.UUID, where: str | None = None) -> DatasetInput:
        return DatasetInput(dataset, v, f"s3://bkt/d/{dataset}/", where)

    inputs = [item(a), item(b, "x > 1"), item(b, "x < 0"), item(c)]
    names = {a: "Blocks", b: "twice", c: "input_7"}
    views = dataset_views(inputs, names)
    assert views == {
        "input_0": inputs[0],
        "input_1": inputs[1],
        "input_2": inputs[2],
        "input_3": inputs[3],
        f"ds_{a.hex}": inputs[0],
        f"ds_{c.hex}": inputs[3],
        "blocks": inputs[0],  # a dataset read twice, or a reserved name: no alias
    }
    clash = dataset_views([item(a), item(c)], {a: "same", c: "SAME"})
    assert "same" not in clash
    assert "a-b" not in dataset_views([item(a)], {a: "a-b"})


# --- fuzzing the route ----------------------------------------------------------------------

FUZZ_SQL = [
    "SELECT * FROM blocks",
    "SELECT count(*) FROM txs",
    "SELECT * FROM secret",
    "SELECT 1/0",
    "DROP VIEW blocks",
    "SELECT * FROM parquet.`/etc`",
    "SELECT reflect('java.lang.System', 'getenv', 'HOME')",
]


async def _open_repo(database_url: str) -> SqlRepository:
    return SqlRepository(database_url)


@pytest.mark.parametrize("engine", ["sqlite"])
def test_fuzzing_the_query_route_never_answers_a_server_error(
    database_url: str, spark_provider: SparkSessionProvider, tmp_path: Path
) -> None:
    """Schemathesis on ``/v1/task/query`` (tests/test_api_fuzz.py fuzzes an app
    without a query service): positive and negative cases, with the join
    attempt's token and body most of the time and an interesting query a
    third of the time; no 5xx, and every answer as documented."""
    import schemathesis
    from anyio.from_thread import start_blocking_portal
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.core.result import Ok
    from schemathesis.specs.openapi.checks import response_schema_conformance

    with start_blocking_portal() as portal:
        repo = portal.call(_open_repo, database_url)
        try:
            service = SparkQueryService(spark_provider, tmp_path / "objects")
            opened = open_world(repo, ManualClock(), service, tmp_path / "objects")
            with portal.wrap_async_context_manager(opened) as world:
                schema = schemathesis.openapi.from_asgi("/openapi.json", world.app)
                operations = []
                for result in schema.get_all_operations():
                    assert isinstance(result, Ok), result  # the document itself is valid
                    operations.append(result.ok())
                [operation] = [op for op in operations if op.path == "/v1/task/query"]
                join = world.join

                for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

                    @settings(
                        max_examples=25,
                        deadline=None,
                        database=None,
                        suppress_health_check=list(HealthCheck),
                    )
                    @given(case=operation.as_strategy(generation_mode=mode), data=st.data())
                    def run(case: Any, data: st.DataObject) -> None:
                        headers = {HEADER: join.token}
                        # Hypothesis leans to small draws: 0 is the usual case here.
                        if data.draw(st.integers(0, 4)) == 4:
                            headers = {HEADER: data.draw(st.sampled_from(["", "x.y.z"]))}
                        if isinstance(case.body, dict) and data.draw(st.integers(0, 3)) != 3:
                            case.body["task_id"] = str(join.task_id)
                            case.body["attempt"] = join.attempt
                            if data.draw(st.integers(0, 2)) == 0:
                                case.body["sql"] = data.draw(st.sampled_from(FUZZ_SQL))
                        request = case.as_transport_kwargs(base_url=BASE, headers=headers)
                        content: bytes | None = None
                        if "json" in request:
                            content = json.dumps(request["json"]).encode()
                        elif request.get("data") is not None:
                            raw = request["data"]
                            content = raw.encode() if isinstance(raw, str) else bytes(raw)
                        response = portal.call(
                            partial(
                                world.client.request,
                                request["method"],
                                request["url"],
                                headers=request.get("headers"),
                                content=content,
                            )
                        )
                        assert SECRET not in response.text
                        case.validate_response(
                            response,
                            checks=[not_a_server_error, response_schema_conformance],
                            headers=headers,
                        )

                    run()
        finally:
            portal.call(repo.close)
