"""The v1 worker contract (``/internal/worker/*``) on both engines: claims from
wake-ups and from the database fallback, the long-poll, idempotent and
lease-guarded completion and failure."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

import anyio
import pytest

from tests.api_fixtures import DOWNSTREAM, STREAM, Api, api_platform, partition
from trace_core.api import ApiConfig
from trace_core.api.streams import StreamClaimer
from trace_core.clock import ManualClock
from trace_core.dispatcher.inprocess import InProcessWakeupQueue
from trace_core.dispatcher.runtimes import DEFAULT_RUNTIMES, Runtime, RuntimeKind, RuntimeRegistry
from trace_core.dispatcher.service import Dispatcher
from trace_core.errors import InvalidInput
from trace_core.storage.sql import SqlRepository
from trace_core.wakeup import Offer, WakeupHub

pytestmark = pytest.mark.anyio


@pytest.fixture
async def api(repo: SqlRepository, clock: ManualClock) -> Any:
    async with api_platform(repo, clock) as platform:
        yield platform


def _queue(api: Api) -> InProcessWakeupQueue:
    wakeups = api.dispatcher.wakeups
    assert isinstance(wakeups, InProcessWakeupQueue)
    return wakeups


async def _claim(api: Api, streams: list[str] | None = None, wait_ms: int = 0) -> dict[str, Any]:
    response = await api.client.post(
        "/internal/worker/claim",
        json={"worker_id": "v1-worker", "streams": streams or [STREAM], "max_wait_ms": wait_ms},
    )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def _report(claimed: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "worker_id": "v1-worker",
        "job_id": claimed["job_id"],
        "attempt_id": claimed["attempt_id"],
        "lease_token": claimed["lease_token"],
        "stream": claimed["stream"],
        "message_id": claimed["message_id"],
        **extra,
    }


# --- claim -------------------------------------------------------------------


async def test_claim_takes_a_wakeup(api: Api) -> None:
    task_id = await api.trigger("run-1")
    await api.dispatcher.relay.run_once()  # the launcher sends the wake-up
    assert _queue(api).pending(STREAM) == [task_id]

    claimed = await _claim(api)
    assert claimed["claimed"] is True and claimed["source"] == "wakeup"
    assert claimed["job_id"] == str(task_id) and claimed["attempt_id"] == 1
    assert claimed["stream"] == STREAM and claimed["message_id"]
    assert claimed["payload"]["task_id"] == str(task_id)
    assert claimed["payload"]["job"]["name"] == "follow"
    assert claimed["lease_ttl_seconds"] == 30.0  # the default lease (no heartbeat timeout)
    assert claimed["heartbeat_interval_seconds"] == 10.0
    assert _queue(api).pending(STREAM) == []
    assert (await api.task(task_id))["status"] == "Running"


async def test_a_claim_answers_every_field_of_the_contract(api: Api) -> None:
    task_id = await api.trigger("run-1")  # the relay has not run: a database claim
    claimed_at = api.clock.now()
    claimed = await _claim(api)
    row = await api.task(task_id)
    assert claimed == {
        "claimed": True,
        "job_id": str(task_id),
        "attempt_id": 1,
        "lease_token": str(row["lease_token"]),
        "lease_expires_at": claimed["lease_expires_at"],
        "stream": STREAM,
        # No transport message exists: an opaque token the reports send back.
        "message_id": f"database-{task_id}-1",
        "source": "database",
        "payload": claimed["payload"],
        "lease_ttl_seconds": 30.0,
        "heartbeat_interval_seconds": 10.0,
    }
    expires = datetime.fromisoformat(claimed["lease_expires_at"])
    assert expires == claimed_at + timedelta(seconds=30) == row["lease_expires_at"]
    payload = claimed["payload"]
    assert payload["task_id"] == str(task_id) and payload["attempt"] == 1
    assert payload["job"]["name"] == "follow" and payload["status"] == "Running"


async def test_requests_with_a_missing_or_unknown_field_are_400_naming_it(api: Api) -> None:
    await api.trigger("run-1")
    claimed = await _claim(api)
    complete = _report(claimed)
    heartbeat = {k: complete[k] for k in ("worker_id", "job_id", "lease_token")}
    fail = _report(claimed, error={"message": "x"})
    claim = {"worker_id": "w", "streams": [STREAM], "max_wait_ms": 0}
    cases = [
        ("claim", claim, ("worker_id", "streams")),
        ("heartbeat", heartbeat, ("worker_id", "job_id", "lease_token")),
        (
            "complete",
            complete,
            ("worker_id", "job_id", "attempt_id", "lease_token", "stream", "message_id"),
        ),
        (
            "fail",
            fail,
            ("worker_id", "job_id", "attempt_id", "lease_token", "stream", "message_id", "error"),
        ),
    ]
    for route, body, required in cases:
        for field in required:
            missing = {k: v for k, v in body.items() if k != field}
            response = await api.client.post(f"/internal/worker/{route}", json=missing)
            assert response.status_code == 400, (route, field, response.text)
            answer = response.json()
            assert answer["error"] == "invalid_request" and answer["field"] == field
            assert answer["reason"] and answer["errors"][0]["field"] == field
        unknown = await api.client.post(f"/internal/worker/{route}", json={**body, "colour": 1})
        assert unknown.status_code == 400 and unknown.json()["field"] == "colour", route
    # Nothing the refused calls carried was recorded.
    assert (await api.task(uuid.UUID(claimed["job_id"])))["status"] == "Running"


async def test_claim_falls_back_to_the_database_when_wakeups_are_lost(api: Api) -> None:
    first = await api.trigger("run-1")
    api.clock.advance(1)  # claim order is queued_at: make "oldest" unambiguous
    second = await api.trigger("run-2")
    assert _queue(api).pending(STREAM) == []  # the relay has not run: no wake-ups
    claims = [await _claim(api), await _claim(api)]
    assert [c["source"] for c in claims] == ["database", "database"]
    assert [c["job_id"] for c in claims] == [str(first), str(second)]  # oldest first
    assert (await _claim(api))["claimed"] is False


async def test_refused_wakeups_are_dropped_and_the_next_one_tried(api: Api) -> None:
    done = await api.trigger("done")
    claimed = await api.claim(done)
    report = {
        "task_id": str(done),
        "attempt": claimed["attempt"],
        "lease_token": claimed["lease_token"],
        "status": "Completed",
    }
    assert (await api.client.post("/internal/task-complete", json=report)).status_code == 200
    waiting = await api.trigger("waiting")
    await _queue(api).send(STREAM, [uuid.uuid4(), done, waiting])

    got = await _claim(api)
    assert got["source"] == "wakeup" and got["job_id"] == str(waiting)
    assert _queue(api).pending(STREAM) == []


async def test_streams_are_tried_in_priority_order(api: Api) -> None:
    upstream = await api.trigger("run-1")
    claimed = await api.claim(upstream)
    report = {
        "task_id": str(upstream),
        "attempt": 1,
        "lease_token": claimed["lease_token"],
        "status": "Completed",
        "events": [partition(api.blocks, 0, 9)],
    }
    assert (await api.client.post("/internal/task-complete", json=report)).status_code == 200
    await api.dispatcher.run_once()  # routes: a `double` task on the downstream queue
    await api.trigger("run-2")  # and one more `follow` task

    first = await _claim(api, [DOWNSTREAM, STREAM])
    assert first["stream"] == DOWNSTREAM and first["payload"]["job"]["name"] == "double"
    second = await _claim(api, [DOWNSTREAM, STREAM])
    assert second["stream"] == STREAM and second["payload"]["job"]["name"] == "follow"


class _ObservedHub(WakeupHub):
    """A hub that says when someone starts waiting (the long-poll's sync point)."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = anyio.Event()

    async def wait(
        self,
        channel: str,
        max_wait: float,
        *,
        after: int | None = None,
        offer: Offer[Any] | None = None,
    ) -> bool:
        self.waiting.set()
        return await super().wait(channel, max_wait, after=after, offer=offer)


async def test_the_long_poll_returns_as_soon_as_a_task_is_created(
    database_url: str, clock: ManualClock
) -> None:
    hub = _ObservedHub()
    repo = SqlRepository(database_url, hub=hub)
    try:
        async with api_platform(repo, clock) as api:
            answers: list[dict[str, Any]] = []

            async def poll() -> None:
                answers.append(await _claim(api, wait_ms=20_000))

            with anyio.fail_after(10):  # far below the 20 s the claim may wait
                async with anyio.create_task_group() as group:
                    group.start_soon(poll)
                    await hub.waiting.wait()  # the claim found nothing and waits
                    task_id = await api.trigger("run-1")
            assert answers[0]["claimed"] is True
            assert answers[0]["job_id"] == str(task_id)
            assert answers[0]["source"] == "database"
    finally:
        await repo.close()


async def test_the_long_poll_ends_unclaimed_after_max_wait(api: Api) -> None:
    with anyio.fail_after(10):
        answer = await _claim(api, wait_ms=50)
    assert answer == {
        "claimed": False,
        "job_id": None,
        "attempt_id": None,
        "lease_token": None,
        "lease_expires_at": None,
        "stream": None,
        "message_id": None,
        "source": None,
        "payload": None,
        "lease_ttl_seconds": None,
        "heartbeat_interval_seconds": None,
    }


async def test_claim_requests_are_validated(repo: SqlRepository, clock: ManualClock) -> None:
    async with api_platform(repo, clock, config=ApiConfig(max_wait_ms=1000)) as api:
        cases: list[tuple[dict[str, Any], str]] = [
            ({"max_wait_ms": -1}, "max_wait_ms"),
            ({"max_wait_ms": 20_001}, "max_wait_ms"),
            ({"max_wait_ms": 5000}, "max_wait_ms"),  # over this server's cap
            ({"max_wait_ms": "5"}, "max_wait_ms"),
            ({"max_wait_ms": 1.5}, "max_wait_ms"),
            ({"streams": []}, "streams"),
            ({"streams": [STREAM] * 17}, "streams"),  # at most 16
            ({"streams": STREAM}, "streams"),  # a list, not a name
            ({"streams": [STREAM, "no-such-queue"]}, "streams[1]"),
            ({"streams": ["trace-lambda"]}, "streams[0]"),
            ({"worker_id": ""}, "worker_id"),
        ]
        for change, field in cases:
            body = {"worker_id": "w", "streams": [STREAM], "max_wait_ms": 0, **change}
            response = await api.client.post("/internal/worker/claim", json=body)
            assert response.status_code == 400, (change, response.text)
            assert response.json()["field"] == field, (change, response.json())


def test_streams_match_queue_runtimes_and_operator_templates() -> None:
    runtimes = RuntimeRegistry(
        [*DEFAULT_RUNTIMES, Runtime("per_op", RuntimeKind.QUEUE, "trace-op-{operator}-q")]
    )

    class _Stub:
        def __init__(self) -> None:
            self.runtimes = runtimes

    claimer = StreamClaimer(_Stub())  # type: ignore[arg-type]
    assert claimer.matchers("trace-ecs-udf", "s") == [("ecs_udf", None)]
    assert claimer.matchers("trace-op-double-q", "s") == [("per_op", "double")]
    for stream in ("trace-op--q", "trace-op-double", "trace-count"):  # lambda targets are no queue
        with pytest.raises(InvalidInput) as refused:
            claimer.matchers(stream, "streams[3]")
        assert refused.value.field == "streams[3]"


# --- heartbeat, complete, fail -----------------------------------------------


async def test_heartbeat_extends_the_named_lease(api: Api) -> None:
    await api.trigger("run-1")
    claimed = await _claim(api)
    api.clock.advance(10)
    base = {"worker_id": "v1-worker", "job_id": claimed["job_id"]}
    for extra in ({}, {"attempt_id": 1}):
        beat = await api.client.post(
            "/internal/worker/heartbeat",
            json={**base, "lease_token": claimed["lease_token"], **extra},
        )
        assert beat.status_code == 200, beat.text
        assert set(beat.json()) == {"ok", "lease_expires_at", "directive"}
        assert beat.json()["ok"] is True and beat.json()["directive"] == "run"
        # Extended from now by the lease TTL.
        expires = datetime.fromisoformat(beat.json()["lease_expires_at"])
        assert expires == api.clock.now() + timedelta(seconds=claimed["lease_ttl_seconds"])
    stale = await api.client.post(
        "/internal/worker/heartbeat", json={**base, "lease_token": str(uuid.uuid4())}
    )
    assert stale.status_code == 409
    assert stale.json() == {
        "ok": False,
        "ack": True,
        "error": "stale",
        "reason": stale.json()["reason"],
    }
    missing = await api.client.post(
        "/internal/worker/heartbeat",
        json={**base, "job_id": str(uuid.uuid4()), "lease_token": claimed["lease_token"]},
    )
    assert missing.status_code == 404
    assert missing.json() == {
        "ok": False,
        "ack": True,
        "error": "not_found",
        "reason": missing.json()["reason"],
    }


async def test_complete_commits_the_result_once(api: Api) -> None:
    await api.trigger("run-1")
    claimed = await _claim(api)
    result = {
        "events": [partition(api.blocks, 0, 9)],
        "outputs": [{"output_index": 0, "row_count": 10}],
        "timings": {"run_ms": 12},
    }
    done = await api.client.post("/internal/worker/complete", json=_report(claimed, result=result))
    assert done.status_code == 200, done.text
    assert done.json() == {"ok": True, "ack": True, "duplicate": False}
    task_id = uuid.UUID(claimed["job_id"])
    row = await api.task(task_id)
    assert row["status"] == "Completed" and row["outputs"] == result["outputs"]

    again = await api.client.post("/internal/worker/complete", json=_report(claimed, result=result))
    assert again.status_code == 200
    assert again.json() == {"ok": True, "ack": True, "duplicate": True}
    assert await api.task(task_id) == row
    await api.dispatcher.run_once()
    assert [t["partitions"] for t in await api.tasks_of("double")] == [["0-9"]]

    contradiction = await api.client.post(
        "/internal/worker/fail",
        json=_report(claimed, error={"code": "late", "message": "after completion"}),
    )
    assert contradiction.status_code == 409
    assert contradiction.json() == {
        "ok": False,
        "ack": True,
        "error": "invalid_transition",
        "reason": contradiction.json()["reason"],
    }
    assert await api.task(task_id) == row


async def test_reports_of_a_stale_attempt_are_409_and_change_nothing(api: Api) -> None:
    await api.trigger("run-1")
    first = await _claim(api)
    task_id = uuid.UUID(first["job_id"])
    api.clock.advance(3600)
    await api.dispatcher.reaper.run_once()
    api.clock.advance(3600)
    await api.dispatcher.retries.run_once()
    second = await _claim(api)
    assert second["job_id"] == first["job_id"] and second["attempt_id"] == 2
    before = await api.task(task_id)

    stale_reports = [
        ("/internal/worker/complete", _report(first, result={"events": []})),
        ("/internal/worker/fail", _report(first, error={"message": "late", "retryable": False})),
        (
            "/internal/worker/heartbeat",
            {
                "worker_id": "v1-worker",
                "job_id": first["job_id"],
                "lease_token": first["lease_token"],
            },
        ),
    ]
    for path, body in stale_reports:
        refused = await api.client.post(path, json=body)
        assert refused.status_code == 409, (path, refused.text)
        assert refused.json()["ok"] is False and refused.json()["ack"] is True
        assert refused.json()["error"] == "stale"
    assert await api.task(task_id) == before

    # the same attempt number with another lease token is stale too
    forged = {**_report(second), "lease_token": str(uuid.uuid4())}
    assert (await api.client.post("/internal/worker/complete", json=forged)).status_code == 409
    ok = await api.client.post("/internal/worker/complete", json=_report(second))
    assert ok.status_code == 200 and ok.json()["duplicate"] is False


async def test_fail_requeues_or_dead_letters_idempotently(api: Api) -> None:
    await api.trigger("retried")
    claimed = await _claim(api)
    task_id = uuid.UUID(claimed["job_id"])
    error = {"code": "E_FLAKY", "message": "connection reset", "stack": "Traceback ..."}
    failed = await api.client.post("/internal/worker/fail", json=_report(claimed, error=error))
    assert failed.status_code == 200, failed.text
    assert failed.json() == {
        "ok": True,
        "ack": True,
        "requeued": True,
        "dlq": False,
        "duplicate": False,
    }
    row = await api.task(task_id)
    assert row["status"] == "Failed" and row["error_message"].startswith("E_FLAKY: connection")
    again = await api.client.post("/internal/worker/fail", json=_report(claimed, error=error))
    assert again.json()["duplicate"] is True and again.json()["requeued"] is True
    assert await api.task(task_id) == row

    api.clock.advance(3600)
    await api.dispatcher.retries.run_once()  # back to Queued, same attempt until claimed
    after_requeue = await api.client.post(
        "/internal/worker/fail", json=_report(claimed, error=error)
    )
    assert after_requeue.json()["duplicate"] is True and after_requeue.json()["requeued"] is True
    assert (await api.task(task_id))["status"] == "Queued"

    fatal_id = await api.trigger("fatal")
    fatal = await api.claim(fatal_id, "v1-worker")
    report = {
        "worker_id": "v1-worker",
        "job_id": str(fatal_id),
        "attempt_id": fatal["attempt"],
        "lease_token": fatal["lease_token"],
        "stream": STREAM,
        "message_id": "m-2",
        "error": {"code": "E_INPUT", "message": "bad", "retryable": False},
    }
    dead = await api.client.post("/internal/worker/fail", json=report)
    assert dead.status_code == 200, dead.text
    assert dead.json() == {
        "ok": True,
        "ack": True,
        "requeued": False,
        "dlq": True,
        "duplicate": False,
    }
    assert (await api.claim(fatal_id))["reason"] == "DeadLettered"


@pytest.mark.parametrize("retryable", [True, False])
async def test_an_attempt_that_failed_cannot_complete_afterwards(api: Api, retryable: bool) -> None:
    """The attempt's own failure report ends it (issue 14, section 4): a
    completion with events after it is stale, stores nothing, routes nothing."""
    await api.trigger("run-1")
    claimed = await _claim(api)
    task_id = uuid.UUID(claimed["job_id"])
    error = {"code": "E", "message": "boom", "retryable": retryable}
    failed = await api.client.post("/internal/worker/fail", json=_report(claimed, error=error))
    assert failed.status_code == 200, failed.text
    before = await api.task(task_id)
    result = {"events": [partition(api.blocks, 0, 9)]}
    late = await api.client.post("/internal/worker/complete", json=_report(claimed, result=result))
    assert late.status_code == 409, late.text
    assert late.json()["error"] == "stale" and late.json()["ack"] is True
    assert await api.task(task_id) == before
    await api.dispatcher.run_once()
    assert await api.tasks_of("double") == []


async def test_reports_for_an_unknown_job_are_404_and_acked(api: Api) -> None:
    ghost = {
        "worker_id": "w",
        "job_id": str(uuid.uuid4()),
        "attempt_id": 1,
        "lease_token": str(uuid.uuid4()),
        "stream": STREAM,
        "message_id": "m-1",
    }
    for path, extra in (
        ("/internal/worker/complete", {}),
        ("/internal/worker/fail", {"error": {"message": "x"}}),
    ):
        response = await api.client.post(path, json={**ghost, **extra})
        assert response.status_code == 404, response.text
        assert response.json() == {
            "ok": False,
            "ack": True,
            "error": "not_found",
            "reason": response.json()["reason"],
        }


async def test_dispatcher_without_a_readable_wakeup_queue_uses_the_database(
    repo: SqlRepository, clock: ManualClock
) -> None:
    class _SendOnly:
        """Like SQS from the API's side: wake-ups can be sent, not read here."""

        async def send(self, queue: str, task_ids: Any) -> None:
            pass

    async with api_platform(repo, clock) as api:
        dispatcher = Dispatcher(
            repo, operators=api.dispatcher.operators, clock=clock, wakeups=_SendOnly()
        )
        task_id = await api.trigger("run-1")
        claimer = StreamClaimer(dispatcher)
        found = await claimer.claim("w", [STREAM], max_wait=0)
        assert found is not None and found.source == "database"
        assert found.claimed.outcome.lease is not None
        assert found.claimed.outcome.lease.item_id == task_id
