"""Idempotency keys on both engines (euterpe-contract.md §9)."""

from __future__ import annotations

from datetime import timedelta

import anyio
import pytest

from trace_core.clock import ManualClock
from trace_core.errors import ConfigurationError, IdempotencyConflict, IdempotencyInFlight
from trace_core.idempotency import IdempotencyStore, request_fingerprint
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio

H1 = request_fingerprint("POST", "/transcode", {"source": "s3://a/b", "n": 1})
H2 = request_fingerprint("POST", "/transcode", {"source": "s3://a/b", "n": 2})


def store(repo: SqlRepository, clock: ManualClock) -> IdempotencyStore:
    return IdempotencyStore(repo, clock=clock, ttl=timedelta(hours=1))


async def test_same_key_same_hash_replays(repo: SqlRepository, clock: ManualClock) -> None:
    s = store(repo, clock)
    assert (await s.begin("req-1", "key-1", H1)).first
    assert await s.complete("req-1", "key-1", H1, {"job_id": "j1", "status": 202})
    replay = await s.begin("req-1", "key-1", H1)
    assert not replay.first
    assert replay.response == {"job_id": "j1", "status": 202}


async def test_same_key_other_hash_conflicts(repo: SqlRepository, clock: ManualClock) -> None:
    s = store(repo, clock)
    await s.begin("req-1", "key-1", H1)
    await s.complete("req-1", "key-1", H1, {"job_id": "j1"})
    with pytest.raises(IdempotencyConflict):
        await s.begin("req-1", "key-1", H2)
    assert (await s.begin("req-1", "key-1", H1)).response == {"job_id": "j1"}


async def test_in_flight_key_is_reported(repo: SqlRepository, clock: ManualClock) -> None:
    s = store(repo, clock)
    await s.begin("req-1", "key-1", H1)
    with pytest.raises(IdempotencyInFlight):
        await s.begin("req-1", "key-1", H1)
    with pytest.raises(IdempotencyConflict):
        await s.begin("req-1", "key-1", H2)


async def test_release_lets_the_request_run_again(repo: SqlRepository, clock: ManualClock) -> None:
    s = store(repo, clock)
    await s.begin("req-1", "key-1", H1)
    assert await s.release("req-1", "key-1", H1)
    assert (await s.begin("req-1", "key-1", H1)).first


async def test_scopes_are_independent(repo: SqlRepository, clock: ManualClock) -> None:
    s = store(repo, clock)
    assert (await s.begin("req-1", "key-1", H1)).first
    assert (await s.begin("req-2", "key-1", H2)).first


async def test_expired_key_is_new_and_swept(repo: SqlRepository, clock: ManualClock) -> None:
    s = store(repo, clock)
    await s.begin("req-1", "old", H1)
    await s.complete("req-1", "old", H1, {"job_id": "j1"})
    await s.begin("req-1", "other", H1)
    clock.advance(3600)
    assert (await s.begin("req-1", "old", H2)).first  # expired: taken over as new
    assert await s.sweep() == 1  # "other" expired; "old" was renewed
    assert (await s.begin("req-1", "other", H2)).first


async def test_completing_someone_elses_key_does_nothing(
    repo: SqlRepository, clock: ManualClock
) -> None:
    s = store(repo, clock)
    await s.begin("req-1", "key-1", H1)
    assert not await s.complete("req-1", "key-1", H2, {"job_id": "x"})
    assert not await s.complete("req-1", "missing", H1, {"job_id": "x"})


async def test_concurrent_identical_requests_have_one_owner(
    database_url: str, clock: ManualClock
) -> None:
    repos = [SqlRepository(database_url) for _ in range(4)]
    owners: list[bool] = []
    refused: list[str] = []

    async def request(r: SqlRepository) -> None:
        try:
            owners.append((await store(r, clock).begin("req-1", "same", H1)).first)
        except IdempotencyInFlight:
            refused.append("in flight")

    try:
        async with anyio.create_task_group() as tg:
            for i in range(20):
                tg.start_soon(request, repos[i % 4])
    finally:
        for r in repos:
            await r.close()
    assert owners.count(True) == 1
    assert len(owners) + len(refused) == 20


@pytest.mark.parametrize("key", ["", "x" * 256, "tab\there", "é"])
async def test_bad_keys_are_refused(repo: SqlRepository, clock: ManualClock, key: str) -> None:
    with pytest.raises(ConfigurationError, match="idempotency key"):
        await store(repo, clock).begin("req-1", key, H1)


def test_fingerprint_is_canonical() -> None:
    a = request_fingerprint("post", "/x", {"b": 1, "a": [1, 2]})
    b = request_fingerprint("POST", "/x", {"a": [1, 2], "b": 1})
    assert a == b
    assert a != request_fingerprint("POST", "/y", {"a": [1, 2], "b": 1})
    assert a.startswith("sha256:")
