"""Operator state with optimistic concurrency, on both engines."""

from __future__ import annotations

import uuid

import anyio
import pytest
import sqlalchemy as sa

from tests.factories import make_job, run_on_separate_repos
from trace_core.clock import ManualClock
from trace_core.dispatcher.operator_state import OperatorStateStore, StateConflict, StateSnapshot
from trace_core.errors import ConfigurationError, TraceError
from trace_core.storage import schema
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio


async def org_and_job(repo: SqlRepository, clock: ManualClock) -> tuple[uuid.UUID, uuid.UUID]:
    job_id = await make_job(repo, clock.now())
    async with repo.read() as tx:
        org_id = (
            await tx.connection.execute(
                sa.select(schema.jobs.c.org_id).where(schema.jobs.c.id == job_id)
            )
        ).scalar_one()
    return org_id, job_id


async def test_create_read_update_delete(repo: SqlRepository, clock: ManualClock) -> None:
    org, job = await org_and_job(repo, clock)
    store = OperatorStateStore(repo, clock=clock)
    assert await store.get(org, job) is None
    created = await store.put(org, job, {"cursor": 10}, expected_version=None)
    assert created == StateSnapshot({"cursor": 10}, 1)
    assert await store.get(org, job) == created
    updated = await store.put(org, job, {"cursor": 20, "ranges": [[0, 9]]}, expected_version=1)
    assert updated.version == 2
    assert await store.get(org, job) == StateSnapshot({"cursor": 20, "ranges": [[0, 9]]}, 2)
    # Slots are independent.
    other = await store.put(org, job, {"x": 1}, state_key="side", expected_version=None)
    assert other.version == 1
    assert (await store.get(org, job)) == updated
    assert await store.delete(org, job, expected_version=2)
    assert await store.get(org, job) is None
    assert not await store.delete(org, job)
    assert await store.delete(org, job, "side")


async def test_a_stale_version_changes_nothing(repo: SqlRepository, clock: ManualClock) -> None:
    org, job = await org_and_job(repo, clock)
    store = OperatorStateStore(repo, clock=clock)
    await store.put(org, job, {"n": 1}, expected_version=None)
    await store.put(org, job, {"n": 2}, expected_version=1)
    with pytest.raises(StateConflict) as info:
        await store.put(org, job, {"n": 99}, expected_version=1)
    err = info.value
    assert isinstance(err, TraceError)
    assert (err.expected_version, err.actual_version, err.state_key) == (1, 2, "default")
    assert "key 'default'" in str(err) and "expected version 1, found version 2" in str(err)
    assert await store.get(org, job) == StateSnapshot({"n": 2}, 2)

    with pytest.raises(StateConflict, match="expected no state \\(create\\), found version 2"):
        await store.put(org, job, {"n": 0}, expected_version=None)
    with pytest.raises(StateConflict, match="expected version 5, found no state"):
        await store.put(org, job, {"n": 0}, state_key="missing", expected_version=5)
    with pytest.raises(StateConflict):
        await store.delete(org, job, expected_version=1)
    assert await store.get(org, job) == StateSnapshot({"n": 2}, 2)


async def test_lost_update_race_has_exactly_one_winner(
    database_url: str, repo: SqlRepository, clock: ManualClock
) -> None:
    org, job = await org_and_job(repo, clock)
    await OperatorStateStore(repo, clock=clock).put(org, job, {"n": 0}, expected_version=None)
    read_done = anyio.Event()
    reads: list[StateSnapshot] = []
    results: list[StateSnapshot | StateConflict] = []

    async def writer(r: SqlRepository, n: int) -> None:
        name = f"w{n}"
        store = OperatorStateStore(r, clock=clock)
        snap = await store.get(org, job)
        assert snap is not None
        reads.append(snap)
        if len(reads) == 2:
            read_done.set()
        await read_done.wait()  # both have read version v before either writes
        try:
            results.append(
                await store.put(org, job, {**snap.state, name: True}, expected_version=snap.version)
            )
        except StateConflict as exc:
            results.append(exc)

    await run_on_separate_repos(database_url, 2, writer)
    assert [s.version for s in reads] == [1, 1]
    wins = [r for r in results if isinstance(r, StateSnapshot)]
    losses = [r for r in results if isinstance(r, StateConflict)]
    assert len(wins) == 1 and len(losses) == 1
    assert (losses[0].expected_version, losses[0].actual_version) == (1, 2)
    assert await OperatorStateStore(repo).get(org, job) == wins[0]


async def test_concurrent_creators_have_exactly_one_winner(
    database_url: str, repo: SqlRepository, clock: ManualClock
) -> None:
    org, job = await org_and_job(repo, clock)
    outcomes: list[bool] = []

    async def creator(r: SqlRepository, n: int) -> None:
        try:
            await OperatorStateStore(r, clock=clock).put(org, job, {"by": n}, expected_version=None)
            outcomes.append(True)
        except StateConflict:
            outcomes.append(False)

    await run_on_separate_repos(database_url, 4, creator)
    assert sorted(outcomes) == [False, False, False, True]


async def test_a_put_joins_the_callers_transaction(repo: SqlRepository, clock: ManualClock) -> None:
    org, job = await org_and_job(repo, clock)
    store = OperatorStateStore(repo, clock=clock)

    class Abort(Exception):
        pass

    with pytest.raises(Abort):
        async with repo.transaction() as tx:
            await store.put(org, job, {"n": 1}, expected_version=None, tx=tx)
            assert await store.get(org, job, tx=tx) == StateSnapshot({"n": 1}, 1)
            raise Abort
    assert await store.get(org, job) is None  # rolled back with the caller's transaction
    async with repo.transaction() as tx:
        await store.put(org, job, {"n": 1}, expected_version=None, tx=tx)
    assert await store.get(org, job) == StateSnapshot({"n": 1}, 1)


async def test_put_validates_its_input(repo: SqlRepository, clock: ManualClock) -> None:
    org, job = await org_and_job(repo, clock)
    store = OperatorStateStore(repo, clock=clock)
    with pytest.raises(ConfigurationError):
        await store.put(org, job, [1, 2], expected_version=None)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        await store.put(org, job, {}, state_key="", expected_version=None)
