"""Outbox atomicity: a row exists exactly when its transaction commits, and
the relay performs every committed row at least once."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import pytest

from trace_core.clock import ManualClock
from trace_core.errors import InvalidTransition, StaleClaim
from trace_core.outbox import OutboxRelay, RelayConfig, write_outbox
from trace_core.storage.protocol import NewOutboxRow
from trace_core.storage.sql import SqlRepository
from trace_testing.conformance._support import RETRY, make_tasks, task_queue

pytestmark = pytest.mark.anyio

KIND = "conformance_effect"


class _Rollback(Exception):
    """Raised inside a transaction to roll it back."""


class Effects:
    """An outbox handler that records each payload it performs."""

    def __init__(self, failures: int = 0) -> None:
        self.done: Counter[int] = Counter()
        self.failures = failures

    async def __call__(self, payload: Mapping[str, Any]) -> None:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("the side effect failed; the relay retries it")
        self.done[int(payload["n"])] += 1


def _relay(repo: SqlRepository, clock: ManualClock, effects: Effects) -> OutboxRelay:
    return OutboxRelay(
        repo,
        {KIND: effects},
        clock=clock,
        config=RelayConfig(batch_size=7, lease_seconds=30.0),
        retry=RETRY,
        worker_id="conformance-relay",
    )


async def _drain(relay: OutboxRelay) -> int:
    handled = 0
    while n := await relay.run_once():
        handled += n
    return handled


async def test_a_rolled_back_transaction_leaves_no_outbox_row(
    trace_repository: SqlRepository, trace_clock: ManualClock
) -> None:
    effects = Effects()
    with pytest.raises(_Rollback):
        async with trace_repository.transaction() as tx:
            await write_outbox(tx, [NewOutboxRow(KIND, {"n": 1})], trace_clock.now())
            raise _Rollback
    async with trace_repository.transaction() as tx:
        await write_outbox(tx, [NewOutboxRow(KIND, {"n": 2})], trace_clock.now())
    assert await _drain(_relay(trace_repository, trace_clock, effects)) == 1
    assert effects.done == Counter({2: 1})


async def test_an_outbox_row_commits_with_the_state_change_it_belongs_to(
    trace_repository: SqlRepository, trace_clock: ManualClock
) -> None:
    tasks = task_queue(trace_repository, trace_clock)
    (task,) = await make_tasks(tasks, 1)
    (lease,) = await tasks.claim_batch("holder", 1)
    effects = Effects()
    # The fenced completion and its side effect's row: both or neither.
    async with trace_repository.transaction() as tx:
        await write_outbox(tx, [NewOutboxRow(KIND, {"n": 7})], trace_clock.now())
        await tasks.complete(lease.fence, tx=tx)
    with pytest.raises((StaleClaim, InvalidTransition)):
        async with trace_repository.transaction() as tx:
            await write_outbox(tx, [NewOutboxRow(KIND, {"n": 8})], trace_clock.now())
            await tasks.complete(lease.fence, tx=tx)
    relay = _relay(trace_repository, trace_clock, effects)
    await _drain(relay)
    assert effects.done == Counter({7: 1}), "the refused completion's row was rolled back"
    assert (await tasks.leases.inspect(task)).status == "Completed"


async def test_the_relay_performs_every_committed_row_once_when_nothing_fails(
    trace_repository: SqlRepository, trace_clock: ManualClock
) -> None:
    async with trace_repository.transaction() as tx:
        await write_outbox(tx, [NewOutboxRow(KIND, {"n": i}) for i in range(30)], trace_clock.now())
    effects = Effects()
    relay = _relay(trace_repository, trace_clock, effects)
    assert await _drain(relay) == 30
    assert effects.done == Counter(dict.fromkeys(range(30), 1))
    trace_clock.advance(3600)
    assert await _drain(relay) == 0, "a row marked done is not performed again"


async def test_a_failed_side_effect_is_retried_until_it_is_done(
    trace_repository: SqlRepository, trace_clock: ManualClock
) -> None:
    async with trace_repository.transaction() as tx:
        await write_outbox(tx, [NewOutboxRow(KIND, {"n": 1})], trace_clock.now())
    effects = Effects(failures=2)
    relay = _relay(trace_repository, trace_clock, effects)
    for _ in range(3):
        await _drain(relay)
        trace_clock.advance(2)  # past the retry's backoff
    assert effects.done == Counter({1: 1})


async def test_a_relay_that_dies_holding_rows_loses_none(
    trace_database_url: str, trace_repository: SqlRepository, trace_clock: ManualClock
) -> None:
    async with trace_repository.transaction() as tx:
        await write_outbox(tx, [NewOutboxRow(KIND, {"n": i}) for i in range(5)], trace_clock.now())
    crashed = _relay(trace_repository, trace_clock, Effects())
    held = await crashed.leases.claim_batch("crashed-relay", 5)
    assert len(held) == 5  # claimed, never handled: the process died here
    effects = Effects()
    survivor = _relay(trace_repository, trace_clock, effects)
    assert await _drain(survivor) == 0, "held rows wait for their lease to expire"
    trace_clock.advance(31)
    await _drain(survivor)
    trace_clock.advance(2)
    await _drain(survivor)
    assert effects.done == Counter(dict.fromkeys(range(5), 1))
