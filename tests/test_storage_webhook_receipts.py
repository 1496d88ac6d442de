"""Parity of the webhook receipts area (``tx.webhook_receipts``) on both engines."""

from __future__ import annotations

import uuid
from datetime import timedelta

import anyio.lowlevel
import pytest

from tests.factories import run_on_separate_repos
from trace_core.clock import ManualClock
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio


async def test_a_nonce_is_unused_once_until_it_expires(
    repo: SqlRepository, clock: ManualClock
) -> None:
    now = clock.now()
    expires = now + timedelta(minutes=10)
    async with repo.transaction() as tx:
        assert await tx.webhook_receipts.remember_nonce_if_unused(
            "n" * 20, now=now, expires_at=expires
        )
        assert not await tx.webhook_receipts.remember_nonce_if_unused(
            "n" * 20, now=now, expires_at=expires
        )
        assert await tx.webhook_receipts.remember_nonce_if_unused(
            "m" * 20, now=now, expires_at=expires
        )
    # Still inside the window, in another transaction: a replay.
    later = now + timedelta(minutes=9)
    async with repo.transaction() as tx:
        assert not await tx.webhook_receipts.remember_nonce_if_unused(
            "n" * 20, now=later, expires_at=later + timedelta(minutes=10)
        )
    # Expired but not pruned: taken over, with the new expiry kept.
    after = expires + timedelta(seconds=1)
    async with repo.transaction() as tx:
        assert await tx.webhook_receipts.remember_nonce_if_unused(
            "n" * 20, now=after, expires_at=after + timedelta(minutes=10)
        )
        assert not await tx.webhook_receipts.remember_nonce_if_unused(
            "n" * 20, now=after, expires_at=after + timedelta(minutes=10)
        )


async def test_an_event_is_new_once_and_a_rollback_forgets_it(
    repo: SqlRepository, clock: ManualClock
) -> None:
    event = uuid.uuid4()
    with pytest.raises(RuntimeError):
        async with repo.transaction() as tx:
            assert await tx.webhook_receipts.remember_event_if_new(event, now=clock.now())
            raise RuntimeError("processing failed")
    async with repo.transaction() as tx:
        assert await tx.webhook_receipts.remember_event_if_new(event, now=clock.now())
        assert not await tx.webhook_receipts.remember_event_if_new(event, now=clock.now())
    async with repo.transaction() as tx:
        assert not await tx.webhook_receipts.remember_event_if_new(event, now=clock.now())
        assert await tx.webhook_receipts.remember_event_if_new(uuid.uuid4(), now=clock.now())


async def test_concurrent_first_deliveries_of_one_event_make_one_new(
    database_url: str, clock: ManualClock
) -> None:
    event = uuid.uuid4()
    results: list[bool] = []

    async def deliver(r: SqlRepository, n: int) -> None:
        async with r.transaction() as tx:
            results.append(await tx.webhook_receipts.remember_event_if_new(event, now=clock.now()))
            # let the others reach their insert while this one is open
            await anyio.lowlevel.checkpoint()

    await run_on_separate_repos(database_url, 4, deliver)
    assert sorted(results) == [False, False, False, True]


async def test_prune_removes_only_expired_nonces_and_old_events_up_to_the_limit(
    repo: SqlRepository, clock: ManualClock
) -> None:
    now = clock.now()
    events = [uuid.uuid4() for _ in range(3)]
    async with repo.transaction() as tx:
        for i in range(3):
            await tx.webhook_receipts.remember_nonce_if_unused(
                f"expired-nonce-{i:04d}", now=now, expires_at=now + timedelta(seconds=1)
            )
            await tx.webhook_receipts.remember_event_if_new(events[i], now=now)
        await tx.webhook_receipts.remember_nonce_if_unused(
            "live-nonce-000000", now=now, expires_at=now + timedelta(hours=1)
        )
        fresh = uuid.uuid4()
        await tx.webhook_receipts.remember_event_if_new(fresh, now=now + timedelta(days=2))
    later = now + timedelta(minutes=1)
    async with repo.transaction() as tx:
        assert await tx.webhook_receipts.prune_expired_nonces(now=later, limit=2) == 2
        assert await tx.webhook_receipts.prune_expired_nonces(now=later, limit=10) == 1
        assert await tx.webhook_receipts.prune_expired_nonces(now=later, limit=10) == 0
        cutoff = now + timedelta(days=1)
        assert await tx.webhook_receipts.prune_events_received_before(cutoff, limit=10) == 3
        assert await tx.webhook_receipts.prune_events_received_before(cutoff, limit=10) == 0
    async with repo.transaction() as tx:
        # The live nonce and the fresh event were kept; the pruned event is new again.
        assert not await tx.webhook_receipts.remember_nonce_if_unused(
            "live-nonce-000000", now=later, expires_at=later + timedelta(hours=1)
        )
        assert not await tx.webhook_receipts.remember_event_if_new(fresh, now=later)
        assert await tx.webhook_receipts.remember_event_if_new(events[0], now=later)
