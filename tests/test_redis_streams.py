"""The v1 claim route on the Redis Streams transport, on both engines, with a
real ``redis-server``: the real message id, acknowledgement after the
database, duplicates, messages of finished jobs, ``FLUSHALL``, a restarted
server, a consumer that died holding pending messages, and a control plane
that died between its commit and the ack."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis

from tests.api_fixtures import DOWNSTREAM, STREAM, Api, api_platform, partition
from tests.factories import wait_until
from trace_core.clock import ManualClock
from trace_core.ports import StreamMessage, StreamTransportUnavailable
from trace_core.storage.sql import SqlRepository
from trace_lite.redis_server import RedisServer
from trace_lite.redis_streams import RedisStreams

pytestmark = pytest.mark.anyio


class _Killed(BaseException):
    """The control plane's death at the fault point (not an error it could handle)."""


def _transport(url: str, **options: Any) -> RedisStreams:
    # A prefix per test keeps tests apart on the shared server; takeovers are
    # immediate so that a "dead" consumer's messages move on without waiting.
    options.setdefault("claim_idle_seconds", 0)
    options.setdefault("takeover_interval_seconds", 0)
    return RedisStreams.from_url(url, prefix=f"t{uuid.uuid4().hex[:8]}:", **options)


@asynccontextmanager
async def _platform(
    repo: SqlRepository, clock: ManualClock, streams: RedisStreams
) -> AsyncIterator[Api]:
    async with api_platform(repo, clock, wakeups=streams) as platform:
        yield platform


@pytest.fixture
async def streams(redis_url: str) -> AsyncIterator[RedisStreams]:
    transport = _transport(redis_url)
    yield transport
    await transport.close()


@pytest.fixture
async def api(repo: SqlRepository, clock: ManualClock, streams: RedisStreams) -> Any:
    async with _platform(repo, clock, streams) as platform:
        yield platform


async def _claim(api: Api, worker: str = "w1", wait_ms: int = 0) -> dict[str, Any]:
    response = await api.client.post(
        "/internal/worker/claim",
        json={"worker_id": worker, "streams": [STREAM], "max_wait_ms": wait_ms},
    )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def _fence(claimed: dict[str, Any], worker: str = "w1") -> dict[str, Any]:
    """The fields every v1 report of the claimed attempt carries."""
    keys = ("job_id", "attempt_id", "lease_token", "stream", "message_id")
    return {"worker_id": worker, **{k: claimed[k] for k in keys}}


async def _complete(api: Api, claimed: dict[str, Any], worker: str = "w1") -> None:
    report = {
        **_fence(claimed, worker),
        "result": {"events": []},
    }
    response = await api.client.post("/internal/worker/complete", json=report)
    assert response.status_code == 200, response.text
    assert response.json()["ack"] is True


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def _messages(
    streams: RedisStreams, key: str | None = None
) -> list[tuple[str, dict[str, str]]]:
    entries: Any = await streams.client.xrange(key or streams.key(STREAM))
    return [(_text(i), {_text(k): _text(v) for k, v in f.items()}) for i, f in entries]


async def _trigger(api: Api, key: str) -> uuid.UUID:
    task_id = await api.trigger(key)
    while await api.dispatcher.relay.run_once():  # the launcher XADDs after the commit
        pass
    return task_id


async def _statuses(api: Api) -> dict[uuid.UUID, tuple[str, int]]:
    return {t["id"]: (t["status"], t["attempt"]) for t in await api.tasks_of("follow")}


# --- the transport and the claim's fields --------------------------------------


async def test_claim_answers_the_real_message_id_and_acks_after_completion(
    api: Api, streams: RedisStreams
) -> None:
    task_id = await _trigger(api, "run-1")
    [(message_id, fields)] = await _messages(streams)
    assert fields["job_id"] == str(task_id) and len(fields["enqueue_id"]) == 32

    claimed = await _claim(api)
    assert claimed["claimed"] is True and claimed["source"] == "stream"
    assert claimed["stream"] == STREAM and claimed["message_id"] == message_id
    assert claimed["job_id"] == str(task_id) and claimed["attempt_id"] == 1
    assert claimed["lease_token"] and claimed["payload"]["task_id"] == str(task_id)
    assert claimed["lease_ttl_seconds"] == 30.0 and claimed["heartbeat_interval_seconds"] == 10.0
    # The attempt record names the message that delivered it.
    async with api.dispatcher.repo.transaction() as tx:
        record = await tx.attempts.find_by_number(task_id, 1)
    assert record is not None
    assert (record.stream, record.message_id) == (STREAM, message_id)
    # Pending while it runs: the database has not committed a final state yet.
    assert await streams.pending_count(STREAM) == 1

    await _complete(api, claimed)
    # Acknowledged by the control plane right after the completion committed.
    assert await streams.pending_count(STREAM) == 0
    assert (await _claim(api))["claimed"] is False
    assert await _statuses(api) == {task_id: ("Completed", 1)}


async def test_a_report_naming_another_message_is_409_and_changes_nothing(
    api: Api, streams: RedisStreams
) -> None:
    task_id = await _trigger(api, "run-1")
    claimed = await _claim(api)
    base = _fence(claimed)
    wrong = [
        ("complete", {"message_id": "1-0", "result": {"events": []}}),
        ("complete", {"stream": DOWNSTREAM}),
        ("fail", {"message_id": "1-0", "error": {"message": "x", "retryable": False}}),
    ]
    for route, change in wrong:
        refused = await api.client.post(f"/internal/worker/{route}", json={**base, **change})
        assert refused.status_code == 409, (route, refused.text)
        assert refused.json() == {
            "ok": False,
            "ack": False,  # the named message did not deliver this attempt
            "error": "wrong_message",
            "reason": refused.json()["reason"],
        }
        assert claimed["message_id"] in refused.json()["reason"]
        assert await _statuses(api) == {task_id: ("Running", 1)}
        assert await streams.pending_count(STREAM) == 1  # nothing acknowledged
    await _complete(api, claimed)
    assert await _statuses(api) == {task_id: ("Completed", 1)}
    assert await streams.pending_count(STREAM) == 0


async def test_streams_are_trimmed_and_groups_created_idempotently(redis_url: str) -> None:
    transport = _transport(redis_url, maxlen=10)
    try:
        for _ in range(20):
            await transport.send(STREAM, [uuid.uuid4() for _ in range(50)])
        transport._groups.clear()  # as after a restart of this process: created again
        await transport.send(STREAM, [uuid.uuid4()])
        length = await transport.client.xlen(transport.key(STREAM))
        assert length < 1001 // 2  # MAXLEN ~ trims in whole nodes, far below 1001
        groups = await transport.client.xinfo_groups(transport.key(STREAM))
        assert [g["name"].decode() for g in groups] == ["trace-workers"]
    finally:
        await transport.close()


async def test_an_unreachable_redis_is_reported_as_unavailable() -> None:
    transport = RedisStreams.from_url("redis://127.0.0.1:1/0")
    try:
        with pytest.raises(StreamTransportUnavailable):
            await transport.send(STREAM, [uuid.uuid4()])
    finally:
        await transport.close()


async def test_a_redis_url_of_another_scheme_is_refused() -> None:
    with pytest.raises(ValueError, match="redis url"):
        RedisStreams.from_url("http://127.0.0.1:6379")


async def test_one_read_serves_every_stream_in_priority_order(
    api: Api, streams: RedisStreams
) -> None:
    upstream = await _trigger(api, "run-1")
    claimed = await _claim(api)
    report = {
        "task_id": str(upstream),
        "attempt": 1,
        "lease_token": claimed["lease_token"],
        "status": "Completed",
        "events": [partition(api.blocks, 0, 9)],
    }
    assert (await api.client.post("/internal/task-complete", json=report)).status_code == 200
    await api.dispatcher.run_once()  # routes a `double` task: a message on the downstream
    follow = await _trigger(api, "run-2")  # and a `follow` message on STREAM
    read = await _commands(streams, "xreadgroup")

    body = {"worker_id": "w1", "streams": [DOWNSTREAM, STREAM], "max_wait_ms": 0}
    first = (await api.client.post("/internal/worker/claim", json=body)).json()
    assert (first["stream"], first["source"]) == (DOWNSTREAM, "stream")
    assert first["payload"]["job"]["name"] == "double"
    # One XREADGROUP for both streams: STREAM's message came too, and waits
    # pending at w1 for its next claim.
    assert await _commands(streams, "xreadgroup") == read + 1
    assert await streams.pending_count(STREAM) == 1
    second = (await api.client.post("/internal/worker/claim", json=body)).json()
    assert (second["stream"], second["source"]) == (STREAM, "stream")
    assert second["job_id"] == str(follow)
    assert second["message_id"] == (await _messages(streams))[-1][0]


async def _commands(streams: RedisStreams, command: str) -> int:
    """How many ``command`` calls the server has served (INFO commandstats)."""
    stats: Any = await streams.client.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


# --- duplicates and finished jobs ----------------------------------------------


async def test_a_duplicated_message_is_acknowledged_without_a_second_run(
    api: Api, streams: RedisStreams
) -> None:
    task_id = await _trigger(api, "run-1")
    await streams.send(STREAM, [task_id])  # the relay repeated its delivery
    first = await _claim(api, "w1")
    assert first["claimed"] is True
    second = await _claim(api, "w2")
    assert second["claimed"] is False  # the duplicate: already running, acked and skipped
    assert await streams.pending_count(STREAM) == 1  # only w1's, while it runs
    await _complete(api, first)
    assert await streams.pending_count(STREAM) == 0
    assert (await _claim(api, "w1"))["claimed"] is False
    assert await _statuses(api) == {task_id: ("Completed", 1)}


async def test_a_message_for_a_finished_job_is_acknowledged_and_skipped(
    api: Api, streams: RedisStreams
) -> None:
    task_id = await _trigger(api, "run-1")
    claimed = await _claim(api)
    await _complete(api, claimed)
    await streams.send(STREAM, [task_id])  # late redelivery
    assert (await _claim(api, "w2"))["claimed"] is False
    assert (await _claim(api, "w1"))["claimed"] is False
    assert await streams.pending_count(STREAM) == 0
    assert await _statuses(api) == {task_id: ("Completed", 1)}


async def test_a_dead_lettered_job_gets_a_dlq_message(api: Api, streams: RedisStreams) -> None:
    task_id = await _trigger(api, "run-1")
    claimed = await _claim(api)
    report = {
        **_fence(claimed),
        "error": {"code": "bad", "message": "no", "retryable": False},
    }
    response = await api.client.post("/internal/worker/fail", json=report)
    assert response.status_code == 200 and response.json()["dlq"] is True
    # Copied to the DLQ and acknowledged right after the dead-letter committed.
    assert await streams.pending_count(STREAM) == 0
    [(_, fields)] = await _messages(streams, streams.dlq_key)
    assert fields["job_id"] == str(task_id) and fields["reason"] == "DeadLettered"
    assert fields["message_id"] == claimed["message_id"] and fields["stream"] == STREAM
    # A repeated report is a duplicate: acknowledged again, never copied twice.
    again = await api.client.post("/internal/worker/fail", json=report)
    assert again.status_code == 200 and again.json()["duplicate"] is True
    assert (await _claim(api))["claimed"] is False
    assert len(await _messages(streams, streams.dlq_key)) == 1


async def test_a_retryable_failure_acks_its_message_and_the_retry_sends_a_new_one(
    api: Api, streams: RedisStreams
) -> None:
    task_id = await _trigger(api, "run-1")
    claimed = await _claim(api)
    report = {
        **_fence(claimed),
        "error": {"code": "flaky", "message": "try again", "retryable": True},
    }
    response = await api.client.post("/internal/worker/fail", json=report)
    assert response.status_code == 200
    assert (response.json()["requeued"], response.json()["dlq"]) == (True, False)
    assert await streams.pending_count(STREAM) == 0  # the requeue committed: acked
    api.clock.advance(3600)
    await api.dispatcher.retries.run_once()
    while await api.dispatcher.relay.run_once():  # the retry's own message
        pass
    retried = await _claim(api)
    assert retried["source"] == "stream" and retried["attempt_id"] == 2
    assert retried["message_id"] != claimed["message_id"]
    await _complete(api, retried)
    assert await streams.pending_count(STREAM) == 0
    assert await _statuses(api) == {task_id: ("Completed", 2)}
    assert await _messages(streams, streams.dlq_key) == []


async def test_the_internal_report_acks_the_message_too(api: Api, streams: RedisStreams) -> None:
    # trace-lite worker reports through /internal/task-complete: same ack.
    await _trigger(api, "run-1")
    claimed = await _claim(api)
    report = {
        "task_id": claimed["job_id"],
        "attempt": claimed["attempt_id"],
        "lease_token": claimed["lease_token"],
        "status": "Completed",
    }
    response = await api.client.post("/internal/task-complete", json=report)
    assert response.status_code == 200, response.text
    assert await streams.pending_count(STREAM) == 0


async def test_an_ack_that_fails_never_fails_the_report_and_is_left_to_the_sweep(
    repo: SqlRepository, clock: ManualClock, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Takeovers as in production (idle for minutes): only w1's own read-back acks.
    streams = _transport(redis_url, claim_idle_seconds=120, takeover_interval_seconds=5)
    try:
        async with _platform(repo, clock, streams) as api:
            task_id = await _trigger(api, "run-1")
            claimed = await _claim(api)
            working = streams.client
            streams.client = aioredis.Redis.from_url("redis://127.0.0.1:1/0")  # unreachable
            try:
                await _complete(api, claimed)  # 200, ack: true: the completion committed
            finally:
                await streams.client.aclose()
                streams.client = working
            assert "not acknowledged, left to the sweep" in caplog.text
            assert await streams.pending_count(STREAM) == 1
            # Nothing says w1 holds a message: its next claim does not read them back ...
            assert (await _claim(api))["claimed"] is False
            assert await streams.pending_count(STREAM) == 1
            # ... until the interval passed; then the sweep acknowledges it.
            api.clock.advance(60)
            assert (await _claim(api))["claimed"] is False
            assert await streams.pending_count(STREAM) == 0
            assert await _statuses(api) == {task_id: ("Completed", 1)}
    finally:
        await streams.close()


# --- Redis faults --------------------------------------------------------------


async def test_flushall_loses_messages_but_no_task(api: Api, streams: RedisStreams) -> None:
    ids = {await _trigger(api, f"run-{i}") for i in range(3)}
    await streams.client.flushall()
    done: list[str] = []
    for _ in range(3):
        claimed = await _claim(api)
        assert claimed["claimed"] is True and claimed["source"] == "database"
        await _complete(api, claimed)
        done.append(claimed["job_id"])
    # The groups come back with the next message (NOGROUP recreates them).
    late = await _trigger(api, "run-late")
    claimed = await _claim(api)
    assert claimed["source"] == "stream" and claimed["job_id"] == str(late)
    await _complete(api, claimed)
    assert (await _claim(api))["claimed"] is False
    assert sorted(done) == sorted(str(i) for i in ids)
    assert await _statuses(api) == {t: ("Completed", 1) for t in {*ids, late}}
    assert await streams.pending_count(STREAM) == 0


async def test_a_restarted_redis_loses_nothing(repo: SqlRepository, clock: ManualClock) -> None:
    with RedisServer() as server:
        transport = _transport(server.url)
        try:
            async with _platform(repo, clock, transport) as api:
                first = await _trigger(api, "run-1")
                claimed = await _claim(api)
                assert claimed["source"] == "stream"
                queued = await _trigger(api, "run-2")
                server.restart()  # no persistence: the streams and groups are gone
                await _complete(api, claimed)
                again = await _claim(api)
                assert again["claimed"] is True and again["job_id"] == str(queued)
                await _complete(api, again)
                late = await _trigger(api, "run-3")
                third = await _claim(api)
                assert third["source"] == "stream" and third["job_id"] == str(late)
                await _complete(api, third)
                assert (await _claim(api))["claimed"] is False
                assert await _statuses(api) == {t: ("Completed", 1) for t in (first, queued, late)}
                assert await transport.pending_count(STREAM) == 0
        finally:
            await transport.close()


async def test_a_dead_consumers_pending_message_is_taken_over_and_settled(
    api: Api, streams: RedisStreams
) -> None:
    task_id = await _trigger(api, "run-1")
    lost = await _claim(api, "w-dead")  # the worker is killed while running it
    assert lost["source"] == "stream"
    api.clock.advance(3600)
    await api.dispatcher.reaper.run_once()  # its lease expired: a retry
    api.clock.advance(3600)
    await api.dispatcher.retries.run_once()
    while await api.dispatcher.relay.run_once():  # the retry's own message
        pass
    retried = await _claim(api, "w2")  # takes the dead consumer's message over
    assert retried["claimed"] is True and retried["attempt_id"] == 2
    await _complete(api, retried, "w2")
    assert (await _claim(api, "w2"))["claimed"] is False
    assert await streams.pending_count(STREAM) == 0
    # The dead consumer, with nothing pending and idle, is forgotten.
    consumers: Any = await streams.client.xinfo_consumers(streams.key(STREAM), streams.group)
    assert [_text(c["name"]) for c in consumers] == ["w2"]
    assert await _statuses(api) == {task_id: ("Completed", 2)}


async def test_a_control_plane_killed_between_commit_and_ack(
    repo: SqlRepository, clock: ManualClock, redis_url: str
) -> None:
    killed: list[StreamMessage] = []

    async def die(message: StreamMessage) -> None:
        killed.append(message)
        raise _Killed  # the process ends here: nothing after it runs

    first_streams = _transport(redis_url, between_commit_and_ack=die)
    async with _platform(repo, clock, first_streams) as api:
        task_id = await _trigger(api, "run-1")
        claimed = await _claim(api)
        with pytest.raises(_Killed):
            await _complete(api, claimed)
        assert killed == [StreamMessage(STREAM, claimed["message_id"], task_id)]
        assert await _statuses(api) == {task_id: ("Completed", 1)}  # committed
    await first_streams.client.aclose()
    assert await first_streams.pending_count(STREAM) == 1  # and never acknowledged

    # A new control plane on the same database and Redis (same key prefix).
    second_streams = RedisStreams.from_url(
        redis_url, prefix=first_streams.prefix, claim_idle_seconds=0, takeover_interval_seconds=0
    )
    try:
        async with _platform(repo, clock, second_streams) as api:
            [redelivered] = await second_streams.pending("w1", [STREAM])
            assert redelivered == StreamMessage(
                STREAM, claimed["message_id"], task_id, redelivered.enqueue_id
            )
            assert (await _claim(api, "w1"))["claimed"] is False  # recognised, acked, not run
            assert await second_streams.pending_count(STREAM) == 0
            assert await _statuses(api) == {task_id: ("Completed", 1)}
    finally:
        await second_streams.close()


async def test_the_long_poll_is_woken_by_a_stream_message(api: Api, streams: RedisStreams) -> None:
    answers: list[dict[str, Any]] = []

    async def wait_for_work() -> None:
        answers.append(await _claim(api, wait_ms=10_000))

    async def blocked_in_xreadgroup() -> bool:
        clients: Any = await streams.client.client_list()
        return any(c.get("cmd") == "xreadgroup" and c.get("flags") == "b" for c in clients)

    with anyio.fail_after(20):
        async with anyio.create_task_group() as group:
            group.start_soon(wait_for_work)
            await wait_until(
                "the claim to block in XREADGROUP",
                blocked_in_xreadgroup,
                time.monotonic() + 10,
                describe=streams.client.client_list,
            )
            task_id = await _trigger(api, "run-1")
    [claimed] = answers
    assert claimed["claimed"] is True and claimed["source"] == "stream"
    assert claimed["job_id"] == str(task_id)


async def test_an_unreachable_redis_leaves_claims_to_the_database(
    repo: SqlRepository, clock: ManualClock
) -> None:
    with RedisServer() as server:
        transport = _transport(server.url)
    # The server is gone: the relay's XADD fails (the outbox retries it later).
    try:
        async with _platform(repo, clock, transport) as api:
            task_id = await api.trigger("run-1")
            await api.dispatcher.relay.run_once()
            claimed = await _claim(api, wait_ms=50)
            assert claimed["claimed"] is True and claimed["source"] == "database"
            await _complete(api, claimed)
            assert (await _claim(api))["claimed"] is False
            assert await _statuses(api) == {task_id: ("Completed", 1)}
    finally:
        await transport.close()


# --- configuration -------------------------------------------------------------


def test_serve_takes_the_redis_url_from_the_option_or_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import argparse

    from trace_lite.cli import _serve_arguments

    def parsed(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        _serve_arguments(parser)
        return parser.parse_args(argv)

    monkeypatch.delenv("TRACE_REDIS_URL", raising=False)
    assert parsed().redis_url is None  # no Redis: in-process wake-ups, database claims
    monkeypatch.setenv("TRACE_REDIS_URL", "redis://127.0.0.1:6390/2")
    assert parsed().redis_url == "redis://127.0.0.1:6390/2"
    chosen = parsed("--redis-url", "redis://127.0.0.1:6391/0", "--stream-idle-seconds", "30")
    assert chosen.redis_url == "redis://127.0.0.1:6391/0" and chosen.stream_idle_seconds == 30.0


def test_the_fault_point_is_hidden_and_checked() -> None:
    import argparse

    from trace_core.errors import ConfigurationError
    from trace_lite.cli import _serve_arguments
    from trace_lite.fault_points import check_fault_point

    parser = argparse.ArgumentParser()
    _serve_arguments(parser)
    assert "fault-point" not in parser.format_help()  # for tests, not for users
    assert parser.parse_args([]).fault_point is None
    armed = parser.parse_args(["--fault-point", "between-commit-and-ack"]).fault_point
    check_fault_point(armed, redis_url="redis://127.0.0.1:6379/0")
    check_fault_point(None, redis_url=None)  # nothing armed
    with pytest.raises(ConfigurationError, match=r"--fault-point: 'nope' is not one of"):
        check_fault_point("nope", redis_url="redis://127.0.0.1:6379/0")
    with pytest.raises(ConfigurationError, match="needs --redis-url"):
        check_fault_point(armed, redis_url=None)
