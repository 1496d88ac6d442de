"""The internal task endpoints, ops endpoints, auth, errors and ``trace-lite serve``,
on both engines, through an in-process ASGI client."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tests.api_fixtures import AUTH, DAG, OPERATORS, STREAM, TOKEN, Api, api_platform, partition
from trace_core.api import ApiConfig, create_app
from trace_core.clock import ManualClock
from trace_core.dag import parse_dag
from trace_core.dispatcher.inprocess import InProcessWakeupQueue
from trace_core.dispatcher.service import Dispatcher
from trace_core.errors import ConfigurationError
from trace_core.storage.sql import SqlRepository
from trace_lite.cli import main
from trace_lite.serve import read_internal_token

pytestmark = pytest.mark.anyio

EXPIRE = 3600.0  # past any lease of the test DAG's jobs
BACKOFF = 3600.0  # past any retry backoff


@pytest.fixture
async def api(repo: SqlRepository, clock: ManualClock) -> Any:
    async with api_platform(repo, clock) as platform:
        yield platform


def _fence(task_id: uuid.UUID, claimed: dict[str, Any]) -> dict[str, Any]:
    return {
        "task_id": str(task_id),
        "attempt": claimed["attempt"],
        "lease_token": claimed["lease_token"],
    }


async def _reclaimed(api: Api, task_id: uuid.UUID) -> dict[str, Any]:
    """Let the first attempt's lease expire, retry the task, claim attempt 2."""
    api.clock.advance(EXPIRE)
    await api.dispatcher.reaper.run_once()
    api.clock.advance(BACKOFF)
    await api.dispatcher.retries.run_once()
    second = await api.claim(task_id, "worker-2")
    assert second["status"] == "Claimed" and second["attempt"] == 2, second
    return second


# --- the task lifecycle ----------------------------------------------------


async def test_claim_fetch_heartbeat_emit_complete_creates_downstream_tasks(api: Api) -> None:
    task_id = await api.trigger("run-1")
    claimed = await api.claim(task_id)
    assert claimed["status"] == "Claimed" and claimed["attempt"] == 1
    assert claimed["task"]["task_id"] == str(task_id)
    assert claimed["task"]["job"]["name"] == "follow"
    assert claimed["lease_expires_at"].endswith("Z")
    fence = _fence(task_id, claimed)

    fetched = await api.client.get("/internal/task-fetch", params={"task_id": str(task_id)})
    assert fetched.status_code == 200
    assert fetched.json()["status"] == "Running" and fetched.json()["attempt"] == 1

    api.clock.advance(5)
    beat = await api.client.post("/internal/heartbeat", json=fence)
    assert beat.status_code == 200, beat.text
    assert beat.json()["ok"] is True and beat.json()["directive"] == "run"
    assert beat.json()["lease_expires_at"] > claimed["lease_expires_at"]

    emitted = await api.client.post(
        "/internal/events",
        json={"task_id": str(task_id), "attempt": 1, "events": [partition(api.blocks, 0, 9)]},
    )
    assert emitted.status_code == 200, emitted.text
    assert emitted.json()["new"] == 1 and emitted.json()["duplicates"] == 0

    report = {
        **fence,
        "status": "Completed",
        "events": [partition(api.blocks, 10, 19)],
        "outputs": [{"output_index": 0, "row_count": 20}],
        "error_message": None,
    }
    done = await api.client.post("/internal/task-complete", json=report)
    assert done.status_code == 200, done.text
    assert done.json()["status"] == "Completed" and done.json()["duplicate"] is False
    assert len(done.json()["event_ids"]) == 1
    row = await api.task(task_id)
    assert row["status"] == "Completed" and row["outputs"] == [{"output_index": 0, "row_count": 20}]

    await api.dispatcher.run_once()  # route the accepted events
    downstream = await api.tasks_of("double")
    assert sorted(t["partitions"][0] for t in downstream) == ["0-9", "10-19"]
    assert {t["status"] for t in downstream} == {"Queued"}

    explained = await api.client.get("/internal/explain", params={"dag": "api", "job": "double"})
    assert explained.status_code == 200, explained.text
    assert explained.json()["tasks_by_status"] == {"Queued": 2}


async def test_a_repeated_completion_is_acknowledged_and_changes_nothing(api: Api) -> None:
    task_id = await api.trigger("run-1")
    claimed = await api.claim(task_id)
    report = {
        **_fence(task_id, claimed),
        "status": "Completed",
        "events": [partition(api.blocks, 0, 9)],
    }
    first = await api.client.post("/internal/task-complete", json=report)
    assert first.status_code == 200 and first.json()["duplicate"] is False
    before = await api.task(task_id)
    again = await api.client.post("/internal/task-complete", json=report)
    assert again.status_code == 200, again.text
    assert again.json() == {
        "ok": True,
        "task_id": str(task_id),
        "status": "Completed",
        "duplicate": True,
        "retrying": None,
        "event_ids": [],
    }
    assert await api.task(task_id) == before
    await api.dispatcher.run_once()
    assert len(await api.tasks_of("double")) == 1  # the event was routed once


async def test_not_claimed_reasons(api: Api) -> None:
    assert (await api.claim(uuid.uuid4())) == {"status": "NotClaimed", "reason": "NotFound"}

    running = await api.trigger("running")
    assert (await api.claim(running))["status"] == "Claimed"
    assert (await api.claim(running, "other")) == {
        "status": "NotClaimed",
        "reason": "AlreadyRunning",
    }

    done = await api.trigger("done")
    claimed = await api.claim(done)
    report = {**_fence(done, claimed), "status": "Completed"}
    assert (await api.client.post("/internal/task-complete", json=report)).status_code == 200
    assert (await api.claim(done))["reason"] == "Completed"

    canceled = await api.trigger("canceled")
    await api.dispatcher.tasks.cancel([canceled])
    assert (await api.claim(canceled))["reason"] == "Canceled"

    failed = await api.trigger("failed")
    claimed = await api.claim(failed)
    report = {**_fence(failed, claimed), "status": "Failed", "error_message": "boom"}
    assert (await api.client.post("/internal/task-complete", json=report)).status_code == 200
    assert (await api.claim(failed))["reason"] == "NotReady"  # waiting for its retry


async def test_stale_attempt_is_refused_and_changes_nothing(api: Api) -> None:
    task_id = await api.trigger("run-1")
    first = await api.claim(task_id)
    second = await _reclaimed(api, task_id)
    before = await api.task(task_id)
    old = _fence(task_id, first)

    stale_beat = await api.client.post("/internal/heartbeat", json=old)
    assert stale_beat.status_code == 409 and stale_beat.json()["error"] == "stale"
    for status in ("Completed", "Failed"):
        report = {**old, "status": status, "error_message": "late"}
        stale = await api.client.post("/internal/task-complete", json=report)
        assert stale.status_code == 409, stale.text
        assert stale.json()["error"] == "stale"
    late_events = await api.client.post(
        "/internal/events",
        json={"task_id": str(task_id), "attempt": 1, "events": [partition(api.blocks, 0, 9)]},
    )
    assert late_events.status_code == 409 and late_events.json()["error"] == "stale"

    after = await api.task(task_id)
    assert after == before
    assert after["status"] == "Running" and after["attempt"] == 2
    assert str(after["lease_token"]) == second["lease_token"]
    # the current attempt is unaffected
    beat = await api.client.post("/internal/heartbeat", json=_fence(task_id, second))
    assert beat.status_code == 200


async def test_a_late_reply_of_the_current_attempt_is_accepted_after_expiry(api: Api) -> None:
    task_id = await api.trigger("run-1")
    claimed = await api.claim(task_id)
    api.clock.advance(EXPIRE)
    await api.dispatcher.reaper.run_once()  # marked failed; no newer attempt yet
    report = {**_fence(task_id, claimed), "status": "Completed"}
    late = await api.client.post("/internal/task-complete", json=report)
    assert late.status_code == 200, late.text
    assert (await api.task(task_id))["status"] == "Completed"


async def test_failed_reports_retry_or_dead_letter_and_are_idempotent(api: Api) -> None:
    retried = await api.trigger("retried")
    claimed = await api.claim(retried)
    report = {**_fence(retried, claimed), "status": "Failed", "error_message": "flaky"}
    first = await api.client.post("/internal/task-complete", json=report)
    assert first.status_code == 200, first.text
    assert first.json()["retrying"] is True and first.json()["duplicate"] is False
    row = await api.task(retried)
    assert row["status"] == "Failed" and row["error_message"] == "flaky"
    again = await api.client.post("/internal/task-complete", json=report)
    assert again.json()["duplicate"] is True and again.json()["retrying"] is True
    assert await api.task(retried) == row

    fatal = await api.trigger("fatal")
    claimed = await api.claim(fatal)
    report = {
        **_fence(fatal, claimed),
        "status": "Failed",
        "error_message": "bad input",
        "retryable": False,
    }
    dead = await api.client.post("/internal/task-complete", json=report)
    assert dead.json()["retrying"] is False
    assert (await api.claim(fatal))["reason"] == "DeadLettered"

    # a failure report contradicting a recorded completion is refused
    done = await api.trigger("done")
    claimed = await api.claim(done)
    fence = _fence(done, claimed)
    ok = await api.client.post("/internal/task-complete", json={**fence, "status": "Completed"})
    assert ok.status_code == 200
    contradiction = await api.client.post(
        "/internal/task-complete", json={**fence, "status": "Failed", "error_message": "x"}
    )
    assert contradiction.status_code == 409
    assert contradiction.json()["error"] == "invalid_transition"


async def test_canceled_tasks_are_acknowledged_only_when_canceled(api: Api) -> None:
    task_id = await api.trigger("run-1")
    await api.dispatcher.tasks.cancel([task_id])
    fetched = await api.client.get("/internal/task-fetch", params={"task_id": str(task_id)})
    assert fetched.json()["status"] == "Canceled"
    ack = await api.client.post(
        "/internal/task-complete",
        json={"task_id": str(task_id), "attempt": 1, "status": "Canceled"},
    )
    assert ack.status_code == 200 and ack.json()["status"] == "Canceled"

    running = await api.trigger("running")
    claimed = await api.claim(running)
    refused = await api.client.post(
        "/internal/task-complete", json={**_fence(running, claimed), "status": "Canceled"}
    )
    assert refused.status_code == 409 and refused.json()["error"] == "not_canceled"
    assert (await api.task(running))["status"] == "Running"

    # a canceled task's holder is stale
    await api.dispatcher.tasks.cancel([running])
    late = await api.client.post(
        "/internal/task-complete", json={**_fence(running, claimed), "status": "Completed"}
    )
    assert late.status_code == 409 and late.json()["error"] == "stale"

    unknown = await api.client.post(
        "/internal/task-complete",
        json={"task_id": str(uuid.uuid4()), "attempt": 1, "status": "Canceled"},
    )
    assert unknown.status_code == 404 and unknown.json()["error"] == "not_found"


async def test_fetch_and_heartbeat_of_an_unknown_task_are_404(api: Api) -> None:
    missing = str(uuid.uuid4())
    fetched = await api.client.get("/internal/task-fetch", params={"task_id": missing})
    assert fetched.status_code == 404 and fetched.json()["error"] == "not_found"
    beat = await api.client.post(
        "/internal/heartbeat",
        json={"task_id": missing, "attempt": 1, "lease_token": str(uuid.uuid4())},
    )
    assert beat.status_code == 404


# --- ops -----------------------------------------------------------------


async def test_trigger_by_key_is_idempotent_and_events_are_routed(api: Api) -> None:
    first = await api.client.post("/internal/trigger", json={"job": "api/follow", "key": "k"})
    again = await api.client.post("/internal/trigger", json={"job": "follow", "key": "k"})
    assert first.status_code == again.status_code == 200
    assert first.json()["created"] is True and again.json()["created"] is False
    assert first.json()["task_id"] == again.json()["task_id"]

    emitted = await api.client.post(
        "/internal/trigger", json={"events": [partition(api.blocks, 0, 9)]}
    )
    assert emitted.status_code == 200 and emitted.json()["new"] == 1
    await api.dispatcher.run_once()
    assert len(await api.tasks_of("double")) == 1

    cases = [
        ({}, "body"),
        ({"job": "follow", "key": "k", "events": [partition(api.blocks, 0, 9)]}, "body"),
        ({"job": "follow"}, "key"),
    ]
    for body, field in cases:
        refused = await api.client.post("/internal/trigger", json=body)
        assert refused.status_code == 400, (body, refused.text)
        assert refused.json()["field"] == field, refused.json()
    for job in ("nope", "double"):  # no such job; a reactive job is no source
        unknown = await api.client.post("/internal/trigger", json={"job": job, "key": "k"})
        assert unknown.status_code == 404 and unknown.json()["error"] == "not_found"


async def test_explain_and_metrics(api: Api) -> None:
    await api.trigger("run-1")
    explained = await api.client.get("/internal/explain", params={"dag": "api", "job": "follow"})
    assert explained.status_code == 200
    assert explained.json()["activation"] == "source" and explained.json()["reasons"]
    missing = await api.client.get("/internal/explain", params={"dag": "api", "job": "nope"})
    assert missing.status_code == 404

    metrics = await api.client.get("/internal/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "# TYPE" in metrics.text


async def test_jwks_serves_the_configured_document(repo: SqlRepository, clock: ManualClock) -> None:
    async with api_platform(repo, clock) as platform:
        default = await platform.client.get("/internal/jwks/task")
        assert default.status_code == 200 and default.json() == {"keys": []}
    key = {
        "kty": "EC",
        "crv": "P-256",
        "kid": "k1",
        "use": "sig",
        "alg": "ES256",
        "x": "a",
        "y": "b",
    }
    app = create_app(platform.dispatcher, internal_token=TOKEN, jwks=lambda: {"keys": [key]})
    async with _client(app) as client:
        served = await client.get("/internal/jwks/task", headers=AUTH)
    assert served.json() == {"keys": [key]}


# --- auth and errors ---------------------------------------------------------


def _client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://trace.test")


async def test_every_internal_route_requires_the_token(api: Api) -> None:
    routes = [
        (method.upper(), path)
        for path, item in api.app.openapi()["paths"].items()
        for method in item
    ]
    health = {"/healthz", "/readyz"}  # liveness and readiness, behind the token too
    assert len(routes) == 18
    assert all(path.startswith("/internal/") or path in health for _, path in routes)
    routes += [("GET", "/internal/no-such-route"), ("DELETE", "/internal/task-claim")]
    wrong = [
        {},
        {"Authorization": f"Bearer {TOKEN}x"},
        {"Authorization": f"Bearer {TOKEN[:-1]}"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": TOKEN},
        {"Authorization": "Bearer"},
    ]
    async with _client(api.app) as anonymous:
        for method, path in routes:
            for headers in wrong:
                response = await anonymous.request(method, path, headers=headers, json={})
                assert response.status_code == 401, (method, path, headers)
                assert response.json()["error"] == "unauthorized"
                assert TOKEN not in response.text
                assert response.headers["www-authenticate"].startswith("Bearer")
        # the scheme is case-insensitive; the OpenAPI document is public
        ok = await anonymous.get("/internal/metrics", headers={"Authorization": f"bearer {TOKEN}"})
        assert ok.status_code == 200
        public = await anonymous.get("/openapi.json")
        assert public.status_code == 200 and "/internal/task-claim" in public.json()["paths"]


async def test_every_documented_error_answer_is_a_json_body_with_its_schema(api: Api) -> None:
    document = api.app.openapi()
    schemas = document["components"]["schemas"]
    answers = [
        (path, code, answer)
        for path, item in document["paths"].items()
        for operation in item.values()
        for code, answer in operation["responses"].items()
        if code.startswith(("4", "5"))
    ]
    assert len(answers) >= 60
    for path, code, answer in answers:
        if "content" not in answer:  # /readyz's 503: its own health body
            continue
        # Errors are JSON on every route, /internal/metrics (text/plain) included.
        assert list(answer["content"]) == ["application/json"], (path, code)
        ref = answer["content"]["application/json"]["schema"]["$ref"]
        assert ref.removeprefix("#/components/schemas/") in schemas, (path, code, ref)
    assert schemas["ErrorBody"]["required"] == ["error", "reason"]
    assert "#/components/schemas/FieldError" in json.dumps(schemas["ErrorBody"])
    assert "FieldError" in schemas


async def test_malformed_requests_name_the_field(api: Api) -> None:
    task_id = await api.trigger("run-1")
    claimed = await api.claim(task_id)
    fence = _fence(task_id, claimed)
    event = partition(api.blocks, 0, 9)
    emitter = {"task_id": str(task_id), "attempt": 1}
    other = {**event, "dataset_version": str(uuid.uuid4())}  # no such version of blocks
    cases: list[tuple[str, Any, str]] = [
        ("/internal/task-claim", {}, "task_id"),
        ("/internal/task-claim", {"task_id": "nope", "worker_id": "w"}, "task_id"),
        ("/internal/task-claim", {"task_id": str(task_id), "worker_id": " "}, "worker_id"),
        ("/internal/task-claim", {"task_id": str(task_id), "worker_id": "w\x00"}, "worker_id"),
        ("/internal/task-claim", {"task_id": str(task_id), "worker_id": "w", "x": 1}, "x"),
        ("/internal/task-claim", [], "body"),
        ("/internal/heartbeat", {**fence, "attempt": "1"}, "attempt"),
        ("/internal/heartbeat", {**fence, "attempt": 2**40}, "attempt"),
        ("/internal/heartbeat", {**fence, "lease_token": "x"}, "lease_token"),
        ("/internal/events", {**emitter, "events": []}, "events"),
        ("/internal/events", {**emitter, "events": [{**event, "cursor": [1]}]}, "events[0].cursor"),
        ("/internal/events", {**emitter, "events": [event, {**event, "cursor": 3}]}, "events[1]"),
        ("/internal/events", {**emitter, "events": [{**event, "foo": 1}]}, "events[0].foo"),
        ("/internal/events", {**emitter, "events": [{**event, "end": -1}]}, "events[0].end"),
        ("/internal/events", {**emitter, "events": [{**event, "end": 2**63}]}, "events[0].end"),
        ("/internal/events", {**emitter, "events": [{**event, "start": 10}]}, "events[0].end"),
        ("/internal/events", {**emitter, "events": [other]}, "events[0].dataset_version"),
        ("/internal/task-complete", {**fence, "status": "Done"}, "status"),
        (
            "/internal/task-complete",
            {**fence, "lease_token": None, "status": "Completed"},
            "lease_token",
        ),
        ("/internal/task-complete", {**fence, "status": "Completed", "outputs": [1]}, "outputs[0]"),
        ("/internal/task-complete", {**fence, "status": "Failed", "events": [event]}, "events"),
        (
            "/internal/worker/claim",
            {"worker_id": "w", "streams": ["trace-ecs-udf"], "max_wait_ms": -1},
            "max_wait_ms",
        ),
    ]
    for path, body, field in cases:
        response = await api.client.post(path, json=body)
        assert response.status_code == 400, (path, body, response.text)
        assert response.json()["error"] == "invalid_request"
        assert response.json()["field"] == field, (path, body, response.json())
        assert response.json()["reason"]

    surrogate = json.dumps({**emitter, "events": [{**event, "cursor": "?"}]}).replace(
        '"?"', '"\\ud800"'
    )
    raw = [
        ("/internal/task-claim", b'{"task_id": ', "body"),
        ("/internal/events", surrogate.encode(), "events[0].cursor"),
        (
            "/internal/task-complete",
            b'{"task_id": "%s", "attempt": 1, "lease_token": "%s", "status": "Completed",'
            b' "outputs": [{"rows": NaN}]}'
            % (str(task_id).encode(), fence["lease_token"].encode()),
            "outputs[0]",
        ),
    ]
    for path, content, field in raw:
        response = await api.client.post(
            path, content=content, headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 400, response.text
        assert response.json()["field"] == field, response.json()
    not_json = await api.client.post(
        "/internal/task-claim", content=b"task_id=1", headers={"Content-Type": "text/plain"}
    )
    assert not_json.status_code == 400
    for path, params, field in [
        ("/internal/task-fetch", {"task_id": "nope"}, "task_id"),
        ("/internal/task-fetch", {}, "task_id"),
        ("/internal/explain", {"job": "x"}, "dag"),
    ]:
        response = await api.client.get(path, params=params)
        assert response.status_code == 400 and response.json()["field"] == field
    # nothing of the refused requests reached the task
    assert (await api.task(task_id))["status"] == "Running"


async def test_bodies_over_the_cap_are_413(repo: SqlRepository, clock: ManualClock) -> None:
    async with api_platform(repo, clock, config=ApiConfig(max_body_bytes=4096)) as api:
        padding = {"task_id": str(uuid.uuid4()), "worker_id": "w" * 5000}
        declared = await api.client.post("/internal/task-claim", json=padding)
        assert declared.status_code == 413 and declared.json()["error"] == "payload_too_large"

        async def chunks() -> Any:
            for _ in range(10):
                yield b" " * 1000

        streamed = await api.client.post(
            "/internal/task-claim", content=chunks(), headers={"Content-Type": "application/json"}
        )
        assert streamed.status_code == 413
        small = await api.client.post(
            "/internal/task-claim", json={"task_id": str(uuid.uuid4()), "worker_id": "w"}
        )
        assert small.status_code == 200


async def test_an_unavailable_database_is_503_with_retry_after() -> None:
    # Nothing listens on port 1: every connection is refused at once.
    repo = SqlRepository("postgresql://trace@127.0.0.1:1/trace")
    try:
        dispatcher = Dispatcher(repo, operators=OPERATORS)
        async with _client(create_app(dispatcher, internal_token=TOKEN)) as client:
            response = await client.get(
                "/internal/task-fetch", params={"task_id": str(uuid.uuid4())}, headers=AUTH
            )
    finally:
        await repo.close()
    assert response.status_code == 503, response.text
    assert response.json()["error"] == "unavailable"
    assert response.headers["retry-after"] == "1"


async def test_the_app_can_run_the_dispatcher_in_its_lifespan(
    repo: SqlRepository, clock: ManualClock
) -> None:
    dispatcher = Dispatcher(repo, operators=OPERATORS, clock=clock)
    await dispatcher.deploy(parse_dag(DAG, operators=OPERATORS.names()))
    wakeups = dispatcher.wakeups
    assert isinstance(wakeups, InProcessWakeupQueue)
    app = create_app(dispatcher, internal_token=TOKEN, run_dispatcher=True)
    async with app.router.lifespan_context(app), _client(app) as client:
        created = await client.post(
            "/internal/trigger", json={"job": "api/follow", "key": "k"}, headers=AUTH
        )
        # The running outbox relay launches the task: its wake-up arrives.
        with anyio.fail_after(10):
            woken = await wakeups.receive(STREAM, wait=10)
    assert woken == [uuid.UUID(created.json()["task_id"])]


def test_importing_the_core_does_not_import_the_http_stack() -> None:
    code = (
        "import sys, trace_core, trace_core.dispatcher, trace_lite.cli; "
        "print([m for m in ('fastapi', 'starlette', 'uvicorn', 'trace_core.api') "
        "if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- trace-lite serve --------------------------------------------------------


def test_serve_refuses_to_start_without_a_token(
    database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TRACE_INTERNAL_TOKEN", raising=False)
    assert main(["serve", "--db", database_url]) == 2
    assert "no internal token" in capsys.readouterr().err

    monkeypatch.setenv("TRACE_INTERNAL_TOKEN", "short")
    assert main(["serve", "--db", database_url]) == 2
    err = capsys.readouterr().err
    assert "at least 16 characters" in err and "short" not in err.replace("TOKEN", "")


@pytest.mark.parametrize("engine", ["sqlite"])
def test_serve_refuses_a_token_file_others_can_read(
    database_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o644)
    assert main(["serve", "--db", database_url, "--internal-token-file", str(token_file)]) == 2
    err = capsys.readouterr().err
    assert "readable or writable by others" in err and TOKEN not in err
    missing = str(tmp_path / "nope")
    assert main(["serve", "--db", database_url, "--internal-token-file", missing]) == 2


def test_the_token_file_is_read_and_wins_over_the_environment(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-the-file-0123456789\n")
    token_file.chmod(0o600)
    environ = {"TRACE_INTERNAL_TOKEN": TOKEN}
    assert read_internal_token(str(token_file), environ) == "from-the-file-0123456789"
    assert read_internal_token(None, environ) == TOKEN
    token_file.write_text("two words and more\n")
    with pytest.raises(ConfigurationError) as refused:
        read_internal_token(str(token_file), environ)
    assert "two words" not in str(refused.value)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def test_serve_runs_the_api_with_the_dispatcher(database_url: str, tmp_path: Path) -> None:
    port = _free_port()
    env = {**os.environ, "TRACE_INTERNAL_TOKEN": TOKEN}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trace_lite.cli",
            "serve",
            "--db",
            database_url,
            "--port",
            str(port),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()
    seen: list[str] = []

    def pump() -> None:
        assert server.stderr is not None
        for line in server.stderr:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        while True:  # the startup line, or the end of the output: bounded by the timeout
            line = lines.get(timeout=60)
            assert line is not None, "serve exited before starting:\n" + "".join(seen)
            seen.append(line)
            if "Application startup complete" in line:
                break
        base = f"http://127.0.0.1:{port}"
        document = None
        for _ in range(20):  # bounded: the server announced it is listening
            try:
                document = httpx.get(f"{base}/openapi.json", timeout=5)
                break
            except httpx.TransportError:
                continue
        assert document is not None and document.status_code == 200
        authorized = httpx.get(f"{base}/internal/metrics", headers=AUTH, timeout=5)
        assert authorized.status_code == 200 and "# TYPE" in authorized.text
        anonymous = httpx.get(f"{base}/internal/metrics", timeout=5)
        assert anonymous.status_code == 401
    finally:
        server.terminate()
        code = server.wait(timeout=60)
    while (line := lines.get(timeout=60)) is not None:
        seen.append(line)
    reader.join(timeout=60)
    assert server.stderr is not None
    server.stderr.close()
    output = "".join(seen)
    # uvicorn shuts down gracefully, then re-raises the signal it caught
    assert code in (0, -signal.SIGTERM), output
    assert TOKEN not in output
    assert "Application shutdown complete" in output
