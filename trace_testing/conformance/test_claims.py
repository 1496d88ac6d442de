"""Claim exclusivity: a queued item is leased to one claimer at a time."""

from __future__ import annotations

import uuid
from collections import Counter

import anyio
import pytest

from trace_core.clock import ManualClock
from trace_core.storage.sql import SqlRepository
from trace_testing.conformance._support import make_tasks, repositories, task_queue

pytestmark = pytest.mark.anyio

CLAIMERS = 4


async def test_concurrent_batch_claimers_lease_each_task_once(
    trace_database_url: str, trace_repository: SqlRepository, trace_clock: ManualClock
) -> None:
    tasks = await make_tasks(task_queue(trace_repository, trace_clock), 60)
    claims: list[tuple[uuid.UUID | int, str]] = []

    async def claimer(repo: SqlRepository, name: str) -> None:
        queue = task_queue(repo, trace_clock)
        while leases := await queue.claim_batch(name, 5):
            claims.extend((lease.item_id, name) for lease in leases)

    async with repositories(trace_database_url, CLAIMERS) as repos, anyio.create_task_group() as tg:
        for i, repo in enumerate(repos):
            tg.start_soon(claimer, repo, f"claimer-{i}")

    counts = Counter(task for task, _ in claims)
    assert set(counts) == set(tasks), "every queued task is claimed"
    assert [task for task, n in counts.items() if n > 1] == [], "no task is leased twice"


async def test_concurrent_claims_of_one_task_grant_one_lease(
    trace_database_url: str, trace_repository: SqlRepository, trace_clock: ManualClock
) -> None:
    (task,) = await make_tasks(task_queue(trace_repository, trace_clock), 1)
    granted: list[str] = []
    refused: list[str] = []

    async def claimer(repo: SqlRepository, name: str) -> None:
        outcome = await task_queue(repo, trace_clock).claim(task, name)
        (granted if outcome.claimed else refused).append(name)

    async with repositories(trace_database_url, CLAIMERS) as repos, anyio.create_task_group() as tg:
        for i, repo in enumerate(repos):
            tg.start_soon(claimer, repo, f"claimer-{i}")

    assert len(granted) == 1, granted
    assert len(refused) == CLAIMERS - 1
    state = await task_queue(trace_repository, trace_clock).leases.inspect(task)
    assert (state.status, state.attempt) == ("Running", 1)


async def test_a_leased_task_is_not_claimed_again_while_its_lease_lasts(
    trace_repository: SqlRepository, trace_clock: ManualClock
) -> None:
    queue = task_queue(trace_repository, trace_clock)
    (task,) = await make_tasks(queue, 1)
    (lease,) = await queue.claim_batch("first", 10)
    assert lease.item_id == task
    remaining = (lease.expires_at - trace_clock.now()).total_seconds()
    assert remaining > 0
    trace_clock.advance(0.9 * remaining)
    assert await queue.claim_batch("second", 10) == []
    outcome = await queue.claim(task, "second")
    assert not outcome.claimed and outcome.reason is not None
