"""The journal area of the port (``tx.journal``), on both engines."""

from __future__ import annotations

import pytest

from tests.event_fixtures import World, make_world
from trace_core.clock import ManualClock
from trace_core.storage.ports import JournalRecord
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio


@pytest.fixture
async def world(repo: SqlRepository, clock: ManualClock) -> World:
    return await make_world(repo, clock)


async def test_entries_are_appended_and_read_newest_first(
    repo: SqlRepository, clock: ManualClock, world: World
) -> None:
    read, make = world.jobs["read"], world.jobs["make"]
    first = clock.now()
    async with repo.transaction() as tx:
        await tx.journal.append(read, "paused", "queue full", now=first, detail={"depth": 9})
        await tx.journal.append(read, "paused", "queue full", now=first)  # alike: two entries
        await tx.journal.append(make, "cron_fired", "other job", now=first)
    later = clock.advance(5)
    async with repo.transaction() as tx:
        await tx.journal.append(read, "resumed", "cleared", now=later)
    async with repo.read() as tx:
        entries = await tx.journal.newest(read, limit=10)
        two = await tx.journal.newest(read, limit=2)
        other = await tx.journal.newest(make, limit=10)
    assert entries == [
        JournalRecord(later, "resumed", "cleared", None),
        JournalRecord(first, "paused", "queue full", None),  # same time: appended last first
        JournalRecord(first, "paused", "queue full", {"depth": 9}),
    ]
    assert two == entries[:2]
    assert other == [JournalRecord(first, "cron_fired", "other job", None)]


async def test_jobs_with_entry_finds_the_jobs_with_an_entry_of_a_kind(
    repo: SqlRepository, clock: ManualClock, world: World
) -> None:
    read, make = world.jobs["read"], world.jobs["make"]
    async with repo.transaction() as tx:
        await tx.journal.append(read, "backfilled", "replayed", now=clock.now())
        await tx.journal.append(read, "backfilled", "again", now=clock.now())
        await tx.journal.append(make, "cron_fired", "fired", now=clock.now())
    async with repo.read() as tx:
        assert await tx.journal.jobs_with_entry("backfilled", [read, make]) == {read}
        assert await tx.journal.jobs_with_entry("cron_fired", [read]) == set()
        assert await tx.journal.jobs_with_entry("backfilled", []) == set()
