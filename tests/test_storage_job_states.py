"""The job-states area of the port (``tx.job_states``), on both engines."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from tests.test_storage_tasks import jobs
from trace_core.clock import ManualClock
from trace_core.errors import InvalidInput
from trace_core.storage import schema
from trace_core.storage.ports import ScaleState
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio


async def rows(repo: SqlRepository) -> dict[uuid.UUID, dict[str, Any]]:
    """Every ``job_states`` row by job id."""
    s = schema.job_states
    async with repo.read() as tx:
        found = await tx.connection.execute(sa.select(s))
    return {row.job_id: dict(row._mapping) for row in found}


async def test_ensure_creates_missing_rows_and_leaves_existing_ones(
    repo: SqlRepository, clock: ManualClock
) -> None:
    a, b = await jobs(repo, clock, ("spark", "a"), ("spark", "b"))
    async with repo.transaction() as tx:
        await tx.job_states.ensure([], now=clock.now())
    assert await rows(repo) == {}
    async with repo.transaction() as tx:
        await tx.job_states.ensure([a], now=clock.now())
        await tx.job_states.update_if_matches(a, {"paused": True}, now=clock.now())
    created_a = clock.now()
    clock.advance(5)
    async with repo.transaction() as tx:
        await tx.job_states.ensure([b, a, b], now=clock.now())
    found = await rows(repo)
    assert found[a]["paused"] is True and found[a]["updated_at"] == created_a
    assert found[b]["paused"] is False and found[b]["updated_at"] == clock.now()
    assert found[b]["scale_state"] == "Idle" and found[b]["source_restarts"] == 0


async def test_update_if_matches_creates_the_row_and_sets_values_under_its_guard(
    repo: SqlRepository, clock: ManualClock
) -> None:
    a, b = await jobs(repo, clock, ("spark", "a"), ("spark", "b"))
    fire = clock.now() + timedelta(minutes=1)
    async with repo.transaction() as tx:
        ops = tx.job_states
        # No row yet: created, and None matches an unset field.
        assert await ops.update_if_matches(
            a, {"next_fire_at": fire}, now=clock.now(), expected={"next_fire_at": None}
        )
        # The guard no longer holds: nothing set.
        assert not await ops.update_if_matches(
            a, {"next_fire_at": None}, now=clock.now(), expected={"next_fire_at": None}
        )
        assert not await ops.update_if_matches(
            a,
            {"source_status": "Running"},
            now=clock.now(),
            expected={"next_fire_at": fire, "source_status": "Pending"},
        )
        clock.advance(1)
        assert await ops.update_if_matches(
            a,
            {"source_status": "Pending"},
            now=clock.now(),
            expected={"next_fire_at": fire, "source_status": None},
        )
        # Unguarded: sets whatever the row holds.
        assert await ops.update_if_matches(b, {"paused": True}, now=clock.now())
    found = await rows(repo)
    assert found[a]["next_fire_at"] == fire and found[a]["source_status"] == "Pending"
    assert found[a]["updated_at"] == clock.now()
    assert found[a]["paused"] is False  # other fields are left alone
    assert found[b]["paused"] is True and found[b]["next_fire_at"] is None


@pytest.mark.parametrize("where", ["values", "expected"])
async def test_update_if_matches_refuses_a_field_it_does_not_know(
    repo: SqlRepository, clock: ManualClock, where: str
) -> None:
    (a,) = await jobs(repo, clock, ("spark", "a"))
    fields: dict[str, dict[str, object]] = {"values": {"paused": True}, "expected": {}}
    fields[where] = {"updated_at": None}
    async with repo.transaction() as tx:
        with pytest.raises(InvalidInput) as caught:
            await tx.job_states.update_if_matches(
                a, fields["values"], now=clock.now(), expected=fields["expected"]
            )
    assert caught.value.field == f"{where}.updated_at"
    assert await rows(repo) == {}


async def test_pauses_are_read_and_lifted_only_when_ours(
    repo: SqlRepository, clock: ManualClock
) -> None:
    ours, by_hand, wild, never = await jobs(
        repo, clock, ("spark", "a"), ("spark", "b"), ("spark", "c"), ("spark", "d")
    )
    now = clock.now()
    async with repo.transaction() as tx:
        ops = tx.job_states
        assert await ops.paused_jobs() == {}
        await ops.update_if_matches(
            ours, {"paused": True, "pause_reason": "bp: queue", "paused_at": now}, now=now
        )
        await ops.update_if_matches(by_hand, {"paused": True, "pause_reason": "ops"}, now=now)
        # A prefix is taken literally: "b%" is no wildcard.
        await ops.update_if_matches(wild, {"paused": True, "pause_reason": "bx: q"}, now=now)
        await ops.ensure([never], now=now)
    async with repo.read() as tx:
        assert await tx.job_states.pause_state(ours) == (True, "bp: queue")
        assert await tx.job_states.pause_state(never) == (False, None)
        assert await tx.job_states.pause_state(uuid.uuid4()) == (False, None)  # no row
        assert await tx.job_states.paused_jobs() == {
            ours: "bp: queue",
            by_hand: "ops",
            wild: "bx: q",
        }
    clock.advance(1)
    async with repo.transaction() as tx:
        ops = tx.job_states
        assert await ops.relabel_if_paused_by(ours, "bp: ", "bp: other", now=clock.now())
        assert not await ops.relabel_if_paused_by(by_hand, "bp: ", "bp: x", now=clock.now())
        assert not await ops.resume_if_paused_by(by_hand, "bp: ", now=clock.now())
        assert not await ops.resume_if_paused_by(wild, "b%", now=clock.now())
        assert not await ops.resume_if_paused_by(never, "", now=clock.now())
    assert (await rows(repo))[ours]["pause_reason"] == "bp: other"
    async with repo.transaction() as tx:
        assert await tx.job_states.resume_if_paused_by(ours, "bp: ", now=clock.now())
        assert not await tx.job_states.resume_if_paused_by(ours, "bp: ", now=clock.now())
        assert not await tx.job_states.relabel_if_paused_by(ours, "bp: ", "bp: y", now=clock.now())
    found = await rows(repo)
    assert (found[ours]["paused"], found[ours]["pause_reason"], found[ours]["paused_at"]) == (
        False,
        None,
        None,
    )
    assert found[ours]["updated_at"] == clock.now()
    assert found[by_hand]["paused"] and found[wild]["paused"]


async def test_scale_state_moves_are_compare_and_set(
    repo: SqlRepository, clock: ManualClock
) -> None:
    idle, running, absent = await jobs(repo, clock, ("spark", "a"), ("spark", "b"), ("spark", "c"))
    start = clock.now()
    async with repo.transaction() as tx:
        ops = tx.job_states
        await ops.ensure([idle, running], now=start)
        assert await ops.scale_states([]) == {}
        assert await ops.mark_running_if_idle([], now=start) == set()
        assert await ops.mark_running_if_idle([running], now=start) == {running}
    clock.advance(10)
    async with repo.transaction() as tx:
        ops = tx.job_states
        # Running already, and a job without a row: neither moves.
        assert await ops.mark_running_if_idle([running, absent], now=clock.now()) == set()
        assert await ops.scale_states([idle, running, absent]) == {
            idle: ScaleState("Idle", None),
            running: ScaleState("Running", start),
        }
        await ops.touch_activity([], now=clock.now())
        await ops.touch_activity([idle, running], now=clock.now())
        assert await ops.scale_states([idle, running]) == {
            idle: ScaleState("Idle", clock.now()),  # touched whatever its state
            running: ScaleState("Running", clock.now()),
        }
        # Activity seen since: the guard fails, nothing moves.
        assert not await ops.mark_idle_if_unchanged(running, start, now=clock.now())
        assert not await ops.mark_idle_if_unchanged(idle, clock.now(), now=clock.now())
        assert await ops.mark_idle_if_unchanged(running, clock.now(), now=clock.now())
        assert await ops.scale_states([running]) == {running: ScaleState("Idle", clock.now())}
        await ops.update_if_matches(
            idle, {"scale_state": "Running", "last_activity_at": None}, now=clock.now()
        )
        assert await ops.mark_idle_if_unchanged(idle, None, now=clock.now())  # None: unset
    assert absent not in await rows(repo)


async def test_lock_creates_no_row_and_lock_for_claims_creates_one_on_postgres(
    repo: SqlRepository, clock: ManualClock, engine: str
) -> None:
    a, b = await jobs(repo, clock, ("spark", "a"), ("spark", "b"))
    async with repo.transaction() as tx:
        await tx.job_states.lock([])
        await tx.job_states.lock([a, b])
        await tx.job_states.lock_for_claims(a, now=clock.now())
    # lock() created nothing. Postgres serializes claims on the job's row,
    # created for it; SQLite's write transaction serializes them already.
    assert set(await rows(repo)) == ({a} if engine == "postgres" else set())


async def test_locks_hold_other_transactions_off_until_commit_on_postgres(
    repo: SqlRepository, clock: ManualClock, engine: str
) -> None:
    if engine != "postgres":
        pytest.skip("SQLite's single writer needs no row locks")
    a, b = await jobs(repo, clock, ("spark", "a"), ("spark", "b"))
    s = schema.job_states
    async with repo.transaction() as tx:
        await tx.job_states.ensure([a, b], now=clock.now())
    async with repo.transaction() as tx:
        await tx.job_states.lock([a])
        await tx.job_states.lock_for_claims(b, now=clock.now())
        async with repo.transaction() as other:
            held = await other.connection.execute(
                sa.select(s.c.job_id).with_for_update(skip_locked=True)
            )
            assert list(held) == []  # both rows are held by tx
    async with repo.transaction() as other:
        held = await other.connection.execute(
            sa.select(s.c.job_id).with_for_update(skip_locked=True)
        )
        assert {row[0] for row in held} == {a, b}  # released at commit
