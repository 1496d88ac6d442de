"""Idempotency keys: one owner per key, replays, conflicts and expiry."""

from __future__ import annotations

from datetime import timedelta

import anyio
import pytest

from trace_core.clock import ManualClock
from trace_core.errors import IdempotencyConflict, IdempotencyInFlight
from trace_core.idempotency import IdempotencyStore, request_fingerprint
from trace_core.storage.sql import SqlRepository
from trace_testing.conformance._support import repositories

pytestmark = pytest.mark.anyio

SCOPE = "conformance"
FIRST = request_fingerprint("POST", "/things", {"name": "a"})
OTHER = request_fingerprint("POST", "/things", {"name": "b"})


async def test_a_key_is_owned_once_then_replays_its_response(
    trace_repository: SqlRepository, trace_clock: ManualClock
) -> None:
    store = IdempotencyStore(trace_repository, clock=trace_clock)
    assert (await store.begin(SCOPE, "k1", FIRST)).first
    with pytest.raises(IdempotencyInFlight):
        await store.begin(SCOPE, "k1", FIRST)
    assert await store.complete(SCOPE, "k1", FIRST, {"id": 42})
    replay = await store.begin(SCOPE, "k1", FIRST)
    assert not replay.first and replay.response == {"id": 42}
    with pytest.raises(IdempotencyConflict):
        await store.begin(SCOPE, "k1", OTHER)
    assert (await store.begin(SCOPE, "k2", OTHER)).first, "keys are independent"
    assert (await store.begin("another-scope", "k1", OTHER)).first, "so are scopes"


async def test_concurrent_requests_with_one_key_have_one_owner(
    trace_database_url: str, trace_clock: ManualClock
) -> None:
    owners: list[int] = []
    in_flight: list[int] = []

    async def request(repo: SqlRepository, i: int) -> None:
        store = IdempotencyStore(repo, clock=trace_clock)
        try:
            if (await store.begin(SCOPE, "shared", FIRST)).first:
                owners.append(i)
        except IdempotencyInFlight:
            in_flight.append(i)

    async with repositories(trace_database_url, 4) as repos, anyio.create_task_group() as tg:
        for i, repo in enumerate(repos):
            tg.start_soon(request, repo, i)
    assert len(owners) == 1, owners
    assert len(in_flight) == 3


async def test_a_released_or_expired_key_is_taken_over_as_new(
    trace_repository: SqlRepository, trace_clock: ManualClock
) -> None:
    store = IdempotencyStore(trace_repository, clock=trace_clock, ttl=timedelta(minutes=5))
    assert (await store.begin(SCOPE, "k", FIRST)).first
    assert await store.release(SCOPE, "k", FIRST)
    assert (await store.begin(SCOPE, "k", FIRST)).first, "a released key is free again"
    await store.complete(SCOPE, "k", FIRST, {"v": 1})
    trace_clock.advance(301)
    assert (await store.begin(SCOPE, "k", OTHER)).first, "an expired key is new"
    await store.complete(SCOPE, "k", OTHER, {"v": 2})
    assert await store.sweep() == 0, "the live record is not swept"
    trace_clock.advance(301)
    assert await store.sweep() == 1
