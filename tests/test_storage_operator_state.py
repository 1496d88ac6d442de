"""The operator-state area of the port (``tx.operator_state``), on both engines."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from tests.factories import make_job
from trace_core.clock import ManualClock
from trace_core.storage import schema
from trace_core.storage.ports import OperatorStateKey, StoredState
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio


async def key_of(repo: SqlRepository, clock: ManualClock, state_key: str = "k") -> OperatorStateKey:
    job_id = await make_job(repo, clock.now())
    async with repo.read() as tx:
        org_id = (
            await tx.connection.execute(
                sa.select(schema.jobs.c.org_id).where(schema.jobs.c.id == job_id)
            )
        ).scalar_one()
    return OperatorStateKey(org_id, job_id, state_key)


async def test_insert_if_absent_writes_once(repo: SqlRepository, clock: ManualClock) -> None:
    key = await key_of(repo, clock)
    async with repo.transaction() as tx:
        assert await tx.operator_state.get(key) is None
        assert await tx.operator_state.insert_if_absent(key, {"n": 1}, now=clock.now()) is True
        # An existing row is left as it is.
        assert await tx.operator_state.insert_if_absent(key, {"n": 2}, now=clock.now()) is False
        assert await tx.operator_state.get(key) == StoredState({"n": 1}, 1)


async def test_update_if_version_matches_only_that_version(
    repo: SqlRepository, clock: ManualClock
) -> None:
    key = await key_of(repo, clock)
    other = OperatorStateKey(key.org_id, key.job_id, "other")
    async with repo.transaction() as tx:
        await tx.operator_state.insert_if_absent(key, {"n": 1}, now=clock.now())
        await tx.operator_state.insert_if_absent(other, {"o": 1}, now=clock.now())
        assert (
            await tx.operator_state.update_if_version(key, {"n": 2}, version=1, now=clock.now())
            == 2
        )
        # A stale version changes nothing.
        assert (
            await tx.operator_state.update_if_version(key, {"n": 9}, version=1, now=clock.now())
            is None
        )
        missing = OperatorStateKey(key.org_id, key.job_id, "missing")
        assert (
            await tx.operator_state.update_if_version(missing, {}, version=1, now=clock.now())
            is None
        )
        assert await tx.operator_state.get(key) == StoredState({"n": 2}, 2)
        assert await tx.operator_state.get(other) == StoredState({"o": 1}, 1)
        assert await tx.operator_state.get(missing) is None


async def test_delete_if_version(repo: SqlRepository, clock: ManualClock) -> None:
    key = await key_of(repo, clock)
    other = OperatorStateKey(key.org_id, key.job_id, "other")
    async with repo.transaction() as tx:
        await tx.operator_state.insert_if_absent(key, {"n": 1}, now=clock.now())
        await tx.operator_state.insert_if_absent(other, {"o": 1}, now=clock.now())
        assert await tx.operator_state.delete_if_version(key, version=2) is False
        assert await tx.operator_state.get(key) == StoredState({"n": 1}, 1)
        assert await tx.operator_state.delete_if_version(key, version=1) is True
        assert await tx.operator_state.get(key) is None
        assert await tx.operator_state.delete_if_version(key, version=None) is False
        # Without a version, any stored one is deleted; other keys are left alone.
        await tx.operator_state.insert_if_absent(key, {"n": 3}, now=clock.now())
        assert await tx.operator_state.delete_if_version(key, version=None) is True
        assert await tx.operator_state.get(other) == StoredState({"o": 1}, 1)
