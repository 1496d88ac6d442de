"""The task-scoped endpoints (``/v1/task/*``), authorized by capability tokens only,
on both engines, through an in-process ASGI client; and ``trace-lite serve``
issuing and honouring them end to end."""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import socket
import stat
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import sqlalchemy as sa

from tests.api_fixtures import AUTH, TOKEN
from tests.capability_fixtures import (
    CAPS_DAG,
    CAPS_OPERATORS,
    HEADER,
    LEEWAY,
    TTL,
    Kit,
    make_kit,
)
from trace_core.api import create_app
from trace_core.authoring.events import DatasetEvent, parse_events
from trace_core.clock import ManualClock
from trace_core.dag import DeployResult, parse_dag
from trace_core.dispatcher.buffer import InMemoryDatasetBuffer
from trace_core.dispatcher.service import Dispatcher
from trace_core.errors import ConfigurationError, InvalidTransition, StaleClaim
from trace_core.model import Fence
from trace_core.security import (
    JwksUnavailable,
    LocalCredentialMinter,
    MintedCredentials,
    TokenVerifier,
    parse_jwks,
)
from trace_core.storage import schema
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio

BASE = "http://trace.test"
SCHEMA_HASH = "sha256:" + "ab" * 32
LEASE_EXPIRY = 61.0  # the source's heartbeat timeout is 60 s
BACKOFF = 120.0  # past the first retry's backoff, well within the token TTL


@dataclass
class Claimed:
    """One claimed attempt, as ``/internal/task-claim`` answered it."""

    task_id: uuid.UUID
    attempt: int
    lease_token: str
    token: str
    task: dict[str, Any]


@dataclass
class TaskApi:
    """A Dispatcher issuing capabilities and its app, with the capability DAG deployed."""

    dispatcher: Dispatcher
    deployed: DeployResult
    kit: Kit
    app: Any
    client: httpx.AsyncClient

    @property
    def clock(self) -> ManualClock:
        return self.kit.clock

    def dataset(self, name: str) -> uuid.UUID:
        return self.deployed.datasets[name].dataset_uuid

    async def trigger(self, key: str) -> uuid.UUID:
        response = await self.client.post(
            "/internal/trigger", json={"job": "caps/follow", "key": key}, headers=AUTH
        )
        assert response.status_code == 200, response.text
        return uuid.UUID(response.json()["task_id"])

    async def claim(self, task_id: uuid.UUID, worker: str = "worker-1") -> Claimed:
        response = await self.client.post(
            "/internal/task-claim",
            json={"task_id": str(task_id), "worker_id": worker},
            headers=AUTH,
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["status"] == "Claimed", body
        task = body["task"]
        return Claimed(
            task_id, body["attempt"], body["lease_token"], task["capability_token"], task
        )

    async def running(self, key: str = "run-1") -> Claimed:
        return await self.claim(await self.trigger(key))

    async def reclaim(self, claimed: Claimed) -> Claimed:
        """Let the attempt's lease expire, retry the task and claim its next attempt."""
        self.clock.advance(LEASE_EXPIRY)
        await self.dispatcher.reaper.run_once()
        self.clock.advance(BACKOFF)
        await self.dispatcher.retries.run_once()
        second = await self.claim(claimed.task_id, "worker-2")
        assert second.attempt == claimed.attempt + 1
        return second

    async def call(
        self, route: str, body: dict[str, Any], token: str | None, **headers: str
    ) -> httpx.Response:
        sent = dict(headers)
        if token is not None:
            sent[HEADER] = token
        return await self.client.post(f"/v1/task/{route}", json=body, headers=sent)


@pytest.fixture
async def api(repo: SqlRepository, clock: ManualClock) -> AsyncIterator[TaskApi]:
    kit = make_kit(clock)
    dispatcher = Dispatcher(
        repo, operators=CAPS_OPERATORS, clock=clock, capabilities=kit.issuer(repo)
    )
    deployed = await dispatcher.deploy(parse_dag(CAPS_DAG, operators=CAPS_OPERATORS.names()))
    app = create_app(
        dispatcher,
        internal_token=TOKEN,
        jwks=kit.ring.jwks,
        verifier=kit.verifier,
        minter=kit.minter,
        buffer=kit.buffer,
    )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE) as client:
        yield TaskApi(dispatcher, deployed, kit, app, client)


# --- the body of each route, for a claimed attempt ----------------------------------


def _heartbeat(api: TaskApi, c: Claimed) -> dict[str, Any]:
    return {"task_id": str(c.task_id), "attempt": c.attempt, "lease_token": c.lease_token}


def _complete(api: TaskApi, c: Claimed) -> dict[str, Any]:
    return {**_heartbeat(api, c), "status": "Completed", "outputs": [{"output_index": 0}]}


def _events(api: TaskApi, c: Claimed) -> dict[str, Any]:
    blocks = api.deployed.datasets["blocks"]
    event = {
        "dataset_uuid": str(blocks.dataset_uuid),
        "dataset_version": str(blocks.dataset_version),
        "cursor": 10,
    }
    return {"task_id": str(c.task_id), "attempt": c.attempt, "events": [event]}


def _buffer_publish(api: TaskApi, c: Claimed) -> dict[str, Any]:
    return {
        "task_id": str(c.task_id),
        "attempt": c.attempt,
        "dataset_uuid": str(api.dataset("alerts")),
        "schema_hash": SCHEMA_HASH,
        "records": [{"dedupe_key": "a:1", "severity": "warning"}],
    }


def _credentials(api: TaskApi, c: Claimed) -> dict[str, Any]:
    return {"task_id": str(c.task_id), "attempt": c.attempt}


ROUTES: dict[str, Callable[[TaskApi, Claimed], dict[str, Any]]] = {
    "heartbeat": _heartbeat,
    "complete": _complete,
    "events": _events,
    "buffer-publish": _buffer_publish,
    "credentials": _credentials,
}


def _refused(response: httpx.Response, reason: str, *tokens: str) -> None:
    assert response.status_code == 401, response.text
    body = response.json()
    assert body["error"] == "invalid_capability" and body["reason"] == reason, body
    assert body["field"] == HEADER
    for token in tokens:
        assert token not in response.text
        for part in token.split("."):
            assert part not in response.text


# --- issuing at claim ---------------------------------------------------------------


async def test_the_claim_answer_carries_a_token_for_that_attempt(api: TaskApi) -> None:
    claimed = await api.running()
    claims = await api.kit.verifier.verify_for_task(claimed.token, claimed.task_id, 1)
    locations = {o["dataset_uuid"]: o["location"] for o in claimed.task["outputs"]}
    s3 = [locations[str(api.dataset(name))] for name in ("blocks", "logs")]
    assert claims.output_prefixes == tuple(s3)
    assert claims.scratch_prefix == f"s3://trace-lite/default/scratch/{claimed.task_id}/1/"
    # A reactive task's token carries its inputs with their locations.
    events = await api.call("events", _events(api, claimed), claimed.token)
    assert events.status_code == 200, events.text
    await api.dispatcher.run_once()
    t = schema.tasks
    async with api.dispatcher.repo.read() as tx:
        enrich_id = (
            await tx.connection.execute(
                sa.select(t.c.id).where(t.c.job_id == api.deployed.jobs["enrich"])
            )
        ).scalar_one()
    enrich = await api.claim(enrich_id)
    claims = await api.kit.verifier.verify_for_task(enrich.token, enrich_id, 1)
    assert [i.location for i in claims.inputs] == [i["location"] for i in enrich.task["inputs"]]
    assert claims.inputs[0].s3_prefix is not None and claims.inputs[0].where == "number > 10"
    assert claims.inputs[1].postgres_table is not None
    assert claims.output_prefixes == (locations_of(enrich.task)[str(api.dataset("enriched"))],)


def locations_of(task: dict[str, Any]) -> dict[str, str]:
    return {o["dataset_uuid"]: o["location"] for o in task["outputs"]}


async def test_the_v1_worker_claim_carries_a_token_too(api: TaskApi) -> None:
    task_id = await api.trigger("run-1")
    response = await api.client.post(
        "/internal/worker/claim",
        json={"worker_id": "w", "streams": ["trace-ecs-udf"], "max_wait_ms": 0},
        headers=AUTH,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["claimed"] is True and body["job_id"] == str(task_id)
    token = body["payload"]["capability_token"]
    claims = await api.kit.verifier.verify_for_task(token, task_id, body["attempt_id"])
    assert claims.attempt == 1


# --- every route: the right token, and every wrong one --------------------------------


@pytest.mark.parametrize("route", ROUTES)
async def test_each_route_works_with_the_attempts_token(api: TaskApi, route: str) -> None:
    claimed = await api.running()
    response = await api.call(route, ROUTES[route](api, claimed), claimed.token)
    assert response.status_code == 200, response.text
    assert claimed.token not in response.text


@pytest.mark.parametrize("route", ROUTES)
async def test_each_route_refuses_a_missing_token_even_with_the_internal_one(
    api: TaskApi, route: str
) -> None:
    claimed = await api.running()
    body = ROUTES[route](api, claimed)
    _refused(await api.call(route, body, None), "missing")
    _refused(await api.call(route, body, None, **AUTH), "missing")
    # The internal token presented as a capability is just a malformed token.
    _refused(await api.call(route, body, TOKEN), "malformed", TOKEN)


@pytest.mark.parametrize("route", ROUTES)
async def test_each_route_refuses_another_tasks_token(api: TaskApi, route: str) -> None:
    mine, other = await api.running("run-1"), await api.running("run-2")
    response = await api.call(route, ROUTES[route](api, mine), other.token)
    _refused(response, "wrong_task", other.token)


@pytest.mark.parametrize("route", ROUTES)
async def test_each_route_refuses_an_expired_token(api: TaskApi, route: str) -> None:
    claimed = await api.running()
    api.clock.advance(TTL + LEEWAY)
    response = await api.call(route, ROUTES[route](api, claimed), claimed.token)
    _refused(response, "expired", claimed.token)


@pytest.mark.parametrize("route", ROUTES)
async def test_each_route_refuses_the_previous_attempts_token_after_a_reclaim(
    api: TaskApi, route: str
) -> None:
    first = await api.running()
    second = await api.reclaim(first)
    # The old token, for its own (superseded) attempt: revoked by the reclaim.
    stale = await api.call(route, ROUTES[route](api, first), first.token)
    _refused(stale, "superseded", first.token)
    # The old token, for the new attempt: not its attempt.
    borrowed = await api.call(route, ROUTES[route](api, second), first.token)
    _refused(borrowed, "wrong_task", first.token)
    # The new attempt's own token works.
    fresh = await api.call(route, ROUTES[route](api, second), second.token)
    assert fresh.status_code == 200, fresh.text


@pytest.mark.parametrize("route", ROUTES)
async def test_each_route_refuses_tampered_and_garbage_tokens(api: TaskApi, route: str) -> None:
    claimed = await api.running()
    body = ROUTES[route](api, claimed)
    head, payload, signature = claimed.token.split(".")
    flipped = signature[:-2] + ("AA" if signature[-2:] != "AA" else "BA")
    _refused(await api.call(route, body, f"{head}.{payload}.{flipped}"), "bad_signature")
    _refused(await api.call(route, body, "x" * 9000), "oversized")
    _refused(await api.call(route, body, ""), "malformed")
    twice = await api.client.post(
        f"/v1/task/{route}",
        json=body,
        headers=[(HEADER, claimed.token), (HEADER, claimed.token)],
    )
    _refused(twice, "malformed", claimed.token)


async def test_a_token_is_checked_before_the_body_is_looked_at(api: TaskApi) -> None:
    response = await api.client.post(
        "/v1/task/heartbeat", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    _refused(response, "missing")
    unknown = await api.client.post("/v1/task/no-such-route", json={})
    _refused(unknown, "missing")
    claimed = await api.running()
    malformed = await api.client.post(
        "/v1/task/heartbeat",
        content=b"{not json",
        headers={"Content-Type": "application/json", HEADER: claimed.token},
    )
    assert malformed.status_code == 400 and malformed.json()["field"] == "body"


# --- buffer-publish -----------------------------------------------------------------


async def test_buffer_publish_delivers_to_the_buffer(api: TaskApi) -> None:
    claimed = await api.running()
    body = _buffer_publish(api, claimed)
    response = await api.call("buffer-publish", body, claimed.token)
    assert response.status_code == 200, response.text
    assert response.json() == {"ok": True, "dataset_uuid": body["dataset_uuid"], "records": 1}
    [batch] = api.kit.buffer.batches(api.dataset("alerts"))
    assert batch.records == tuple(body["records"]) and batch.schema_hash == SCHEMA_HASH
    assert (batch.producer_task_id, batch.attempt) == (claimed.task_id, 1)


@pytest.mark.parametrize(
    ("dataset", "error"),
    [
        ("flags", "not_an_output"),  # another job's Postgres output
        (None, "not_an_output"),  # no such dataset at all
        ("blocks", "not_buffered"),  # the task's own output, but stored in S3
    ],
)
async def test_buffer_publish_only_reaches_the_tasks_postgres_outputs(
    api: TaskApi, dataset: str | None, error: str
) -> None:
    claimed = await api.running()
    target = api.dataset(dataset) if dataset else uuid.uuid4()
    body = {**_buffer_publish(api, claimed), "dataset_uuid": str(target)}
    response = await api.call("buffer-publish", body, claimed.token)
    assert response.status_code == 403, response.text
    assert response.json()["error"] == error
    assert api.kit.buffer.batches() == []


async def test_a_finished_attempt_publishes_nothing_and_gets_no_credentials(
    api: TaskApi,
) -> None:
    claimed = await api.running()
    done = await api.call("complete", _complete(api, claimed), claimed.token)
    assert done.status_code == 200, done.text
    for route in ("buffer-publish", "credentials"):
        response = await api.call(route, ROUTES[route](api, claimed), claimed.token)
        assert response.status_code == 409, response.text
        assert response.json()["error"] == "not_running"
    # The report itself stays idempotent.
    again = await api.call("complete", _complete(api, claimed), claimed.token)
    assert again.status_code == 200 and again.json()["duplicate"] is True


# --- an ended attempt: refused everywhere, nothing stored (issue 14, section 4) -------

ENDINGS = ("completed", "failed", "failed_fatal", "failed_requeued", "canceled", "dead_lettered")
"""Every way an attempt ends other than the timeout mark."""


async def _end(api: TaskApi, claimed: Claimed, how: str) -> None:
    if how == "completed":
        done = await api.call("complete", _complete(api, claimed), claimed.token)
        assert done.status_code == 200, done.text
    elif how.startswith("failed"):
        report = {
            **_heartbeat(api, claimed),
            "status": "Failed",
            "error_message": "boom",
            "retryable": how != "failed_fatal",
        }
        failed = await api.call("complete", report, claimed.token)
        assert failed.status_code == 200, failed.text
        if how == "failed_requeued":
            api.clock.advance(BACKOFF)
            await api.dispatcher.retries.run_once()
    elif how == "canceled":
        assert await api.dispatcher.tasks.cancel([claimed.task_id]) == {claimed.task_id}
    else:
        dead = await api.dispatcher.tasks.leases.dead_letter([claimed.task_id], reason="operator")
        assert dead == {claimed.task_id}


async def _stored(api: TaskApi) -> dict[str, list[str]]:
    """Every row of what an accepted event or report writes: events, coverage,
    outbox rows and tasks (downstream tasks included)."""
    tables = (schema.events, schema.dataset_version_progress, schema.outbox, schema.tasks)
    async with api.dispatcher.repo.read() as tx:
        conn = tx.connection
        return {
            t.name: sorted(str(tuple(r)) for r in (await conn.execute(sa.select(t))).all())
            for t in tables
        }


def _final_events(api: TaskApi, c: Claimed) -> dict[str, Any]:
    return {**_complete(api, c), "events": _events(api, c)["events"]}


@pytest.mark.parametrize("how", ENDINGS)
async def test_an_ended_attempt_is_refused_on_every_route_and_stores_nothing(
    api: TaskApi, how: str
) -> None:
    """The capability token of a finished attempt is still valid; the attempt
    is not current any more (interface-contracts.md, "Worker → Dispatcher")."""
    claimed = await api.running()
    await _end(api, claimed, how)
    status = (await api.dispatcher.tasks.leases.inspect(claimed.task_id)).status
    await api.dispatcher.run_once()  # whatever the ending left to route
    before = await _stored(api)
    batches = len(api.kit.buffer.batches())
    calls = [(route, ROUTES[route](api, claimed)) for route in ROUTES]
    calls.append(("complete", _final_events(api, claimed)))
    for route, body in calls:
        response = await api.call(route, body, claimed.token)
        if how == "completed" and route == "complete":
            # The repeated report of the recorded completion stays idempotent.
            assert response.status_code == 200, response.text
            assert response.json()["duplicate"] is True and response.json()["event_ids"] == []
        else:
            assert response.status_code == 409, (route, status, response.text)
            assert "secret_access_key" not in response.text
    # The internal routes and the in-process calls answer the same.
    internal = [
        ("/internal/events", _events(api, claimed)),
        ("/internal/task-complete", _final_events(api, claimed)),
    ]
    for path, body in internal:
        response = await api.client.post(path, json=body, headers=AUTH)
        expected = 200 if how == "completed" and path.endswith("complete") else 409
        assert response.status_code == expected, (path, status, response.text)
    events = to_events_of(api, claimed)
    with pytest.raises((StaleClaim, InvalidTransition)):
        await api.dispatcher.control.emit(claimed.task_id, claimed.attempt, events)
    fence = Fence(claimed.task_id, claimed.attempt, uuid.UUID(claimed.lease_token))
    with pytest.raises((StaleClaim, InvalidTransition)):
        await api.dispatcher.control.complete(fence, events=events)
    with pytest.raises((StaleClaim, InvalidTransition)):
        await api.dispatcher.control.heartbeat(fence)
    await api.dispatcher.run_once()  # routing: nothing new to route
    assert await _stored(api) == before
    assert len(api.kit.buffer.batches()) == batches
    assert (await api.dispatcher.tasks.leases.inspect(claimed.task_id)).status == status


def to_events_of(api: TaskApi, c: Claimed) -> list[DatasetEvent]:
    return parse_events(_events(api, c)["events"])


async def test_a_timed_out_attempt_may_still_reply_until_a_newer_attempt_starts(
    api: TaskApi,
) -> None:
    """The late-reply allowance: marked timed out (the reaper failed the
    expired lease), no newer attempt yet: events and the completion count."""
    claimed = await api.running()
    api.clock.advance(LEASE_EXPIRY)
    assert (await api.dispatcher.reaper.run_once()).expired == 1
    assert (await api.dispatcher.tasks.leases.inspect(claimed.task_id)).status == "Failed"
    # The attempt is not running: no heartbeat, no data access.
    for route in ("heartbeat", "buffer-publish", "credentials"):
        response = await api.call(route, ROUTES[route](api, claimed), claimed.token)
        assert response.status_code == 409, (route, response.text)
    events = await api.call("events", _events(api, claimed), claimed.token)
    assert events.status_code == 200 and events.json()["new"] == 1, events.text
    done = await api.call("complete", _final_events(api, claimed), claimed.token)
    assert done.status_code == 200 and done.json()["duplicate"] is False, done.text
    assert (await api.dispatcher.tasks.leases.inspect(claimed.task_id)).status == "Completed"
    # Completed now: the attempt has ended, further events are refused.
    again = await api.call("events", _events(api, claimed), claimed.token)
    assert again.status_code == 409, again.text


# --- credentials ----------------------------------------------------------------------


async def test_credentials_are_scoped_to_the_token(api: TaskApi) -> None:
    claimed, other = await api.running("run-1"), await api.running("run-2")
    response = await api.call("credentials", _credentials(api, claimed), claimed.token)
    assert response.status_code == 200, response.text
    assert response.headers["cache-control"] == "no-store"
    body = response.json()
    claims = await api.kit.verifier.verify(claimed.token)
    minted = MintedCredentials(
        access_key_id=body["access_key_id"],
        secret_access_key=body["secret_access_key"],
        session_token=body["session_token"],
        expiration=datetime.fromisoformat(body["expiration"]),
        scope=claims.scope(),
    )
    assert minted.expiration.timestamp() == api.clock.now().timestamp() + 900
    check = api.kit.minter.check
    blocks, logs = claims.output_prefixes
    assert check(minted, "write", blocks + "part-0.parquet")
    assert check(minted, "write", logs + "part-0.parquet")
    assert check(minted, "write", claims.scratch_prefix + "tmp/x")
    assert check(minted, "read", claims.scratch_prefix + "tmp/x")
    assert not check(minted, "read", blocks + "part-0.parquet")  # write does not imply read
    other_claims = await api.kit.verifier.verify(other.token)
    assert not check(minted, "write", other_claims.scratch_prefix + "tmp/x")
    assert not check(minted, "read", other_claims.scratch_prefix + "tmp/x")
    enriched = api.deployed.datasets["enriched"]
    foreign = f"s3://trace-lite/default/dataset/{enriched.dataset_uuid}/version/"
    assert not check(minted, "write", foreign + f"{enriched.dataset_version}/part-0.parquet")
    assert not check(minted, "list", "s3://trace-lite/")


async def test_credentials_duration_is_bounded(api: TaskApi) -> None:
    claimed = await api.running()
    for duration, status in ((899, 400), (3601, 400), ("900", 400), (3600, 200)):
        body = {**_credentials(api, claimed), "duration_seconds": duration}
        response = await api.call("credentials", body, claimed.token)
        assert response.status_code == status, response.text


async def test_no_token_or_secret_reaches_the_logs(
    api: TaskApi, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    claimed = await api.running()
    response = await api.call("credentials", _credentials(api, claimed), claimed.token)
    secrets = [response.json()["secret_access_key"], response.json()["session_token"]]
    other = await api.running("run-2")
    await api.call("heartbeat", _heartbeat(api, claimed), other.token)  # refused
    api.clock.advance(TTL + LEEWAY)
    await api.call("heartbeat", _heartbeat(api, claimed), claimed.token)  # expired
    for secret in (claimed.token, other.token, *secrets):
        assert secret not in caplog.text


# --- what is mounted, and how it is described ---------------------------------------------


class Outage:
    """A key source whose JWKS endpoint is down."""

    async def public_key(self, kid: str) -> Any:
        raise JwksUnavailable("the JWKS endpoint is down")


async def test_an_unavailable_jwks_is_a_503_to_retry(api: TaskApi) -> None:
    claimed = await api.running()
    verifier = TokenVerifier(Outage(), "trace-test", "trace-task", api.clock)
    app = create_app(api.dispatcher, internal_token=TOKEN, verifier=verifier)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE) as client:
        response = await client.post(
            "/v1/task/heartbeat", json=_heartbeat(api, claimed), headers={HEADER: claimed.token}
        )
    assert response.status_code == 503, response.text
    assert response.json()["reason"] == "jwks_unavailable"
    assert response.headers["retry-after"] == "1"


async def test_without_a_verifier_no_task_route_exists(api: TaskApi) -> None:
    claimed = await api.running()
    app = create_app(api.dispatcher, internal_token=TOKEN)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE) as client:
        anonymous = await client.post(
            "/v1/task/heartbeat", json=_heartbeat(api, claimed), headers={HEADER: claimed.token}
        )
        assert anonymous.status_code == 401 and anonymous.json()["error"] == "unauthorized"
        internal = await client.post(
            "/v1/task/heartbeat", json=_heartbeat(api, claimed), headers=AUTH
        )
        assert internal.status_code == 404
    with pytest.raises(ConfigurationError, match="verifier"):
        create_app(api.dispatcher, internal_token=TOKEN, minter=LocalCredentialMinter())
    with pytest.raises(ConfigurationError, match="verifier"):
        create_app(api.dispatcher, internal_token=TOKEN, buffer=InMemoryDatasetBuffer())


async def test_credentials_and_buffer_routes_need_their_backends(api: TaskApi) -> None:
    claimed = await api.running()
    app = create_app(api.dispatcher, internal_token=TOKEN, verifier=api.kit.verifier)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE) as client:
        for route in ("credentials", "buffer-publish"):
            response = await client.post(
                f"/v1/task/{route}",
                json=ROUTES[route](api, claimed),
                headers={HEADER: claimed.token},
            )
            assert response.status_code == 404, response.text
        beat = await client.post(
            "/v1/task/heartbeat", json=_heartbeat(api, claimed), headers={HEADER: claimed.token}
        )
        assert beat.status_code == 200, beat.text


async def test_the_document_declares_the_capability_scheme_on_task_routes(api: TaskApi) -> None:
    document = api.app.openapi()
    scheme = document["components"]["securitySchemes"]["taskCapability"]
    assert scheme == {**scheme, "type": "apiKey", "in": "header", "name": HEADER}
    task_paths = [p for p in document["paths"] if p.startswith("/v1/task/")]
    state = ("state/read", "state/write")  # operator state: tests/test_task_state_http.py
    assert sorted(task_paths) == sorted(f"/v1/task/{r}" for r in (*ROUTES, *state))
    for path, item in document["paths"].items():
        for operation in item.values():
            expected = "taskCapability" if path.startswith("/v1/task/") else "internalBearer"
            assert operation["security"] == [{expected: []}], path
            assert {"400", "401", "413", "503"} <= set(operation["responses"]), path


# --- trace-lite serve -----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def _deploy(database_url: str) -> None:
    repo = SqlRepository(database_url)
    try:
        dispatcher = Dispatcher(repo, operators=CAPS_OPERATORS)
        await dispatcher.deploy(parse_dag(CAPS_DAG, operators=CAPS_OPERATORS.names()))
    finally:
        await repo.close()


@pytest.mark.parametrize("engine", ["sqlite"])
def test_serve_issues_and_honours_capability_tokens(database_url: str, tmp_path: Path) -> None:
    anyio.run(_deploy, database_url)
    data_dir = tmp_path / "data"
    port = _free_port()
    env = {**os.environ, "TRACE_INTERNAL_TOKEN": TOKEN}
    command = [sys.executable, "-m", "trace_lite.cli", "serve", "--db", database_url]
    command += ["--port", str(port), "--data-dir", str(data_dir)]
    server = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
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
    secrets: list[str] = []
    try:
        while True:  # the startup line, or the end of the output: bounded by the timeout
            line = lines.get(timeout=60)
            assert line is not None, "serve exited before starting:\n" + "".join(seen)
            seen.append(line)
            if "Application startup complete" in line:
                break
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=10) as client:
            jwks = client.get("/internal/jwks/task", headers=AUTH).json()
            assert len(parse_jwks(jwks)) == 1
            run = client.post(
                "/internal/trigger", json={"job": "caps/follow", "key": "k"}, headers=AUTH
            )
            task_id = run.json()["task_id"]
            claim = client.post(
                "/internal/task-claim",
                json={"task_id": task_id, "worker_id": "w"},
                headers=AUTH,
            ).json()
            token = claim["task"]["capability_token"]
            secrets.append(token)
            body = {"task_id": task_id, "attempt": 1, "lease_token": claim["lease_token"]}
            beat = client.post("/v1/task/heartbeat", json=body, headers={HEADER: token})
            assert beat.status_code == 200, beat.text
            internal_only = client.post("/v1/task/heartbeat", json=body, headers=AUTH)
            assert internal_only.status_code == 401
            minted = client.post(
                "/v1/task/credentials",
                json={"task_id": task_id, "attempt": 1},
                headers={HEADER: token},
            )
            assert minted.status_code == 200, minted.text
            secrets += [minted.json()["secret_access_key"], minted.json()["session_token"]]
    finally:
        server.terminate()
        code = server.wait(timeout=60)
    while (line := lines.get(timeout=60)) is not None:
        seen.append(line)
    reader.join(timeout=60)
    assert server.stderr is not None
    server.stderr.close()
    output = "".join(seen)
    assert code in (0, -signal.SIGTERM), output
    for secret in (TOKEN, *secrets):
        assert secret not in output
    keys = data_dir / "keys"
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert json.loads((keys / "keys.json").read_text())["keys"][0]["bootstrap"] is True
    assert stat.S_IMODE((data_dir / "credentials.key").stat().st_mode) == 0o600
