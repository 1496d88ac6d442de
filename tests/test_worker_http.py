"""The worker wrapper over HTTP (``/internal/*`` of the FastAPI app, through an
in-process ASGI transport), on both engines: the same scenarios as the
in-process client, plus the HTTP error mapping and an outage of the app."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import anyio
import httpx
import pytest

from tests.test_worker_wrapper import (
    FakeTime,
    Platform,
    Ticker,
    deploy_platform,
    retrying,
    wait_for,
    wrapper_for,
)
from trace_core.api import create_app
from trace_core.authoring.context import OperatorResult, TaskContext
from trace_core.authoring.events import DatasetEvent
from trace_core.clock import ManualClock
from trace_core.errors import InvalidInput, NotFound, StaleClaim
from trace_core.model import Fence
from trace_core.storage.sql import SqlRepository
from trace_core.worker import (
    ClaimResult,
    ControlPlaneRejected,
    ControlPlaneUnavailable,
    HttpControlPlaneClient,
)

pytestmark = pytest.mark.anyio

TOKEN = "worker-http-test-token-0123456789"
BASE = "http://trace.test"


class Outage(httpx.AsyncBaseTransport):
    """Fails the first requests to a path as planned (a status, or ``"connect"``
    for a refused connection), then passes everything to ``inner``."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.plans: dict[str, list[int | str]] = {}
        self.seen: list[tuple[str, int | str]] = []
        self.requests: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request.url.path)
        plan = self.plans.get(request.url.path)
        if plan:
            step = plan.pop(0)
            self.seen.append((request.url.path, step))
            if step == "connect":
                raise httpx.ConnectError("connection refused", request=request)
            if step == 502:  # a load balancer's page, not the app's JSON
                return httpx.Response(502, text="<html>Bad Gateway</html>")
            body = {"error": "unavailable", "reason": "database unavailable"}
            return httpx.Response(int(step), json=body, headers={"Retry-After": "1"})
        return await self.inner.handle_async_request(request)


@pytest.fixture
def ticker() -> Iterator[Ticker]:
    ticks = Ticker()
    yield ticks
    ticks.close()


@dataclass
class Http:
    platform: Platform
    transport: Outage
    client: HttpControlPlaneClient
    http: httpx.AsyncClient

    def with_token(self, token: str) -> HttpControlPlaneClient:
        return HttpControlPlaneClient(BASE, token, http=self.http)


@pytest.fixture
async def http(repo: SqlRepository, clock: ManualClock) -> AsyncIterator[Http]:
    platform = await deploy_platform(repo, clock)
    app = create_app(platform.dispatcher, internal_token=TOKEN)
    transport = Outage(httpx.ASGITransport(app=app))
    async with httpx.AsyncClient(transport=transport) as client:
        yield Http(platform, transport, HttpControlPlaneClient(BASE, TOKEN, http=client), client)


async def _run_while(
    wakeup: Callable[[], Any], started: anyio.Event, meanwhile: Callable[[], Any]
) -> str:
    """Start a wake-up, do ``meanwhile`` once its operator runs, return the outcome."""
    outcome: list[str] = []
    async with anyio.create_task_group() as group:

        async def run() -> None:
            outcome.append(await wakeup())

        group.start_soon(run)
        await wait_for(started)
        await meanwhile()
    return outcome[0]


async def test_wakeup_claim_run_emit_complete_over_http_then_downstream(http: Http) -> None:
    platform = http.platform
    directives: list[str] = []

    async def follow(ctx: TaskContext) -> OperatorResult:
        directives.append(await ctx.directive())  # over HTTP: a heartbeat's answer
        await ctx.emit([platform.partition(0, 9)])
        return OperatorResult(events=[platform.partition(10, 19)], outputs=[{"rows": 20}])

    def double(ctx: TaskContext) -> OperatorResult:
        unit, out = ctx.inputs[0], ctx.outputs[0]
        event = DatasetEvent(
            uuid.UUID(out["dataset_uuid"]),
            uuid.UUID(out["dataset_version"]),
            partition_key=unit["partition_key"],
            start=unit["start"],
            end=unit["end"],
        )
        return OperatorResult(events=[event])

    wrapper = wrapper_for(platform, follow, double, client=http.client)
    task_id = await platform.trigger()
    assert await wrapper.handle_wakeup(task_id) == "completed"
    assert directives == ["run"]
    row = await platform.task(task_id)
    assert row["status"] == "Completed" and row["outputs"] == [{"rows": 20}]
    assert await platform.events_of(task_id) == [("0-9", 1), ("10-19", 1)]

    await platform.dispatcher.run_once()
    for wakeup in await platform.wakeups.receive("trace-ecs-platform"):
        assert await wrapper.handle_wakeup(wakeup) == "completed"
    downstream = await platform.tasks_of("double")
    assert sorted((t["partitions"][0], t["status"]) for t in downstream) == [
        ("0-9", "Completed"),
        ("10-19", "Completed"),
    ]


async def test_not_claimed_and_canceled_over_http(http: Http) -> None:
    platform = http.platform
    calls: list[str] = []
    wrapper = wrapper_for(platform, lambda ctx: calls.append("ran"), client=http.client)
    task_id = await platform.trigger()
    assert (await platform.dispatcher.tasks.claim(task_id, "someone-else")).lease is not None
    assert await wrapper.handle_wakeup(task_id) == "AlreadyRunning"
    assert await wrapper.handle_wakeup(uuid.uuid4()) == "NotFound"

    class CanceledAfterClaim(HttpControlPlaneClient):
        """A rollback between the claim and the payload: the payload says Canceled."""

        async def claim(self, task_id: uuid.UUID, worker_id: str) -> ClaimResult:
            claimed = await super().claim(task_id, worker_id)
            await platform.dispatcher.tasks.cancel([task_id])
            return replace(claimed, task=await self.fetch(task_id))

    other = await platform.trigger("run-2")
    racing = wrapper_for(
        platform,
        lambda ctx: calls.append("ran"),
        client=CanceledAfterClaim(BASE, TOKEN, http=http.http),
    )
    http.transport.requests.clear()
    assert await racing.handle_wakeup(other) == "canceled"
    assert http.transport.requests == [  # acknowledged with status Canceled, nothing run
        "/internal/task-claim",
        "/internal/task-fetch",
        "/internal/task-complete",
    ]
    assert calls == []
    assert (await platform.task(other))["status"] == "Canceled"


async def test_a_stale_lease_over_http_aborts_and_writes_nothing(
    http: Http, ticker: Ticker
) -> None:
    platform = http.platform
    started, release = anyio.Event(), anyio.Event()

    async def follow(ctx: TaskContext) -> OperatorResult:
        await ctx.emit([platform.partition(0, 9)])
        started.set()
        await release.wait()
        await ctx.emit([platform.partition(10, 19)])
        return OperatorResult(events=[platform.partition(20, 29)])

    wrapper = wrapper_for(platform, follow, client=http.client, sleep=ticker.sleep)
    task_id = await platform.trigger()

    async def reclaim_then_beat() -> None:
        await platform.reclaim(task_id)
        ticker.tick()  # 409 stale

    assert await _run_while(lambda: wrapper.handle_wakeup(task_id), started, reclaim_then_beat) == (
        "stale"
    )
    row = await platform.task(task_id)
    assert (row["status"], row["attempt"]) == ("Running", 2)
    assert await platform.events_of(task_id) == [("0-9", 1)]

    # A completion refused as stale (the task was canceled while running).
    started, release = anyio.Event(), anyio.Event()
    other = await platform.trigger("run-2")

    async def cancel_then_release() -> None:
        await platform.dispatcher.tasks.cancel([other])
        release.set()

    async def quiet(ctx: TaskContext) -> OperatorResult:
        started.set()
        await release.wait()
        return OperatorResult(events=[platform.partition(30, 39)])

    quiet_wrapper = wrapper_for(platform, quiet, client=http.client)
    outcome = await _run_while(
        lambda: quiet_wrapper.handle_wakeup(other), started, cancel_then_release
    )
    assert outcome == "stale"
    assert (await platform.task(other))["status"] == "Canceled"
    assert await platform.events_of(other) == []


async def test_an_outage_of_the_app_is_ridden_out(http: Http, ticker: Ticker) -> None:
    platform = http.platform
    started, release = anyio.Event(), anyio.Event()

    async def follow(ctx: TaskContext) -> OperatorResult:
        await ctx.emit([platform.partition(0, 9)])
        started.set()
        await release.wait()
        return OperatorResult(events=[platform.partition(10, 19)])

    http.transport.plans = {
        "/internal/task-claim": ["connect", 503],
        "/internal/events": [502, 500],
        "/internal/heartbeat": [503],
        "/internal/task-complete": ["connect", 503, 503],
    }
    time = FakeTime()
    wrapper = wrapper_for(platform, follow, client=retrying(http.client, time), sleep=ticker.sleep)
    task_id = await platform.trigger()

    async def beat() -> None:
        ticker.tick()
        await ticker.wait_for_sleeps(2)
        release.set()

    assert await _run_while(lambda: wrapper.handle_wakeup(task_id), started, beat) == "completed"
    assert not any(http.transport.plans.values())  # every planned failure happened
    # Retry-After: 1 lifts the first backoff steps (0.5) to a second
    assert time.slept == [0.5, 1.0, 0.5, 1.0, 1.0, 0.5, 1.0, 2.0]
    assert (await platform.task(task_id))["status"] == "Completed"
    assert await platform.events_of(task_id) == [("0-9", 1), ("10-19", 1)]


async def test_http_answers_map_onto_the_client_contract(http: Http) -> None:
    platform = http.platform
    task_id = await platform.trigger()
    time = FakeTime()

    wrong = retrying(http.with_token("not-the-internal-token-at-all"), time)
    with pytest.raises(ControlPlaneRejected) as refused:
        await wrong.claim(task_id, "w")
    assert refused.value.status == 401 and time.slept == []  # never retried
    assert "not-the-internal-token" not in str(refused.value)

    with pytest.raises(NotFound):
        await http.client.fetch(uuid.uuid4())
    claimed = await http.client.claim(task_id, "w")
    assert claimed.claimed and claimed.lease_token is not None and claimed.task is not None
    assert claimed.lease_expires_at is not None and claimed.lease_expires_at.tzinfo is not None
    with pytest.raises(StaleClaim):
        await http.client.heartbeat(Fence(task_id, 1, uuid.uuid4()))  # 409 stale
    with pytest.raises(StaleClaim):
        await http.client.heartbeat(
            Fence(uuid.uuid4(), 1, claimed.lease_token)
        )  # 404 on a fenced call
    with pytest.raises(InvalidInput) as invalid:
        await http.client.emit(task_id, 1, [platform.partition(0, 9, dataset="doubled")])
    assert invalid.value.field.startswith("events[0]")
    with pytest.raises(ControlPlaneRejected) as conflict:
        await http.client.report_canceled(task_id, 1)
    assert (conflict.value.status, conflict.value.error) == (409, "not_canceled")

    http.transport.plans = {"/internal/heartbeat": ["connect", 503, 502]}
    for _ in range(3):
        with pytest.raises(ControlPlaneUnavailable):
            await http.client.heartbeat(Fence(task_id, 1, claimed.lease_token))
    beat = await http.client.heartbeat(Fence(task_id, 1, claimed.lease_token))
    assert beat.directive == "run" and beat.expires_at >= claimed.lease_expires_at

    await http.client.complete(
        Fence(task_id, 1, claimed.lease_token), [platform.partition(0, 9)], None
    )
    # the answer was lost; the retry is recognized as a duplicate
    await http.client.complete(
        Fence(task_id, 1, claimed.lease_token), [platform.partition(0, 9)], None
    )
    assert "Bearer" not in repr(http.client) and TOKEN not in repr(http.client)


async def test_a_refused_connection_is_an_outage_and_an_owned_client_is_closed() -> None:
    # Nothing listens on the discard port of the loopback address.
    async with HttpControlPlaneClient("http://127.0.0.1:9", TOKEN, timeout_seconds=5) as client:
        with pytest.raises(ControlPlaneUnavailable, match="ConnectError"):
            await client.claim(uuid.uuid4(), "w")
    assert client._http.is_closed
