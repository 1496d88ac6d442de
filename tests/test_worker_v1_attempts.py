"""The v1 worker contract's records (worker-control-plane-v1.md "JobAttempt"),
on both engines: every field of heartbeat, complete and fail with their error
cases, the attempt rows across claim, failure, retry, reaper and
cancellation, the lease holder's ``worker_id``, idempotent repeats, and what
a holder of a finished attempt's token can no longer do. The attempts are
read through ``GET /internal/tasks/{task_id}`` and ``trace-lite tasks``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import anyio
import pytest

from tests.api_fixtures import STREAM, Api, api_platform
from trace_core.api.worker_models import MAX_ERROR_MESSAGE, MAX_STACK
from trace_core.clock import ManualClock
from trace_core.storage.sql import SqlRepository
from trace_lite.cli import main

pytestmark = pytest.mark.anyio

WORKER = "v1-worker"


@pytest.fixture
async def api(repo: SqlRepository, clock: ManualClock) -> Any:
    async with api_platform(repo, clock) as platform:
        yield platform


async def claim(api: Api, worker: str = WORKER) -> dict[str, Any]:
    response = await api.client.post(
        "/internal/worker/claim", json={"worker_id": worker, "streams": [STREAM]}
    )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    assert body["claimed"] is True, body
    return body


def report(claimed: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "worker_id": WORKER,
        "job_id": claimed["job_id"],
        "attempt_id": claimed["attempt_id"],
        "lease_token": claimed["lease_token"],
        "stream": claimed["stream"],
        "message_id": claimed["message_id"],
        **extra,
    }


async def task_view(api: Api, task_id: uuid.UUID | str) -> dict[str, Any]:
    response = await api.client.get(f"/internal/tasks/{task_id}")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def post(api: Api, route: str, body: dict[str, Any]) -> Any:
    return await api.client.post(f"/internal/worker/{route}", json=body)


# --- the records across a task's life ------------------------------------------


async def test_claim_then_complete_keeps_the_result_on_the_attempt(api: Api) -> None:
    task_id = await api.trigger("k")
    claimed = await claim(api)
    view = await task_view(api, task_id)
    assert "lease_token" not in json.dumps(view)  # the holder's secret is never shown
    (running,) = view["attempts"]
    assert running["attempt"] == 1 and running["worker_id"] == WORKER
    assert running["status"] == "Running" and running["ended_at"] is None
    assert running["result"] is None and running["error"] is None
    assert running["started_at"] == api.clock.now().isoformat().replace("+00:00", "Z")

    api.clock.advance(7)
    result = {
        "events": [],
        "outputs": [{"output_index": 0, "row_count": 10}],
        "timings": {"run_s": 6.5},
        "artifacts": [{"uri": "s3://bucket/out/part-0.parquet"}],
    }
    done = await post(api, "complete", report(claimed, result=result))
    assert done.status_code == 200, done.text
    assert done.json() == {"ok": True, "ack": True, "duplicate": False}
    view = await task_view(api, task_id)
    assert view["status"] == "Completed"
    (attempt,) = view["attempts"]
    assert attempt["attempt_id"] == running["attempt_id"]
    assert attempt["status"] == "Completed" and attempt["ended_at"] is not None
    assert attempt["result"] == {k: v for k, v in result.items() if k != "events"}
    assert attempt["error"] is None


async def test_fail_retry_complete_keeps_one_record_per_attempt(api: Api) -> None:
    task_id = await api.trigger("k")
    first = await claim(api)
    error = {
        "code": "E_FLAKY",
        "message": "connection reset",
        "stack": "Traceback (most recent call last):\n  ...\nConnectionResetError",
        "retryable": True,
    }
    failed = await post(api, "fail", report(first, error=error))
    assert failed.status_code == 200, failed.text
    assert failed.json() == {
        "ok": True,
        "ack": True,
        "requeued": True,
        "dlq": False,
        "duplicate": False,
    }
    api.clock.advance(3600)
    await api.dispatcher.retries.run_once()
    second = await claim(api, "other-worker")
    assert second["attempt_id"] == 2
    done = await post(api, "complete", {**report(second), "worker_id": "other-worker"})
    assert done.status_code == 200, done.text
    view = await task_view(api, task_id)
    assert view["status"] == "Completed" and view["attempt"] == 2
    one, two = view["attempts"]
    assert (one["attempt"], one["worker_id"], one["status"]) == (1, WORKER, "Failed")
    assert one["error"] == error
    assert (two["attempt"], two["worker_id"], two["status"]) == (2, "other-worker", "Completed")
    assert two["result"] == {} and two["error"] is None


async def test_retryable_false_dead_letters_and_keeps_the_error(api: Api) -> None:
    task_id = await api.trigger("k")
    claimed = await claim(api)
    error = {"code": "E_INPUT", "message": "bad input", "retryable": False}
    dead = await post(api, "fail", report(claimed, error=error))
    assert dead.status_code == 200, dead.text
    assert dead.json() == {
        "ok": True,
        "ack": True,
        "requeued": False,
        "dlq": True,
        "duplicate": False,
    }
    view = await task_view(api, task_id)
    assert view["status"] == "Failed" and view["retry_at"] is None
    (attempt,) = view["attempts"]
    assert attempt["status"] == "Failed"
    assert attempt["error"] == {**error, "stack": None}
    again = await post(api, "fail", report(claimed, error={**error, "message": "other"}))
    assert again.json() == {
        "ok": True,
        "ack": True,
        "requeued": False,
        "dlq": True,
        "duplicate": True,
    }
    assert (await task_view(api, task_id))["attempts"][0]["error"]["message"] == "bad input"


async def test_an_exhausted_retry_budget_answers_dlq(api: Api) -> None:
    task_id = await api.trigger("k")
    answers = []
    for attempt in (1, 2, 3):  # the job's max_attempts is 3
        claimed = await claim(api)
        assert claimed["attempt_id"] == attempt
        error = {"code": "E_FLAKY", "message": f"try {attempt}", "retryable": True}
        failed = await post(api, "fail", report(claimed, error=error))
        assert failed.status_code == 200, failed.text
        answers.append((failed.json()["requeued"], failed.json()["dlq"]))
        api.clock.advance(3600)
        await api.dispatcher.retries.run_once()
    assert answers == [(True, False), (True, False), (False, True)]
    view = await task_view(api, task_id)
    assert view["status"] == "Failed" and view["retry_at"] is None
    assert [(a["attempt"], a["status"], a["error"]["message"]) for a in view["attempts"]] == [
        (1, "Failed", "try 1"),
        (2, "Failed", "try 2"),
        (3, "Failed", "try 3"),
    ]


async def test_the_reaper_closes_an_abandoned_attempt_and_the_next_claim_opens_one(
    api: Api,
) -> None:
    task_id = await api.trigger("k")
    first = await claim(api)
    api.clock.advance(3600)  # past the lease: the worker vanished
    await api.dispatcher.reaper.run_once()
    (expired,) = (await task_view(api, task_id))["attempts"]
    assert expired["status"] == "Expired" and expired["ended_at"] is not None
    assert expired["error"]["code"] == "lease_expired" and expired["error"]["retryable"] is True
    # The vanished worker's late report of a reclaimed attempt changes nothing
    # once a newer attempt runs.
    api.clock.advance(3600)
    await api.dispatcher.retries.run_once()
    second = await claim(api)
    late = await post(api, "complete", report(first))
    assert late.status_code == 409 and late.json()["error"] == "stale"
    one, two = (await task_view(api, task_id))["attempts"]
    assert one["status"] == "Expired" and two["status"] == "Running"
    assert two["attempt_id"] != one["attempt_id"] and second["attempt_id"] == 2


async def test_cancel_closes_the_running_attempt_and_fences_its_reports(api: Api) -> None:
    task_id = await api.trigger("k")
    claimed = await claim(api)
    assert await api.dispatcher.tasks.cancel([task_id], reason="not needed") == {task_id}
    (canceled,) = (await task_view(api, task_id))["attempts"]
    assert canceled["status"] == "Canceled"
    assert canceled["error"]["message"] == "not needed"
    for route, extra in (("complete", {}), ("fail", {"error": {"message": "x"}})):
        refused = await post(api, route, report(claimed, **extra))
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"] == "stale" and refused.json()["ack"] is True
    assert (await task_view(api, task_id))["attempts"] == [canceled]


# --- the lease holder, idempotency, stale tokens -------------------------------


async def test_another_worker_gets_409_and_changes_nothing(api: Api) -> None:
    task_id = await api.trigger("k")
    claimed = await claim(api)
    before = await task_view(api, task_id)
    intruder = {"worker_id": "intruder"}
    cases = [
        ("heartbeat", {**report(claimed), **intruder}),
        ("complete", {**report(claimed, result={"outputs": []}), **intruder}),
        ("fail", {**report(claimed, error={"message": "x", "retryable": False}), **intruder}),
    ]
    for route, body in cases:
        if route == "heartbeat":
            body = {k: body[k] for k in ("worker_id", "job_id", "lease_token", "attempt_id")}
        refused = await post(api, route, body)
        assert refused.status_code == 409, (route, refused.text)
        assert refused.json() == {
            "ok": False,
            "ack": False,
            "error": "wrong_worker",
            "reason": refused.json()["reason"],
        }
        assert await task_view(api, task_id) == before
    done = await post(api, "complete", report(claimed))
    assert done.status_code == 200 and done.json()["duplicate"] is False


async def test_repeats_are_idempotent_and_keep_the_first_result(api: Api) -> None:
    task_id = await api.trigger("k")
    claimed = await claim(api)
    first = await post(api, "complete", report(claimed, result={"timings": {"s": 1}}))
    assert first.json() == {"ok": True, "ack": True, "duplicate": False}
    after = await task_view(api, task_id)
    again = await post(api, "complete", report(claimed, result={"timings": {"s": 99}}))
    assert again.status_code == 200
    assert again.json() == {"ok": True, "ack": True, "duplicate": True}
    assert await task_view(api, task_id) == after
    assert after["attempts"][0]["result"] == {"timings": {"s": 1}}


async def test_concurrent_repeats_record_one_outcome_and_its_result(api: Api) -> None:
    task_id = await api.trigger("k")
    claimed = await claim(api)
    answers: dict[int, Any] = {}

    async def complete(n: int) -> None:
        answers[n] = await post(api, "complete", report(claimed, result={"n": n}))

    async with anyio.create_task_group() as group:
        for n in range(4):
            group.start_soon(complete, n)
    assert all(a.status_code == 200 for a in answers.values())
    winners = [n for n, a in answers.items() if a.json()["duplicate"] is False]
    assert len(winners) == 1
    (attempt,) = (await task_view(api, task_id))["attempts"]
    assert attempt["status"] == "Completed" and attempt["result"] == {"n": winners[0]}


async def test_a_finished_attempts_token_changes_nothing(api: Api) -> None:
    """The token of a finished attempt is all an attacker who read it could
    present: no report with it moves the task or rewrites the record."""
    task_id = await api.trigger("k")
    claimed = await claim(api)
    assert (await post(api, "complete", report(claimed, result={"v": 1}))).status_code == 200
    after = await task_view(api, task_id)
    beat = await post(
        api,
        "heartbeat",
        {"worker_id": WORKER, "job_id": claimed["job_id"], "lease_token": claimed["lease_token"]},
    )
    assert beat.status_code == 409 and beat.json()["error"] == "stale"
    failed = await post(api, "fail", report(claimed, error={"message": "x", "retryable": False}))
    assert failed.status_code == 409 and failed.json()["error"] == "invalid_transition"
    rewritten = await post(api, "complete", report(claimed, result={"v": "forged"}))
    assert rewritten.json()["duplicate"] is True
    assert await task_view(api, task_id) == after


# --- every field ------------------------------------------------------------------


async def test_attempt_id_may_name_the_record(api: Api) -> None:
    task_id = await api.trigger("k")
    claimed = await claim(api)
    (record,) = (await task_view(api, task_id))["attempts"]
    beat = await post(
        api,
        "heartbeat",
        {
            "worker_id": WORKER,
            "job_id": claimed["job_id"],
            "lease_token": claimed["lease_token"],
            "attempt_id": record["attempt_id"],
        },
    )
    assert beat.status_code == 200, beat.text
    assert set(beat.json()) == {"ok", "lease_expires_at", "directive"}
    assert beat.json()["ok"] is True and beat.json()["directive"] == "run"
    other_task = await api.trigger("k2")
    for unknown in (str(uuid.uuid4()), None):
        attempt_id = unknown
        if attempt_id is None:  # an attempt of another job
            other = await claim(api)
            assert other["job_id"] == str(other_task)
            attempt_id = (await task_view(api, other_task))["attempts"][0]["attempt_id"]
        missing = await post(api, "complete", report(claimed, attempt_id=attempt_id))
        assert missing.status_code == 404, missing.text
        assert missing.json()["error"] == "not_found" and missing.json()["ack"] is True
    done = await post(api, "complete", report(claimed, attempt_id=record["attempt_id"]))
    assert done.status_code == 200 and done.json()["duplicate"] is False


async def test_report_fields_are_validated(api: Api) -> None:
    await api.trigger("k")
    claimed = await claim(api)
    base = report(claimed)
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("complete", {"worker_id": ""}, "worker_id"),
        ("complete", {"job_id": "not-a-uuid"}, "job_id"),
        ("complete", {"attempt_id": 0}, "attempt_id"),
        ("complete", {"attempt_id": "3"}, "attempt_id"),
        ("complete", {"lease_token": "x"}, "lease_token"),
        ("complete", {"stream": ""}, "stream"),
        ("complete", {"message_id": " "}, "message_id"),
        ("complete", {"result": {"timings": {"bad": "a\u0000b"}}}, "result"),
        ("complete", {"result": {"outputs": "many"}}, "result.outputs"),
        ("fail", {}, "error"),
        ("fail", {"error": {}}, "error.message"),
        ("fail", {"error": {"message": "x", "retryable": "no"}}, "error.retryable"),
        ("fail", {"error": {"message": "x", "code": ""}}, "error.code"),
        ("fail", {"error": {"message": "x", "stack": 5}}, "error.stack"),
        ("fail", {"error": {"message": "x", "extra": 1}}, "error.extra"),
        ("heartbeat", {"lease_token": None}, "lease_token"),
    ]
    for route, change, field in cases:
        body = {**base, **change}
        if route == "heartbeat":
            body = {k: body[k] for k in ("worker_id", "job_id", "lease_token")}
        response = await post(api, route, body)
        assert response.status_code == 400, (route, change, response.text)
        assert response.json()["field"].startswith(field), (route, change, response.json())
    # Nothing was recorded by the refused calls.
    (attempt,) = (await task_view(api, claimed["job_id"]))["attempts"]
    assert attempt["status"] == "Running"


async def test_a_long_stack_is_truncated_never_refused(api: Api) -> None:
    task_id = await api.trigger("k")
    claimed = await claim(api)
    stack = "frame\n" * (MAX_STACK // 3) + "ValueError: the end"
    message = "m" * (MAX_ERROR_MESSAGE + 100)
    error = {"code": "E", "message": message, "stack": stack, "retryable": True}
    failed = await post(api, "fail", report(claimed, error=error))
    assert failed.status_code == 200, failed.text
    kept = (await task_view(api, task_id))["attempts"][0]["error"]
    assert kept["stack"].endswith("ValueError: the end")
    assert kept["stack"].startswith("[... ") and len(kept["stack"]) < MAX_STACK + 64
    assert kept["message"].startswith("m" * MAX_ERROR_MESSAGE)
    assert len(kept["message"]) < MAX_ERROR_MESSAGE + 64
    assert kept["code"] == "E" and kept["retryable"] is True


async def test_an_unknown_task_is_404(api: Api) -> None:
    response = await api.client.get(f"/internal/tasks/{uuid.uuid4()}")
    assert response.status_code == 404, response.text


# --- trace-lite tasks -----------------------------------------------------------


async def test_trace_lite_tasks_shows_attempts_with_results_and_errors(
    repo: SqlRepository, clock: ManualClock, database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    async with api_platform(repo, clock) as api:
        task_id = await api.trigger("k")
        first = await claim(api)
        error = {"code": "E_FLAKY", "message": "connection reset\nmore", "retryable": True}
        assert (await post(api, "fail", report(first, error=error))).status_code == 200
        api.clock.advance(3600)
        await api.dispatcher.retries.run_once()
        second = await claim(api)
        done = await post(api, "complete", report(second, result={"timings": {"run_s": 2}}))
        assert done.status_code == 200
        records = (await task_view(api, task_id))["attempts"]
    argv = ["tasks", "api", "--db", database_url, "--attempts"]
    assert await anyio.to_thread.run_sync(main, argv) == 0
    out = capsys.readouterr().out
    assert f"attempts of {task_id}:" in out
    lines = out.splitlines()
    one = next(line for line in lines if records[0]["attempt_id"] in line)
    two = next(line for line in lines if records[1]["attempt_id"] in line)
    assert "Failed" in one and "error E_FLAKY: connection reset" in one and "more" not in one
    assert "Completed" in two and '{"timings":{"run_s":2}}' in two
    assert await anyio.to_thread.run_sync(main, argv[:-1]) == 0
    assert "attempts of" not in capsys.readouterr().out


async def test_the_task_contract_routes_open_and_close_records_too(api: Api) -> None:
    """``/internal/task-claim`` and ``/internal/task-complete`` (interface-contracts.md)
    reach the same claim and finishing writes: their attempts are recorded alike."""
    task_id = await api.trigger("k")
    claimed = await api.claim(task_id, "http-worker")
    fence = {"task_id": str(task_id), "attempt": 1, "lease_token": claimed["lease_token"]}
    response = await api.client.post(
        "/internal/task-complete",
        json={**fence, "status": "Failed", "error_message": "disk full"},
    )
    assert response.status_code == 200, response.text
    (failed,) = (await task_view(api, task_id))["attempts"]
    assert (failed["worker_id"], failed["status"]) == ("http-worker", "Failed")
    assert failed["error"] == {
        "code": "error",
        "message": "disk full",
        "stack": None,
        "retryable": True,
    }
