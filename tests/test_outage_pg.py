"""A real Postgres outage under ``trace-lite serve`` (and its workers).

Each test starts a DEDICATED throwaway cluster (not the session's shared one),
so stopping it affects no other test. ``trace-lite serve`` runs the API and
the Dispatcher (whose in-process runner runs ``tick``), ``trace-lite worker``
processes run ``mark`` (``tests/outage_operators.py``).

- The cluster is stopped under the running server: every route that needs
  the database answers 503 with a JSON body and ``Retry-After``, the others
  (liveness, the OpenAPI document, the JWKS) 200, and nothing answers 500;
  once the cluster is back, the server (API and Dispatcher) recovers by
  itself: a lease claimed before the outage completes, a new task is woken,
  run in-process, routed and its downstream task completed.
- Two crash-restarts with work in flight, under ``serve``, its workers and
  kit workers, are ``tests/test_chaos_postgres.py``'s (on these helpers).

Every wait is bounded and waits on a condition (an HTTP answer, a row, a
marker file), never a fixed sleep.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import anyio
import httpx
import psycopg
import pytest
import sqlalchemy as sa

from tests.outage_operators import OPERATORS
from tests.test_e2e_http import (  # the process helpers of the end-to-end test
    AUTH,
    _free_port,
    _spawn,
    _until,
)
from tests.test_e2e_http import processes as e2e_processes  # noqa: F401 (a fixture)
from trace_core.api.capability import CAPABILITY_HEADER
from trace_core.clock import SystemClock
from trace_core.dag import parse_dag
from trace_core.dispatcher.service import Dispatcher
from trace_core.errors import DatabaseUnavailable
from trace_core.model import TASKS
from trace_core.storage.migrate import upgrade
from trace_core.storage.sql import SqlRepository
from trace_lite.people_keys import issue_person_token, open_people_keys
from trace_lite.pgcluster import PostgresCluster

OPERATORS_REF = "tests.outage_operators:OPERATORS"
STREAM = "trace-ecs-platform"
DEADLINE_SECONDS = 90.0
Processes = list[tuple[subprocess.Popen[bytes], IO[bytes]]]

DAG = """
dag: outage
jobs:
  - name: tick
    activation: source
    runtime: dispatcher
    operator: tick
    source: {{ kind: manual }}
    heartbeat_timeout_seconds: 5
    max_attempts: 20
    outputs: [ {{ dataset: ticks }} ]
  - name: mark
    activation: reactive
    runtime: ecs_platform
    operator: mark
    execution_strategy: PerUpdate
    heartbeat_timeout_seconds: {mark_timeout}
    max_attempts: 20
    config: {{ marker_dir: "{marker_dir}" }}
    inputs: [ {{ from: {{ dataset: ticks }} }} ]
    outputs: [ {{ dataset: marks }} ]
"""


@pytest.fixture
def spawned(e2e_processes: Processes) -> Processes:  # noqa: F811 (the imported fixture)
    """Started subprocesses, terminated (then killed) at the end of the test."""
    return e2e_processes


@pytest.fixture
def cluster() -> Iterator[PostgresCluster]:
    """A cluster of this test alone, so that stopping it disturbs no other test."""
    with PostgresCluster(max_connections=100) as server:
        yield server


def _database(cluster: PostgresCluster, markers: Path, *, mark_timeout: int) -> str:
    cluster.create_database("outage")
    url = cluster.url("outage")
    upgrade(url)

    async def deploy() -> None:
        repo = SqlRepository(url)
        try:
            dag = DAG.format(marker_dir=markers, mark_timeout=mark_timeout)
            await Dispatcher(repo, operators=OPERATORS).deploy(
                parse_dag(dag, operators=OPERATORS.names())
            )
        finally:
            await repo.close()

    anyio.run(deploy)
    return url


def _tasks(url: str) -> dict[uuid.UUID, tuple[str, str, int]]:
    """Every task: (job name, status, attempt)."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT t.id, j.name, t.status, t.attempt FROM tasks t JOIN jobs j ON j.id = t.job_id"
        ).fetchall()
    return {row[0]: (row[1], row[2], row[3]) for row in rows}


def _serve(url: str, tmp_path: Path, spawned: Processes) -> str:
    port = _free_port()
    log = tmp_path / "serve.log"
    server = _spawn(
        [
            "serve",
            "--db",
            url,
            "--port",
            str(port),
            "--data-dir",
            str(tmp_path / "data"),
            "--operators",
            OPERATORS_REF,
            "--log-level",
            "warning",
        ],
        log,
    )
    spawned.append(server)
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool | None:
        assert server[0].poll() is None, "serve exited:\n" + log.read_text()
        try:
            return httpx.get(f"{base}/readyz", headers=AUTH, timeout=5).status_code == 200 or None
        except httpx.TransportError:
            return None

    _until("the server to be ready", ready)
    return base


def _trigger(api: httpx.Client, key: str) -> uuid.UUID:
    """The manual ``tick`` task for ``key``. A 503 (a pooled connection the
    crash cut, found stale at its first use) is retried, as the client
    contract says; the same key is the same task, so a retry adds none."""

    def attempt() -> uuid.UUID | None:
        created = api.post("/internal/trigger", json={"job": "outage/tick", "key": key})
        if created.status_code == 503:
            assert created.headers["Retry-After"], created.headers
            return None
        assert created.status_code == 200, created.text
        return uuid.UUID(created.json()["task_id"])

    return _until(f"the trigger of {key}", attempt)


def _mark_of(url: str, tick: uuid.UUID) -> uuid.UUID | None:
    """The ``mark`` task routed from ``tick``'s event, once it exists."""
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT t.id FROM tasks t JOIN jobs j ON j.id = t.job_id"
            " WHERE j.name = 'mark' AND t.input_versions::text LIKE %s",
            (f"%{tick}%",),
        ).fetchone()
    return None if row is None else row[0]


def _requests(lease: dict[str, Any]) -> list[tuple[str, str, dict[str, Any], dict[str, str]]]:
    """A well-formed request for every route: (method, path, JSON body or query, headers).

    Well-formed on purpose, with the fence of a real lease: each must get as
    far as the database, not be refused at validation.
    """
    task = str(lease["job_id"])
    attempt = int(lease["attempt_id"])
    token = str(lease["lease_token"])
    cap = {CAPABILITY_HEADER: str(lease["payload"]["capability_token"])}
    fence = {"task_id": task, "attempt": attempt, "lease_token": token}
    report = {
        "worker_id": "outage-probe",
        "job_id": task,
        "attempt_id": attempt,
        "lease_token": token,
        "stream": STREAM,
        "message_id": str(lease["message_id"]),
    }
    output = lease["payload"]["outputs"][0]
    event = {
        "dataset_uuid": str(output["dataset_uuid"]),
        "dataset_version": str(output["dataset_version"]),
        "cursor": "probe",
    }
    return [
        ("POST", "/internal/task-claim", {"task_id": task, "worker_id": "outage-probe"}, AUTH),
        ("GET", "/internal/task-fetch", {"task_id": task}, AUTH),
        ("POST", "/internal/heartbeat", fence, AUTH),
        ("POST", "/internal/task-complete", {**fence, "status": "Completed"}, AUTH),
        (
            "POST",
            "/internal/events",
            {"task_id": task, "attempt": attempt, "events": [event]},
            AUTH,
        ),
        ("POST", "/internal/worker/claim", {"worker_id": "probe", "streams": [STREAM]}, AUTH),
        (
            "POST",
            "/internal/worker/heartbeat",
            {k: report[k] for k in ("worker_id", "job_id", "attempt_id", "lease_token")},
            AUTH,
        ),
        ("POST", "/internal/worker/complete", report, AUTH),
        ("POST", "/internal/worker/fail", {**report, "error": {"message": "probe"}}, AUTH),
        ("GET", "/internal/explain", {"dag": "outage", "job": "tick"}, AUTH),
        ("GET", "/internal/metrics", {}, AUTH),
        ("POST", "/internal/trigger", {"job": "outage/tick", "key": "during-outage"}, AUTH),
        ("POST", "/internal/pause", {"dag": "outage", "job": "tick", "by": "probe"}, AUTH),
        ("POST", "/internal/resume", {"dag": "outage", "job": "tick", "by": "probe"}, AUTH),
        ("GET", "/readyz", {}, AUTH),
        ("POST", "/v1/task/heartbeat", fence, cap),
        ("POST", "/v1/task/complete", {**fence, "status": "Completed"}, cap),
        ("POST", "/v1/task/events", {"task_id": task, "attempt": attempt, "events": [event]}, cap),
        (
            "POST",
            "/v1/task/buffer-publish",
            {
                "task_id": task,
                "attempt": attempt,
                "dataset_uuid": str(output["dataset_uuid"]),
                "schema_hash": "sha256:" + "0" * 64,
                "records": [{"x": 1}],
            },
            cap,
        ),
        ("POST", "/v1/task/credentials", {"task_id": task, "attempt": attempt}, cap),
        ("POST", "/v1/task/query", {"task_id": task, "attempt": attempt, "sql": "SELECT 1"}, cap),
        ("POST", "/v1/task/state/read", {"task_id": task, "attempt": attempt}, cap),
        (
            "POST",
            "/v1/task/state/write",
            {"task_id": task, "attempt": attempt, "state": {"probe": 1}, "expected_version": None},
            cap,
        ),
        ("GET", "/internal/tasks/{task_id}", {}, AUTH),
    ]


def _people_requests(
    person: dict[str, str],
) -> list[tuple[str, str, dict[str, Any], dict[str, str]]]:
    """A well-formed request for every people route, with a person's valid token
    (the user lookup in front of routing is the database read they meet)."""
    role = {"role": "reader"}
    return [
        ("GET", "/v1/me", {}, person),
        ("GET", "/v1/users", {}, person),
        ("POST", "/v1/users", {"external_id": "probe-user", **role}, person),
        ("PATCH", "/v1/users/{user_id}", role, person),
        ("POST", "/v1/users/{user_id}/disable", {}, person),
        ("GET", "/v1/org-roles", {}, person),
        ("POST", "/v1/org-roles", {"slug": "probe-role"}, person),
        ("DELETE", "/v1/org-roles/{slug}", {}, person),
        ("PUT", "/v1/org-roles/{slug}/members/{user_id}", {}, person),
        ("GET", "/v1/datasets/{name}/read-roles", {}, person),
        ("PUT", "/v1/datasets/{name}/read-roles", {"read_roles": ["probe-role"]}, person),
        ("GET", "/v1/dags", {}, person),
        ("GET", "/v1/dags/{dag}", {}, person),
        ("POST", "/v1/dags", {"yaml": "dag: probe\njobs: []\n"}, person),
        ("POST", "/v1/dags/{dag}/rollback", {}, person),
        ("GET", "/v1/dags/{dag}/jobs/{job}/explain", {}, person),
        ("POST", "/v1/dags/{dag}/jobs/{job}/trigger", {"key": "probe"}, person),
        ("POST", "/v1/dags/{dag}/jobs/{job}/pause", {}, person),
        ("POST", "/v1/dags/{dag}/jobs/{job}/resume", {}, person),
        ("GET", "/v1/datasets", {}, person),
        ("GET", "/v1/datasets/{name}", {}, person),
        ("GET", "/v1/datasets/{name}/rows", {"limit": 1}, person),
        ("POST", "/v1/datasets/{name}/rematerialize", {}, person),
        ("POST", "/v1/query", {"sql": "SELECT 1", "limit": 1}, person),
        ("GET", "/v1/tasks", {}, person),
        ("GET", "/v1/tasks/{task_id}", {}, person),
        ("GET", "/v1/lineage", {"dataset": "probe"}, person),
    ]


def _person_token(data_dir: Path) -> dict[str, str]:
    """The Authorization header of a short-lived token from the lite people issuer
    that ``serve`` opened in ``data_dir`` (what ``trace-lite token`` prints)."""
    clock = SystemClock()
    ring = open_people_keys(data_dir, clock)
    token = anyio.run(lambda: issue_person_token(ring, "outage-probe", clock, ttl_seconds=600))
    return {"Authorization": f"Bearer {token}"}


NO_DATABASE = {"/healthz", "/openapi.json", "/internal/jwks/task"}
"""Routes that read no state database: they keep answering 200 during an outage."""


def test_every_route_answers_503_while_postgres_is_down_and_the_server_recovers(
    cluster: PostgresCluster, tmp_path: Path, spawned: Processes
) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    url = _database(cluster, markers, mark_timeout=120)
    base = _serve(url, tmp_path, spawned)
    server, _ = spawned[0]
    with httpx.Client(base_url=base, headers=AUTH, timeout=30) as api:
        # Before: the in-process worker runs a tick, its event is routed, and
        # the test holds the lease of the mark task (a worker mid-task).
        first = _trigger(api, "before")
        _until("the first mark task", lambda: _mark_of(url, first))

        def claim() -> dict[str, Any] | None:
            body = api.post(
                "/internal/worker/claim",
                json={"worker_id": "outage-probe", "streams": [STREAM], "max_wait_ms": 1000},
            ).json()
            return body if body.get("claimed") else None

        lease = _until("a claimed mark task", claim)
        requests = [*_requests(lease), *_people_requests(_person_token(tmp_path / "data"))]
        covered = {path for _, path, _, _ in requests} | NO_DATABASE
        documented = set(api.get("/openapi.json").json()["paths"])
        assert documented <= covered, f"routes without a probe: {documented - covered}"

        cluster.halt("fast")
        answers: dict[str, tuple[int, Any, str | None]] = {}
        for method, path, body, headers in requests:
            # a path template is filled with the lease's task id or probe names
            filled = path.format(
                task_id=lease["job_id"],
                user_id=uuid.uuid4(),
                slug="probe-role",
                name="probe",
                dag="probe",
                job="probe",
            )
            if method == "GET":
                response = api.get(filled, params=body, headers=headers)
            else:
                response = api.request(method, filled, json=body, headers=headers)
            answers[path] = (
                response.status_code,
                response.json(),
                response.headers.get("Retry-After"),
            )
        for path in NO_DATABASE:
            response = api.get(path)
            answers[path] = (response.status_code, response.json(), None)
        assert server.poll() is None, "serve died during the outage"

        wrong = {
            path: (status, body, retry_after)
            for path, (status, body, retry_after) in answers.items()
            if (status != 200 if path in NO_DATABASE else status != 503 or retry_after is None)
        }
        assert not wrong, wrong
        for path, (_, body, retry_after) in answers.items():
            if path not in NO_DATABASE:
                assert retry_after is not None and int(retry_after) >= 1, path
                assert isinstance(body, dict), (path, body)
                assert body.get("error") == "unavailable" or path == "/readyz", (path, body)
        assert answers["/readyz"][1]["database"] == "unavailable"
        # The relay polls at its own pace (at most every poll_max_seconds): the
        # outage lasts until it has met it, so its once-only log is checked below.
        log_path = tmp_path / "serve.log"
        _until(
            "the outbox relay to meet the outage",
            lambda: "outbox relay: DatabaseUnavailable" in log_path.read_text() or None,
        )

        cluster.resume()

        # The server recovers by itself: ready again, the held lease completes,
        # and new work is woken, run in-process, routed and completed.
        def ready() -> bool | None:
            response = api.get("/readyz")
            return response.status_code == 200 or None

        _until("the server to be ready again", ready)
        report = _requests(lease)[7]
        done = api.post(report[1], json=report[2])
        assert done.status_code == 200, done.text
        second = _trigger(api, "after")
        mark = _until("the mark task of the tick after the outage", lambda: _mark_of(url, second))
        lease2 = _until("its claim", claim)
        assert uuid.UUID(lease2["job_id"]) == mark
        report2 = _requests(lease2)[7]
        assert api.post(report2[1], json=report2[2]).status_code == 200
        tasks = _tasks(url)
        assert {status for _, status, _ in tasks.values()} == {"Completed"}, tasks
        readiness = api.get("/readyz").json()
        assert all(s["running"] and s["healthy"] for s in readiness["services"].values())
    assert server.poll() is None
    log = log_path.read_text()
    assert "unhandled error" not in log and "Traceback" not in log, log
    # Each loop logged the outage once, not once per retry.
    assert log.count("outbox relay: DatabaseUnavailable") == 1, log


@pytest.mark.anyio
async def test_a_statement_on_a_connection_the_server_dropped_is_database_unavailable(
    cluster: PostgresCluster,
) -> None:
    """Each scope, holding a pooled connection the crash cut, answers
    ``DatabaseUnavailable`` for a statement outside the protocol operations,
    never the driver's error; the same repository works again once it is back."""
    cluster.create_database("scopes")
    url = cluster.url("scopes")
    upgrade(url)
    repo = SqlRepository(url)
    try:
        for scope in (repo.read, repo.transaction, repo.autocommit):
            await repo.ping()  # a pooled connection, open before the crash
            cluster.halt("immediate")
            with pytest.raises(DatabaseUnavailable) as caught:
                async with scope() as tx:
                    await tx.connection.execute(sa.text("SELECT count(*) FROM tasks"))
            assert not isinstance(caught.value, sa.exc.SQLAlchemyError)
            cluster.resume()
        await repo.ping()  # the cut connections were dropped, not handed out again
    finally:
        await repo.close()


@pytest.mark.anyio
async def test_the_direct_pool_drops_every_idle_connection_a_crash_cut(
    cluster: PostgresCluster,
) -> None:
    """After a crash, the first call on a cut connection fails (503-worthy) and
    takes the other idle ones with it: the next call opens a fresh one instead
    of failing once per stale connection."""
    cluster.create_database("direct")
    url = cluster.url("direct")
    upgrade(url)
    repo = SqlRepository(url)
    pool = repo._direct
    assert pool is not None
    statement = sa.select(sa.literal(1))
    try:
        async with anyio.create_task_group() as group:
            for _ in range(4):  # side by side: four connections, kept idle after
                group.start_soon(pool.fetch, statement, {})
        assert pool.idle == 4
        cluster.crash_restart()
        with pytest.raises(DatabaseUnavailable):
            async with repo.statement() as tx:
                await tx.inspect(TASKS, uuid.uuid4())
        assert pool.idle == 0
        async with repo.statement() as tx:
            assert await tx.inspect(TASKS, uuid.uuid4()) is None
        assert pool.idle == 1
    finally:
        await repo.close()
