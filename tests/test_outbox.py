"""The outbox relay on both engines: delivery, retries, dead letters, wake-ups."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import anyio
import pytest
import sqlalchemy as sa

from tests.factories import make_job, wait_until
from trace_core.clock import Clock, ManualClock, SystemClock
from trace_core.model import OUTBOX
from trace_core.outbox import OutboxRelay, PermanentFailure, RelayConfig, write_outbox
from trace_core.retry import Backoff, RetryPolicy
from trace_core.storage import schema
from trace_core.storage.protocol import NewOutboxRow, NewTask
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import TaskQueue

pytestmark = pytest.mark.anyio

NO_JITTER = RetryPolicy(normal=Backoff(base_seconds=2, cap_seconds=60, jitter=0))


async def rows(repo: SqlRepository) -> list[Any]:
    async with repo.read() as tx:
        return list(
            (
                await tx.connection.execute(sa.select(schema.outbox).order_by(schema.outbox.c.id))
            ).all()
        )


async def add(
    repo: SqlRepository,
    clock: Clock,
    *payloads: dict[str, Any],
    kind: str = "k",
    max_attempts: int = 10,
) -> None:
    async with repo.transaction() as tx:
        await write_outbox(
            tx, [NewOutboxRow(kind, p, max_attempts=max_attempts) for p in payloads], clock.now()
        )


async def test_relay_delivers_and_marks_done(repo: SqlRepository, clock: ManualClock) -> None:
    seen: list[Mapping[str, Any]] = []

    async def handler(payload: Mapping[str, Any]) -> None:
        seen.append(payload)

    await add(repo, clock, {"n": 1}, {"n": 2}, {"n": 3})
    relay = OutboxRelay(repo, {"k": handler}, clock=clock, config=RelayConfig(batch_size=2))
    assert await relay.run_once() == 2
    assert await relay.run_once() == 1
    assert await relay.run_once() == 0
    assert sorted(p["n"] for p in seen) == [1, 2, 3]
    assert {r.status for r in await rows(repo)} == {"Done"}
    assert all(r.processed_at == clock.now() for r in await rows(repo))


async def test_failures_retry_with_backoff_then_dead_letter(
    repo: SqlRepository, clock: ManualClock
) -> None:
    calls = 0

    async def flaky(payload: Mapping[str, Any]) -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError(f"endpoint down ({calls})")

    await add(repo, clock, {"n": 1}, max_attempts=3)
    relay = OutboxRelay(repo, {"k": flaky}, clock=clock, retry=NO_JITTER)
    assert await relay.run_once() == 1
    [row] = await rows(repo)
    assert row.status == "Pending" and row.attempts == 1
    assert row.available_at == clock.now() + timedelta(seconds=2)
    assert await relay.run_once() == 0  # not due yet
    clock.advance(2)
    assert await relay.run_once() == 1
    [row] = await rows(repo)
    assert row.available_at == clock.now() + timedelta(seconds=4)
    clock.advance(4)
    assert await relay.run_once() == 1
    [row] = await rows(repo)
    assert row.status == "Failed"
    assert row.attempts == 3
    assert row.last_error == "RuntimeError: endpoint down (3)"
    clock.advance(3600)
    assert await relay.run_once() == 0
    assert calls == 3


async def test_unknown_kind_and_permanent_errors_dead_letter_at_once(
    repo: SqlRepository, clock: ManualClock
) -> None:
    async def refuse(payload: Mapping[str, Any]) -> None:
        raise PermanentFailure("410 Gone")

    await add(repo, clock, {"n": 1}, kind="nobody")
    await add(repo, clock, {"n": 2}, kind="gone")
    relay = OutboxRelay(repo, {"gone": refuse}, clock=clock)
    assert await relay.run_once() == 2
    by_kind = {r.kind: r for r in await rows(repo)}
    assert by_kind["nobody"].status == "Failed"
    assert "no handler registered for outbox kind 'nobody'" in by_kind["nobody"].last_error
    assert by_kind["gone"].status == "Failed"
    assert by_kind["gone"].attempts == 1


async def test_a_crashed_relay_row_is_reclaimed(repo: SqlRepository, clock: ManualClock) -> None:
    """A relay that claimed and died: after the lease the row is delivered again."""
    await add(repo, clock, {"n": 1})
    config = RelayConfig(lease_seconds=5)
    dead = OutboxRelay(repo, {}, clock=clock, config=config, worker_id="dead")
    assert len(await dead.leases.claim_batch("dead", 10)) == 1  # ...and it never finishes
    seen: list[Mapping[str, Any]] = []

    async def handler(payload: Mapping[str, Any]) -> None:
        seen.append(payload)

    live = OutboxRelay(repo, {"k": handler}, clock=clock, config=config, retry=NO_JITTER)
    assert await live.run_once() == 0
    clock.advance(6)
    await live.run_once()  # reclaims (retry due in 2 s)
    clock.advance(2)
    assert await live.run_once() == 1
    assert seen == [{"n": 1}]
    [row] = await rows(repo)
    assert row.status == "Done" and row.attempts == 2


async def test_relay_wakes_on_commit_not_on_its_poll(repo: SqlRepository) -> None:
    """With a 60 s poll, only the commit's wake-up can deliver within the bound."""
    delivered = anyio.Event()

    async def handler(payload: Mapping[str, Any]) -> None:
        delivered.set()

    clock = SystemClock()
    relay = OutboxRelay(
        repo,
        {"enqueue_task": handler},
        clock=clock,
        config=RelayConfig(poll_min_seconds=60, poll_max_seconds=60),
    )
    job = await make_job(repo, clock.now())
    async with anyio.create_task_group() as tg:
        await relay.start(tg)
        with anyio.fail_after(20):
            await repo.listen("trace_outbox")
            await TaskQueue(repo, clock=clock).create([NewTask(job)])
            await delivered.wait()
        await relay.stop()


async def test_a_freed_slot_is_refilled_while_other_rows_are_in_flight(
    repo: SqlRepository,
) -> None:
    """run() claims rows as they come and handles up to ``concurrency`` at
    once: a row committed while one is busy starts at once, a third waits for
    the first slot that frees, and a finished row is marked done while the
    others are still busy (run_once finishes a whole batch before either)."""
    clock = SystemClock()
    started: list[int] = []
    release = {n: anyio.Event() for n in range(3)}
    busy = 0
    most_busy = 0

    async def handler(payload: Mapping[str, Any]) -> None:
        nonlocal busy, most_busy
        busy += 1
        most_busy = max(most_busy, busy)
        started.append(payload["n"])
        try:
            await release[payload["n"]].wait()
        finally:
            busy -= 1

    relay = OutboxRelay(
        repo,
        {"k": handler},
        clock=clock,
        config=RelayConfig(concurrency=2, poll_min_seconds=60, poll_max_seconds=60),
    )

    def started_are(*expected: int) -> Callable[[], bool]:
        return lambda: started == list(expected)

    async def row_0_done() -> bool:
        return bool((await rows(repo))[0].status == "Done")

    async def all_done() -> bool:
        return {r.status for r in await rows(repo)} == {"Done"}

    async def until(what: str, condition: Callable[[], Any]) -> None:
        await wait_until(what, condition, time.monotonic() + 20, describe=lambda: started)

    async with anyio.create_task_group() as tg:
        await add(repo, clock, {"n": 0})
        await relay.start(tg)
        await until("row 0 to start", started_are(0))
        await add(repo, clock, {"n": 1})
        await until("row 1 to start while row 0 is busy", started_are(0, 1))
        await add(repo, clock, {"n": 2})
        release[0].set()
        await until("row 2 to take row 0's slot", started_are(0, 1, 2))
        assert busy == 2  # row 1 is still busy
        await until("row 0 marked done while the others are busy", row_0_done)
        release[1].set()
        release[2].set()
        await until("every row done", all_done)
        await relay.stop()
    assert most_busy == 2


async def test_relay_in_another_process_is_woken(database_url: str, engine: str) -> None:
    """Postgres: a commit through one pool wakes a relay on another (LISTEN/NOTIFY)."""
    if engine != "postgres":
        pytest.skip("SQLite wake-ups are in-process; other processes poll")
    writer, reader = SqlRepository(database_url), SqlRepository(database_url)
    delivered = anyio.Event()

    async def handler(payload: Mapping[str, Any]) -> None:
        delivered.set()

    clock = SystemClock()
    relay = OutboxRelay(
        reader,
        {"k": handler},
        clock=clock,
        config=RelayConfig(poll_min_seconds=60, poll_max_seconds=60),
    )
    try:
        async with anyio.create_task_group() as tg:
            await relay.start(tg)
            with anyio.fail_after(20):
                assert await reader.listen("trace_outbox")
                async with writer.transaction() as tx:
                    await write_outbox(tx, [NewOutboxRow("k", {})], clock.now())
                await delivered.wait()
            await relay.stop()
    finally:
        await writer.close()
        await reader.close()


def test_relay_config_is_validated() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        RelayConfig(batch_size=0)
    with pytest.raises(ValueError, match="poll_min_seconds"):
        RelayConfig(poll_min_seconds=2, poll_max_seconds=1)
    assert OUTBOX.dead == "Failed"
