"""Operator state over the control plane (``/v1/task/state/read`` and ``/write``),
on both engines through an in-process ASGI client: the routes, the fencing of
a finished or reclaimed attempt's still-valid token, the reach of a token
(its own job only), the bounds of a body; then the worker's
:class:`~trace_core.worker.HttpOperatorState` against the same real app, alone
and under a :class:`~trace_core.worker.WorkerWrapper` running a threaded operator."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.from_thread
import httpx
import pytest

from tests import test_api_task_scoped as scoped
from tests.api_fixtures import AUTH, TOKEN
from tests.test_api_task_scoped import BASE, Claimed, TaskApi
from tests.test_worker_http import Outage
from trace_core.authoring.context import OperatorResult, TaskContext
from trace_core.authoring.events import AcceptResult, DatasetEvent
from trace_core.authoring.operators import OperatorRegistry, OperatorSpec
from trace_core.authoring.state import StateConflict, StateSnapshot
from trace_core.errors import ConfigurationError, InvalidInput, StaleClaim
from trace_core.limits import MAX_OPERATOR_STATE_BYTES
from trace_core.retry import Backoff
from trace_core.worker import (
    COMPLETED,
    HttpControlPlaneClient,
    HttpOperatorState,
    OutageRetry,
    WorkerWrapper,
)

pytestmark = pytest.mark.anyio

api = scoped.api
"""The task-scoped routes' fixture: a Dispatcher issuing capabilities, its app and a client."""

READ, WRITE = "state/read", "state/write"


def _job(claimed: Claimed) -> tuple[uuid.UUID, uuid.UUID]:
    job = claimed.task["job"]
    return uuid.UUID(job["org_id"]), uuid.UUID(job["id"])


def _read(c: Claimed, key: str = "default") -> dict[str, Any]:
    return {"task_id": str(c.task_id), "attempt": c.attempt, "state_key": key}


def _write(
    c: Claimed, state: dict[str, Any], expected: int | None, key: str = "default"
) -> dict[str, Any]:
    return {**_read(c, key), "state": state, "expected_version": expected}


async def _stored(api: TaskApi, claimed: Claimed, key: str = "default") -> StateSnapshot | None:
    org, job = _job(claimed)
    return await api.dispatcher.state.get(org, job, key)


# --- the routes -------------------------------------------------------------------------


async def test_read_and_versioned_writes_reach_the_tokens_job(api: TaskApi) -> None:
    claimed = await api.running()
    empty = await api.call(READ, _read(claimed), claimed.token)
    assert empty.status_code == 200, empty.text
    assert empty.json() == {"state_key": "default", "state": None, "version": None}

    created = await api.call(WRITE, _write(claimed, {"next_block": 10}, None), claimed.token)
    assert created.status_code == 200, created.text
    assert created.json() == {"state_key": "default", "version": 1}
    updated = await api.call(
        WRITE, _write(claimed, {"next_block": 20, "ranges": [[0, 19]]}, 1), claimed.token
    )
    assert updated.status_code == 200 and updated.json()["version"] == 2, updated.text
    other_key = await api.call(WRITE, _write(claimed, {"n": 1}, None, "ranges"), claimed.token)
    assert other_key.json() == {"state_key": "ranges", "version": 1}, other_key.text

    read = await api.call(READ, _read(claimed), claimed.token)
    assert read.json() == {
        "state_key": "default",
        "state": {"next_block": 20, "ranges": [[0, 19]]},
        "version": 2,
    }
    # Stored as the in-process store keeps it: under the token's org and job.
    assert await _stored(api, claimed) == StateSnapshot({"next_block": 20, "ranges": [[0, 19]]}, 2)
    assert await _stored(api, claimed, "ranges") == StateSnapshot({"n": 1}, 1)
    assert claimed.token not in read.text


async def test_a_lost_version_check_is_a_409_conflict_that_changes_nothing(api: TaskApi) -> None:
    claimed = await api.running()
    for state, expected in (({"n": 1}, None), ({"n": 2}, 1)):
        ok = await api.call(WRITE, _write(claimed, state, expected), claimed.token)
        assert ok.status_code == 200, ok.text
    for expected, actual in ((None, 2), (1, 2), (5, 2)):
        lost = await api.call(WRITE, _write(claimed, {"n": 99}, expected), claimed.token)
        assert lost.status_code == 409, lost.text
        body = lost.json()
        assert body["error"] == "conflict" and body["field"] == "expected_version", body
        assert (body["expected_version"], body["actual_version"]) == (expected, actual)
    missing = await api.call(WRITE, _write(claimed, {"n": 1}, 3, "absent"), claimed.token)
    assert missing.status_code == 409 and missing.json()["actual_version"] is None
    assert await _stored(api, claimed) == StateSnapshot({"n": 2}, 2)
    assert await _stored(api, claimed, "absent") is None


async def _assert_stale(api: TaskApi, claimed: Claimed, before: StateSnapshot | None) -> None:
    """Both routes refuse ``claimed``'s token with 409 ``stale``; the state is unchanged."""
    expected = None if before is None else before.version
    for route, body in (
        (READ, _read(claimed)),
        (WRITE, _write(claimed, {"late": "write"}, expected)),
        (WRITE, _write(claimed, {"late": "write"}, None, "fresh")),
    ):
        response = await api.call(route, body, claimed.token)
        assert response.status_code == 409, (route, response.text)
        assert response.json()["error"] == "stale", response.text
        assert "late" not in response.text and claimed.token not in response.text
    assert await _stored(api, claimed) == before
    assert await _stored(api, claimed, "fresh") is None


@pytest.mark.parametrize("how", scoped.ENDINGS)
async def test_an_ended_attempts_valid_token_reaches_no_state(api: TaskApi, how: str) -> None:
    """The attacker's case: a token that still verifies, of an attempt that is over."""
    claimed = await api.running()
    ok = await api.call(WRITE, _write(claimed, {"n": 1}, None), claimed.token)
    assert ok.status_code == 200, ok.text
    await scoped._end(api, claimed, how)
    await _assert_stale(api, claimed, StateSnapshot({"n": 1}, 1))


async def test_a_reclaimed_attempts_token_is_stale_before_and_after_the_next_claim(
    api: TaskApi,
) -> None:
    first = await api.running()
    ok = await api.call(WRITE, _write(first, {"n": 1}, None), first.token)
    assert ok.status_code == 200, ok.text
    # Reclaimed (the reaper failed the expired lease), no newer attempt yet:
    # unlike an event, state is no late reply.
    api.clock.advance(scoped.LEASE_EXPIRY)
    assert (await api.dispatcher.reaper.run_once()).expired == 1
    await _assert_stale(api, first, StateSnapshot({"n": 1}, 1))
    # The next attempt claimed: the old token for its own attempt is stale,
    # for the new attempt not its attempt; the new token works.
    api.clock.advance(scoped.BACKOFF)
    await api.dispatcher.retries.run_once()
    second = await api.claim(first.task_id, "worker-2")
    assert second.attempt == 2
    await _assert_stale(api, first, StateSnapshot({"n": 1}, 1))
    borrowed = await api.call(READ, _read(second), first.token)
    scoped._refused(borrowed, "wrong_task", first.token)
    fresh = await api.call(WRITE, _write(second, {"n": 2}, 1), second.token)
    assert fresh.status_code == 200 and fresh.json()["version"] == 2, fresh.text


async def test_a_token_reaches_only_its_own_jobs_state(api: TaskApi) -> None:
    mine = await api.running("run-1")
    org, job = _job(mine)
    enrich = api.deployed.jobs["enrich"]
    await api.dispatcher.state.put(org, enrich, {"secret": "enrich"}, expected_version=None)
    # The body cannot name a job or an org: unknown fields are refused.
    for field, value in (("job_id", str(enrich)), ("org_id", str(uuid.uuid4()))):
        for route, body in ((READ, _read(mine)), (WRITE, _write(mine, {"n": 1}, None))):
            response = await api.call(route, {**body, field: value}, mine.token)
            assert response.status_code == 400, response.text
            assert response.json()["field"] == field
    # Read and written: the token's job only, never the other job's row.
    read = await api.call(READ, _read(mine), mine.token)
    assert read.json()["state"] is None and "enrich" not in read.text
    write = await api.call(WRITE, _write(mine, {"n": 1}, None), mine.token)
    assert write.status_code == 200, write.text
    assert await api.dispatcher.state.get(org, enrich) == StateSnapshot({"secret": "enrich"}, 1)
    assert await api.dispatcher.state.get(org, job) == StateSnapshot({"n": 1}, 1)
    # Another task's token, presented for this task, is not this attempt's.
    other = await api.running("run-2")
    borrowed = await api.call(READ, _read(mine), other.token)
    scoped._refused(borrowed, "wrong_task", other.token)
    # Without a token nothing is answered, even with the internal one.
    scoped._refused(await api.call(READ, _read(mine), None, **AUTH), "missing")


async def test_a_state_over_the_limit_is_refused_naming_it(api: TaskApi) -> None:
    claimed = await api.running()
    overhead = len('{"s":""}')
    fits = {"s": "x" * (MAX_OPERATOR_STATE_BYTES - overhead)}
    too_big = {"s": "x" * (MAX_OPERATOR_STATE_BYTES - overhead + 1)}
    refused = await api.call(WRITE, _write(claimed, too_big, None), claimed.token)
    assert refused.status_code == 400, refused.text
    assert refused.json()["field"] == "state"
    assert str(MAX_OPERATOR_STATE_BYTES) in refused.json()["reason"]
    assert await _stored(api, claimed) is None
    accepted = await api.call(WRITE, _write(claimed, fits, None), claimed.token)
    assert accepted.status_code == 200, accepted.text
    # Over the body cap: 413 before anything parses it.
    huge = await api.call(WRITE, _write(claimed, {"s": "x" * (1 << 20)}, 1), claimed.token)
    assert huge.status_code == 413, huge.text


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"expected_version": "__missing__"}, "expected_version"),
        ({"expected_version": 0}, "expected_version"),
        ({"expected_version": "1"}, "expected_version"),
        ({"expected_version": True}, "expected_version"),
        ({"expected_version": 2**63}, "expected_version"),
        ({"state": [1, 2]}, "state"),
        ({"state": "__missing__"}, "state"),
        ({"state": {"k": "a\x00b"}}, "state"),
        ({"state_key": ""}, "state_key"),
        ({"state_key": "k" * 257}, "state_key"),
        ({"attempt": 0}, "attempt"),
        ({"task_id": "not-a-uuid"}, "task_id"),
    ],
)
async def test_a_bad_body_is_a_400_naming_the_field(
    api: TaskApi, change: dict[str, Any], field: str
) -> None:
    claimed = await api.running()
    body = _write(claimed, {"n": 1}, None)
    for key, value in change.items():
        if value == "__missing__":
            del body[key]
        else:
            body[key] = value
    response = await api.call(WRITE, body, claimed.token)
    assert response.status_code == 400, response.text
    assert response.json()["field"] == field, response.text
    assert await _stored(api, claimed) is None


async def test_the_document_describes_both_routes_and_their_answers(api: TaskApi) -> None:
    document = api.app.openapi()
    for route in (READ, WRITE):
        operation = document["paths"][f"/v1/task/{route}"]["post"]
        assert operation["security"] == [{"taskCapability": []}]
        assert {"200", "400", "401", "409", "413", "503"} <= set(operation["responses"])
    write = document["paths"]["/v1/task/state/write"]["post"]["responses"]
    conflict = write["409"]["content"]["application/json"]["schema"]["$ref"]
    assert conflict == "#/components/schemas/StateConflictBody"
    body = document["components"]["schemas"]["StateConflictBody"]
    assert {"expected_version", "actual_version"} <= set(body["properties"])


# --- the worker's client, against the same app ------------------------------------------


class _Control:
    """An attempt that holds its lease (the client only reads the token)."""

    lost: str | None = None

    async def emit(self, events: Sequence[DatasetEvent]) -> AcceptResult:
        raise AssertionError("not used")

    async def directive(self) -> str:
        return "run"


def _context(claimed: Claimed) -> TaskContext:
    return TaskContext(claimed.task, _Control())


async def test_the_client_reads_writes_and_raises_the_contracts_errors(api: TaskApi) -> None:
    claimed = await api.running()
    org, job = _job(claimed)
    transport = Outage(httpx.ASGITransport(app=api.app))  # no outage planned: it counts
    async with httpx.AsyncClient(transport=transport, base_url=BASE) as http:
        state = HttpOperatorState(BASE, http, attempt=lambda: _context(claimed))
        assert await state.get(org, job) is None
        created = await state.put(org, job, {"n": 1}, expected_version=None)
        assert created == StateSnapshot({"n": 1}, 1)
        assert await state.put(org, job, {"n": 2}, expected_version=1) == StateSnapshot({"n": 2}, 2)
        assert await state.get(org, job) == StateSnapshot({"n": 2}, 2)
        assert await state.get(org, job, "other") is None
        with pytest.raises(StateConflict) as lost:
            await state.put(org, job, {"n": 3}, expected_version=1)
        assert (lost.value.expected_version, lost.value.actual_version) == (1, 2)
        assert (lost.value.org_id, lost.value.job_id, lost.value.state_key) == (org, job, "default")
        with pytest.raises(InvalidInput) as bad:
            await state.put(org, job, {"s": "x" * MAX_OPERATOR_STATE_BYTES}, expected_version=2)
        assert bad.value.field == "state"
        # Another job named: refused before anything is sent.
        sent = len(transport.requests)
        with pytest.raises(InvalidInput, match="own job"):
            await state.get(org, api.deployed.jobs["enrich"])
        assert len(transport.requests) == sent
        with pytest.raises(ConfigurationError, match="reachable only"):
            await HttpOperatorState(BASE, http, attempt=lambda: None).get(org, job)
        # The attempt ends: its token still verifies, its calls are stale.
        done = await api.call("complete", scoped._complete(api, claimed), claimed.token)
        assert done.status_code == 200, done.text
        with pytest.raises(StaleClaim):
            await state.get(org, job)
        with pytest.raises(StaleClaim):
            await state.put(org, job, {"n": 9}, expected_version=2)
    assert await _stored(api, claimed) == StateSnapshot({"n": 2}, 2)


async def test_the_client_rides_out_an_outage_of_the_app(api: TaskApi) -> None:
    claimed = await api.running()
    org, job = _job(claimed)
    transport = Outage(httpx.ASGITransport(app=api.app))
    transport.plans["/v1/task/state/write"] = ["connect", 503, 502]
    delays: list[float] = []

    async def sleep(seconds: float) -> None:
        delays.append(seconds)

    retry = OutageRetry(
        backoff=Backoff(base_seconds=0.01, factor=2.0, cap_seconds=0.1), sleep=sleep
    )
    async with httpx.AsyncClient(transport=transport, base_url=BASE) as http:
        state = HttpOperatorState(BASE, http, retry=retry, attempt=lambda: _context(claimed))
        written = await state.put(org, job, {"n": 1}, expected_version=None)
    assert written == StateSnapshot({"n": 1}, 1)
    assert retry.retries == 3 and len(delays) == 3
    assert delays[1] >= 1.0  # the 503's Retry-After is honoured
    assert await _stored(api, claimed) == written


async def test_a_wrapper_run_operator_reaches_its_state_from_its_thread(api: TaskApi) -> None:
    """The wrapper marks the running attempt; a synchronous operator (a worker
    thread, calling back into the loop) reaches its job's state with that
    attempt's token and no database."""
    task_id = await api.trigger("run-1")
    seen: list[dict[str, Any]] = []
    state = HttpOperatorState(BASE, api.client)

    def follow(ctx: TaskContext) -> OperatorResult:
        org, job = uuid.UUID(ctx.job["org_id"]), uuid.UUID(ctx.job["id"])
        put = functools.partial(state.put, org, job, {"next_block": 10}, expected_version=None)
        anyio.from_thread.run(put)
        snapshot = anyio.from_thread.run(state.get, org, job)
        assert snapshot is not None
        seen.append(snapshot.state)
        return OperatorResult(outputs=[{"output_index": 0}])

    operators = OperatorRegistry([OperatorSpec("follow", follow, source=True)])
    client = HttpControlPlaneClient(BASE, TOKEN, http=api.client)
    wrapper = WorkerWrapper(client, operators, worker_id="w-1", clock=api.clock)
    assert await wrapper.handle_wakeup(task_id) == COMPLETED
    assert seen == [{"next_block": 10}]
    job = api.deployed.jobs["follow"]
    org = uuid.UUID((await api.dispatcher.control.fetch(task_id))["job"]["org_id"])
    assert await api.dispatcher.state.get(org, job) == StateSnapshot({"next_block": 10}, 1)
    # Outside a running operator the client knows no attempt.
    with pytest.raises(ConfigurationError, match="reachable only"):
        await state.get(org, job)
