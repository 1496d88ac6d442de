"""People's queries through the Query Service on Spark, on both engines.

``GET /v1/datasets/{name}/rows`` and ``POST /v1/query`` attach only the
datasets the caller may see (their live versions' Parquet objects): a
reference to anything else — a hidden dataset, another org's, a path, a
qualified name — is refused, by name with the very answer of a dataset that
does not exist, whatever the query's shape (joins, ``UNION``, subqueries,
``WITH``, quoted names).
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.capability_fixtures import make_kit
from tests.test_people_data import World, world_of
from tests.test_people_isolation import CHAIN, ROLES, SETS
from tests.test_query_service import alert, data  # noqa: F401 (the data database fixture)
from trace_core.clock import ManualClock
from trace_core.dag import parse_dag
from trace_core.people import PlatformRole
from trace_core.storage.sql import SqlRepository
from trace_lite.buffered import DataDatabase, table_name_of
from trace_lite.pipeline.operators import ALERT_SCHEMA
from trace_lite.query_service import SparkQueryService
from trace_lite.spark import SparkSessionProvider

pytestmark = pytest.mark.anyio

HIDDEN = "set2"
"""Readable by members of r0 only (and admins)."""
_RUNS = itertools.count()


async def _org(world: World, slug: str, root: Path, marker: str) -> dict[str, Path]:
    """``CHAIN`` deployed in ``slug``, each dataset's live version holding rows
    ``(k, marker)`` and ``(k + 10, marker)``; the datasets' object folders."""
    from tests.api_fixtures import OPERATORS

    await world.dispatcher.deploy(parse_dag(CHAIN, operators=OPERATORS.names()), org_slug=slug)
    admin = await world.operator(slug)
    for role in ROLES:
        await world.service.create_role(admin, role, None)
    await world.service.set_read_roles(admin, HIDDEN, ["r0"])
    async with world.repo.read() as tx:
        found = await tx.catalog.datasets(admin.org_id)
    folders = {}
    for dataset in found:
        assert dataset.location is not None
        bucket, _, key = dataset.location.removeprefix("s3://").partition("/")
        folder = root / bucket / key
        folder.mkdir(parents=True, exist_ok=True)
        k = int(dataset.name.removeprefix("set"))
        table = pa.table({"v": [k, k + 10], "who": [marker, marker]})
        pq.write_table(table, folder / "part-0.parquet")
        folders[dataset.name] = folder
    return folders


@pytest.fixture
async def world(
    repo: SqlRepository, clock: ManualClock, spark_provider: SparkSessionProvider, tmp_path: Path
) -> AsyncIterator[tuple[World, dict[str, Path], dict[str, Path], str]]:
    """An app with the query service; orgs ``a-…`` and ``b-…`` (the same DAG);
    a reader of ``a-…`` who is in no role (so ``set2`` is hidden from them)."""
    root = tmp_path / "objects"
    service = SparkQueryService(spark_provider, root, timeout_seconds=300)
    kit = make_kit(clock)
    async with world_of(repo, clock, query=service, verifier=kit.verifier) as w:
        run = f"{next(_RUNS)}-{uuid.uuid4().hex[:6]}"
        a = await _org(w, f"a-{run}", root, "mine")
        b = await _org(w, f"b-{run}", root, "THEIRS")
        reader = f"reader-{run}"
        await w.user(reader, "reader", f"a-{run}")
        yield w, a, b, reader


async def _query(w: World, sub: str, sql: str, limit: int = 100) -> httpx.Response:
    return await w.post(sub, "/v1/query", {"sql": sql, "limit": limit})


def _like(response: httpx.Response, missing: httpx.Response) -> None:
    assert response.status_code == 404 == missing.status_code, response.text
    assert response.json() == missing.json()


async def test_a_visible_datasets_rows_are_bounded_and_a_hidden_one_is_missing(
    world: tuple[World, dict[str, Path], dict[str, Path], str],
) -> None:
    w, _, _, reader = world
    rows = await w.get(reader, "/v1/datasets/set0/rows", limit=1)
    assert rows.status_code == 200, rows.text
    body = rows.json()
    assert body["columns"] == [{"name": "v", "type": "bigint"}, {"name": "who", "type": "string"}]
    assert body["rows"] in ([[0, "mine"]], [[10, "mine"]]) and body["truncated"] is True
    assert rows.headers["Cache-Control"] == "no-store"
    every = (await w.get(reader, "/v1/datasets/set1/rows")).json()
    assert sorted(every["rows"]) == [[1, "mine"], [11, "mine"]] and every["truncated"] is False
    for bad in (0, -1, 10_001, "x"):
        refused = await w.get(reader, "/v1/datasets/set0/rows", limit=bad)
        assert refused.status_code == 400, (bad, refused.text)
        assert refused.json()["error"] == "invalid_request" and "limit" in refused.json()["field"]
    hidden = await w.get(reader, f"/v1/datasets/{HIDDEN}/rows")
    missing = await w.get(reader, "/v1/datasets/nosuch/rows")
    assert hidden.status_code == 404
    assert (
        hidden.json()
        == httpx.Response(404, content=missing.text.replace("nosuch", HIDDEN).encode()).json()
    )
    bad_limit = await _query(w, reader, "SELECT 1", limit=0)
    assert bad_limit.status_code == 400 and bad_limit.json()["field"] == "limit"


async def test_no_shape_of_query_reaches_a_hidden_dataset_another_org_or_a_path(
    world: tuple[World, dict[str, Path], dict[str, Path], str],
) -> None:
    w, a, b, reader = world
    mine = await _query(w, reader, "SELECT v, who FROM set0 UNION ALL SELECT v, who FROM set3")
    assert mine.status_code == 200, mine.text
    assert sorted(r[0] for r in mine.json()["rows"]) == [0, 3, 10, 13]
    assert {r[1] for r in mine.json()["rows"]} == {"mine"}
    missing = await _query(w, reader, "SELECT * FROM nosuch")
    assert missing.json()["error"] == "not_found" and missing.json()["field"] == "sql"
    by_name = [
        f"SELECT * FROM {HIDDEN}",
        f"SELECT * FROM `{HIDDEN}`",
        f"SELECT * FROM {HIDDEN.upper()}",
        f"SELECT * FROM set0 JOIN {HIDDEN} USING (v)",
        f"SELECT v FROM set0 UNION SELECT v FROM {HIDDEN}",
        f"SELECT * FROM set0 WHERE v IN (SELECT v FROM {HIDDEN})",
        f"SELECT * FROM set0 WHERE EXISTS (SELECT 1 FROM {HIDDEN})",
        f"WITH x AS (SELECT * FROM {HIDDEN}) SELECT * FROM x",
        f"SELECT (SELECT count(*) FROM {HIDDEN}) AS n",
        f"SELECT * FROM default.{HIDDEN}",
        f"SELECT * FROM spark_catalog.default.{HIDDEN}",
        f"SELECT * FROM parquet.`{a[HIDDEN]}`",
        f"SELECT * FROM parquet.`{b['set0']}`",
        f"SELECT * FROM parquet.`file://{b['set0']}/part-0.parquet`",
        "SELECT * FROM text.`/etc/passwd`",
        f"SELECT * FROM IDENTIFIER('{HIDDEN}')",
    ]
    for sql in by_name:
        _like(await _query(w, reader, sql), missing)
    for sql in (
        f"SELECT * FROM read_parquet('{b['set0']}/part-0.parquet')",
        f"SELECT * FROM read_files('{a[HIDDEN]}')",
        "SELECT input_file_name() FROM set0",
    ):
        refused = await _query(w, reader, sql)
        assert refused.status_code == 400, (sql, refused.text)
        assert refused.json()["field"] == "sql"
        assert "THEIRS" not in refused.text and str(a[HIDDEN]) not in refused.text


TEMPLATES = (
    "SELECT v, who FROM {t}",
    "SELECT s.v, s.who FROM set0 s JOIN {t} o ON s.v = o.v",
    "SELECT v, who FROM set0 UNION ALL SELECT v, who FROM {t}",
    "SELECT v, who FROM set0 WHERE v NOT IN (SELECT v FROM {t})",
    "WITH x AS (SELECT * FROM {t}) SELECT v, who FROM x",
    "SELECT v, who FROM `{t}`",
    "SELECT v, who FROM (SELECT * FROM {t}) sub",
)


@settings(
    max_examples=10,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    role=st.sampled_from(list(PlatformRole)),
    member_of=st.frozensets(st.sampled_from(ROLES), max_size=2),
    template=st.sampled_from(TEMPLATES),
    target=st.integers(0, SETS - 1),
)
async def test_a_query_answers_only_rows_of_datasets_the_caller_may_see(
    world: tuple[World, dict[str, Path], dict[str, Path], str],
    role: PlatformRole,
    member_of: frozenset[str],
    template: str,
    target: int,
) -> None:
    w, _, _, reader = world
    sub = f"{reader}-{uuid.uuid4().hex[:6]}"
    slug = reader.replace("reader-", "a-", 1)
    await w.user(sub, role.value, slug, *sorted(member_of))
    name = f"set{target}"
    sees = role is PlatformRole.ADMIN or name != HIDDEN or "r0" in member_of
    answer = await _query(w, sub, template.format(t=name))
    if sees:
        assert answer.status_code == 200, answer.text
        assert {row[1] for row in answer.json()["rows"]} <= {"mine"}
    else:
        _like(answer, await _query(w, sub, template.format(t="nosuch")))
    assert "THEIRS" not in answer.text


TABLE_DAG = """
dag: t
jobs:
  - name: src
    activation: source
    runtime: ecs_udf
    operator: follow
    source: { kind: manual }
    outputs: [ { dataset: alerts, kind: postgres_table } ]
"""


async def test_a_table_dataset_shows_the_callers_org_rows_only(
    repo: SqlRepository,
    clock: ManualClock,
    spark_provider: SparkSessionProvider,
    tmp_path: Path,
    data: DataDatabase,  # noqa: F811 (the imported fixture)
) -> None:
    from tests.api_fixtures import OPERATORS

    service = SparkQueryService(
        spark_provider, tmp_path / "objects", data=data, state=repo, timeout_seconds=300
    )
    kit = make_kit(clock)
    async with world_of(repo, clock, query=service, verifier=kit.verifier) as w:
        await w.dispatcher.deploy(parse_dag(TABLE_DAG, operators=OPERATORS.names()))
        await w.user("rita", "reader")
        mine = await w.operator()
        async with repo.read() as tx:
            (alerts,) = [d for d in await tx.catalog.datasets(mine.org_id) if d.name == "alerts"]
        assert alerts.location is not None
        # A table two orgs' rows share: the caller's view holds its org's only.
        table = ALERT_SCHEMA.table(table_name_of(alerts.location))
        async with data.engine.begin() as conn:
            await data.ensure_table(conn, table)
            await conn.execute(
                data.insert_ignoring_duplicates(table),
                [
                    {**alert(key, "warning", 2.0), "org_id": org, "created_at": clock.now()}
                    for key, org in (("mine", str(mine.org_id)), ("THEIRS", str(uuid.uuid4())))
                ],
            )
        rows = await w.get("rita", "/v1/datasets/alerts/rows")
        assert rows.status_code == 200, rows.text
        columns = [c["name"] for c in rows.json()["columns"]]
        assert "org_id" not in columns
        keys = [row[columns.index("dedupe_key")] for row in rows.json()["rows"]]
        assert keys == ["mine"]
        queried = await _query(w, "rita", "SELECT dedupe_key FROM alerts")
        assert queried.json()["rows"] == [["mine"]] and "THEIRS" not in queried.text
