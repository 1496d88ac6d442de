"""The light dispatch of the worker's hot routes (``trace_core.api.hot_routes``),
on both engines: it answers exactly what FastAPI's own path answers, every
error body included, and hands anything malformed to FastAPI."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from tests.api_fixtures import AUTH, TOKEN
from tests.capability_fixtures import CAPS_DAG, CAPS_OPERATORS, HEADER, make_kit
from trace_core.api import create_app
from trace_core.api.hot_routes import HOT_PATHS, HotRoutes, hot_routes
from trace_core.api.internal import internal_router
from trace_core.api.streams import StreamClaimer
from trace_core.api.task_scoped import task_router
from trace_core.api.worker_v1 import worker_router
from trace_core.clock import ManualClock
from trace_core.dag import parse_dag
from trace_core.dispatcher.service import Dispatcher
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio

BASE = "http://trace.test"
FAST = {"Content-Type": "application/json"}
# FastAPI takes this content type as JSON too; the light dispatch leaves it to FastAPI.
SLOW = {"Content-Type": "application/json; charset=utf-8"}
TEAPOT = 418


@dataclass
class Served:
    dispatcher: Dispatcher
    client: httpx.AsyncClient

    async def claimed(self, key: str) -> dict[str, Any]:
        made = await self.client.post(
            "/internal/trigger", json={"job": "caps/follow", "key": key}, headers=AUTH
        )
        assert made.status_code == 200, made.text
        task_id = made.json()["task_id"]
        answer = await self.client.post(
            "/internal/task-claim", json={"task_id": task_id, "worker_id": "w"}, headers=AUTH
        )
        assert answer.status_code == 200 and answer.json()["status"] == "Claimed", answer.text
        body: dict[str, Any] = answer.json()
        return body

    async def post(
        self, path: str, body: bytes, kind: dict[str, str], token: str | None = None
    ) -> httpx.Response:
        headers = {**kind, **(AUTH if token is None else {HEADER: token})}
        return await self.client.post(path, content=body, headers=headers)


@pytest.fixture
async def served(repo: SqlRepository, clock: ManualClock) -> AsyncIterator[Served]:
    kit = make_kit(clock)
    dispatcher = Dispatcher(
        repo, operators=CAPS_OPERATORS, clock=clock, capabilities=kit.issuer(repo)
    )
    await dispatcher.deploy(parse_dag(CAPS_DAG, operators=CAPS_OPERATORS.names()))
    app = create_app(dispatcher, internal_token=TOKEN, jwks=kit.ring.jwks, verifier=kit.verifier)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE) as client:
        yield Served(dispatcher, client)


def _fence(claimed: dict[str, Any], **changed: Any) -> bytes:
    fence = {
        "task_id": claimed["task"]["task_id"],
        "attempt": claimed["attempt"],
        "lease_token": claimed["lease_token"],
        **changed,
    }
    return httpx.Request("POST", BASE, json=fence).content


async def test_every_hot_path_is_derived_from_its_fastapi_route(repo: SqlRepository) -> None:
    dispatcher = Dispatcher(repo, operators=CAPS_OPERATORS)
    worker = worker_router(dispatcher, StreamClaimer(dispatcher), max_wait_ms=1000)
    routes = [*internal_router(dispatcher).routes, *task_router(dispatcher).routes, *worker.routes]
    assert set(hot_routes(routes)) == HOT_PATHS


async def test_errors_of_the_hot_routes_read_as_fastapis(served: Served) -> None:
    claimed = await served.claimed("errors")
    token = claimed["task"]["capability_token"]
    unknown = str(uuid.uuid4())
    other = str(uuid.uuid4())  # a well-formed lease token, not the attempt's
    cases: list[tuple[str, bytes, str | None, int]] = [
        ("/internal/heartbeat", _fence(claimed, lease_token=other), None, 409),
        ("/internal/heartbeat", _fence(claimed, lease_token="not-a-lease"), None, 400),
        ("/internal/heartbeat", _fence(claimed, task_id=unknown), None, 404),
        ("/internal/heartbeat", _fence(claimed, attempt=0), None, 400),  # attempt
        ("/internal/heartbeat", b'{"task_id": ', None, 400),  # invalid JSON
        ("/internal/task-claim", b'{"task_id": "x", "worker_id": "w"}', None, 400),  # task_id
        ("/internal/task-complete", _fence(claimed, status="Canceled"), None, 409),
        ("/internal/task-complete", _fence(claimed, status="Sideways"), None, 400),  # status
        ("/v1/task/heartbeat", _fence(claimed, lease_token=other), token, 409),
        ("/v1/task/heartbeat", _fence(claimed, attempt=2), token, 401),  # wrong_task
        ("/v1/task/complete", _fence(claimed, status="Completed", events=7), token, 400),
    ]
    for path, body, capability, expected in cases:
        fast = await served.post(path, body, FAST, capability)
        slow = await served.post(path, body, SLOW, capability)
        assert fast.status_code == expected, (path, body, fast.text)
        assert (fast.status_code, fast.json()) == (slow.status_code, slow.json()), (path, body)
        assert fast.headers["content-type"] == slow.headers["content-type"]


async def test_the_hot_triples_answer_as_fastapis(served: Served) -> None:
    """The same triple, once per path: the same answers but for the per-task values."""
    answers: list[list[dict[str, Any]]] = []
    for key, kind in (("fast", FAST), ("slow", SLOW)):
        claimed = await served.claimed(key)
        token = claimed["task"]["capability_token"]
        internal = await served.post("/internal/heartbeat", _fence(claimed), kind)
        scoped = await served.post("/v1/task/heartbeat", _fence(claimed), kind, token)
        done = await served.post(
            "/v1/task/complete", _fence(claimed, status="Completed"), kind, token
        )
        again = await served.post(
            "/internal/task-complete", _fence(claimed, status="Completed"), kind
        )
        assert [r.status_code for r in (internal, scoped, done, again)] == [200] * 4
        answers.append([r.json() for r in (internal, scoped, done, again)])
    fast, slow = answers
    for mine, theirs in zip(fast, slow, strict=True):
        assert mine.keys() == theirs.keys()
        same = {k: v for k, v in mine.items() if k not in ("task_id", "lease_expires_at")}
        assert same == {k: v for k, v in theirs.items() if k in same}
    assert fast[3]["duplicate"] is True and fast[2]["duplicate"] is False


async def test_only_well_formed_requests_skip_fastapi(served: Served, repo: SqlRepository) -> None:
    """Around an app that answers 418 to whatever reaches it: a well-formed hot
    request is answered (its errors by the app's handlers), the rest is passed on."""
    dispatcher = served.dispatcher
    app = create_app(dispatcher, internal_token=TOKEN)

    async def teapot(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": TEAPOT, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    light = HotRoutes(
        teapot,
        routes=hot_routes(internal_router(dispatcher).routes),
        handlers=app.exception_handlers,
    )
    claimed = await served.claimed("light")
    other = str(uuid.uuid4())
    transport = httpx.ASGITransport(app=light)
    async with httpx.AsyncClient(transport=transport, base_url=BASE) as client:

        async def status(path: str, body: bytes, kind: dict[str, str] = FAST) -> int:
            return (await client.post(path, content=body, headers=kind)).status_code

        assert await status("/internal/heartbeat", _fence(claimed)) == 200
        assert await status("/internal/heartbeat", _fence(claimed, lease_token=other)) == 409
        assert await status("/internal/heartbeat", _fence(claimed, attempt=0)) == TEAPOT
        assert await status("/internal/heartbeat", b"{") == TEAPOT
        assert await status("/internal/heartbeat", _fence(claimed), SLOW) == TEAPOT
        assert await status("/internal/task-fetch", _fence(claimed)) == TEAPOT
        assert (await client.get("/internal/heartbeat")).status_code == TEAPOT
