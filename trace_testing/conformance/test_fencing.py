"""Fencing: every write under a lease is refused unless its fence is current.

A fence is (item, attempt, lease token, claim version). Each write (heartbeat,
complete, fail, and the batch completion) is tried under a stale fence, on
the task queue and on the outbox queue: the write raises
:class:`~trace_core.errors.StaleClaim` (the batch form leaves the item out)
and the item's ownership state is exactly what it was. A finished attempt's
own fence may instead meet :class:`~trace_core.errors.InvalidTransition`
(its token is still the item's, but a finished item has nowhere to go).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from trace_core.clock import ManualClock
from trace_core.errors import InvalidTransition, StaleClaim
from trace_core.leasing import LeaseConfig, LeaseQueue
from trace_core.model import OUTBOX, Fence, ItemState
from trace_core.outbox import write_outbox
from trace_core.storage.protocol import NewOutboxRow
from trace_core.storage.sql import SqlRepository
from trace_testing.conformance._support import LEASE_SECONDS, RETRY, make_tasks, task_queue

pytestmark = pytest.mark.anyio

QUEUES = ("tasks", "outbox")


async def _queue_with_item(
    name: str, repo: SqlRepository, clock: ManualClock
) -> tuple[LeaseQueue, Any]:
    if name == "tasks":
        tasks = task_queue(repo, clock)
        (task,) = await make_tasks(tasks, 1)
        return tasks.leases, task
    queue = LeaseQueue(
        repo, OUTBOX, clock=clock, config=LeaseConfig(lease_seconds=LEASE_SECONDS), retry=RETRY
    )
    async with repo.transaction() as tx:
        (row,) = await write_outbox(tx, [NewOutboxRow("conformance", {"n": 1})], clock.now())
    return queue, row


Write = Callable[[LeaseQueue, Fence], Awaitable[Any]]


async def _heartbeat(queue: LeaseQueue, fence: Fence) -> Any:
    return await queue.heartbeat(fence)


async def _complete(queue: LeaseQueue, fence: Fence) -> Any:
    return await queue.complete(fence)


async def _fail(queue: LeaseQueue, fence: Fence) -> Any:
    return await queue.fail(fence, "a stale holder's failure")


WRITES: dict[str, Write] = {"heartbeat": _heartbeat, "complete": _complete, "fail": _fail}


async def _refused(queue: LeaseQueue, fence: Fence, *, finished: bool = False) -> None:
    """Every write under ``fence`` is refused and changes nothing."""
    refusals: tuple[type[Exception], ...] = (
        (StaleClaim, InvalidTransition) if finished else (StaleClaim,)
    )
    before = await queue.inspect(fence.item_id)
    for name, write in WRITES.items():
        with pytest.raises(refusals):
            await write(queue, fence)
        assert await queue.inspect(fence.item_id) == before, f"a refused {name} changed the item"
    assert await queue.complete_many([fence]) == set(), "the batch completion accepted it"
    assert await queue.inspect(fence.item_id) == before, "a refused batch completion changed it"


@pytest.mark.parametrize("queue_name", QUEUES)
async def test_a_finished_attempts_fence_changes_nothing(
    queue_name: str, trace_repository: SqlRepository, trace_clock: ManualClock
) -> None:
    queue, item = await _queue_with_item(queue_name, trace_repository, trace_clock)
    (lease,) = await queue.claim_batch("holder", 1)
    assert lease.item_id == item
    await queue.complete(lease.fence)
    finished: ItemState = await queue.inspect(item)
    await _refused(queue, lease.fence, finished=True)
    trace_clock.advance(LEASE_SECONDS * 10)
    assert (await queue.reclaim_expired()).retried == []
    assert await queue.inspect(item) == finished


@pytest.mark.parametrize("queue_name", QUEUES)
async def test_a_superseded_attempts_fence_changes_nothing(
    queue_name: str, trace_repository: SqlRepository, trace_clock: ManualClock
) -> None:
    queue, item = await _queue_with_item(queue_name, trace_repository, trace_clock)
    (old,) = await queue.claim_batch("paused", 1)
    trace_clock.advance(LEASE_SECONDS + 1)
    assert (await queue.reclaim_expired()).retried == [item]
    trace_clock.advance(2)
    await queue.requeue_due()
    (new,) = await queue.claim_batch("successor", 1)
    assert new.attempt == old.attempt + 1

    await _refused(queue, old.fence)
    await queue.heartbeat(new.fence)
    await queue.complete(new.fence)
    assert (await queue.inspect(item)).attempt == new.attempt


@pytest.mark.parametrize("queue_name", QUEUES)
@pytest.mark.parametrize("forged", ["lease_token", "attempt", "claim_version"])
async def test_a_forged_fence_of_a_live_lease_changes_nothing(
    queue_name: str, forged: str, trace_repository: SqlRepository, trace_clock: ManualClock
) -> None:
    queue, _ = await _queue_with_item(queue_name, trace_repository, trace_clock)
    (lease,) = await queue.claim_batch("holder", 1)
    fence = lease.fence
    wrong: dict[str, Any] = {
        "lease_token": uuid.uuid4(),
        "attempt": fence.attempt + 1,
        "claim_version": (fence.claim_version or 0) + 1,
    }
    await _refused(queue, dataclasses.replace(fence, **{forged: wrong[forged]}))
    await queue.complete(fence)  # the real holder is unaffected


async def test_a_batch_completion_applies_only_current_fences(
    trace_repository: SqlRepository, trace_clock: ManualClock
) -> None:
    tasks = task_queue(trace_repository, trace_clock)
    ids = await make_tasks(tasks, 4)
    leases = await tasks.claim_batch("holder", 4)
    assert {lease.item_id for lease in leases} == set(ids)
    stale = [dataclasses.replace(lease.fence, lease_token=uuid.uuid4()) for lease in leases[:2]]
    current = [lease.fence for lease in leases[2:]]
    assert await tasks.complete_many([*stale, *current]) == {f.item_id for f in current}
    for fence in stale:
        assert (await tasks.leases.inspect(fence.item_id)).status == "Running"
