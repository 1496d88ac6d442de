"""Durable per-job operator state with optimistic concurrency (``operator_state``).

Operators that keep bookkeeping between tasks (a range aggregator's cursor)
read a snapshot, compute, and write it back naming the version they read. A
write whose version is no longer current changes nothing and raises
:class:`StateConflict`, so two tasks of one job (a retry overlapping a late
attempt, two concurrent partitions) can never silently lose each other's
update: the loser re-reads and retries, or fails its task.

The check is in the statement itself (``UPDATE ... WHERE version = :expected``;
creation is an insert that does nothing if the row exists), so it holds on
both engines without locks: on Postgres a concurrent writer's ``UPDATE``
waits for the first to commit, then re-checks the version and matches nothing.
Every method takes an optional transaction, so a state change can commit
atomically with the task's completion.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from trace_core.clock import Clock, SystemClock
from trace_core.errors import ConfigurationError, TraceError
from trace_core.storage import schema
from trace_core.storage.sql import SqlRepository, SqlTransaction

__all__ = ["DEFAULT_STATE_KEY", "OperatorStateStore", "StateConflict", "StateSnapshot"]

DEFAULT_STATE_KEY = "default"


class StateConflict(TraceError):
    """A versioned write of operator state lost: the stored version differs.

    ``expected_version`` is what the writer named (``None``: "create, it must
    not exist"); ``actual_version`` is what is stored (``None``: no row).
    """

    def __init__(
        self,
        org_id: uuid.UUID,
        job_id: uuid.UUID,
        state_key: str,
        expected_version: int | None,
        actual_version: int | None,
    ) -> None:
        expected = (
            "no state (create)" if expected_version is None else f"version {expected_version}"
        )
        actual = "no state" if actual_version is None else f"version {actual_version}"
        super().__init__(
            f"operator state conflict for org {org_id}, job {job_id}, key {state_key!r}: "
            f"expected {expected}, found {actual}"
        )
        self.org_id = org_id
        self.job_id = job_id
        self.state_key = state_key
        self.expected_version = expected_version
        self.actual_version = actual_version


@dataclass(frozen=True)
class StateSnapshot:
    """A state as read or written, with the version to name in the next write."""

    state: dict[str, Any]
    version: int


class OperatorStateStore:
    """Reads and versioned writes of ``operator_state`` rows."""

    def __init__(self, repo: SqlRepository, *, clock: Clock | None = None) -> None:
        self.repo = repo
        self.clock = clock or SystemClock()

    @asynccontextmanager
    async def _within(self, tx: SqlTransaction | None) -> AsyncIterator[SqlTransaction]:
        if tx is not None:
            yield tx
        else:
            async with self.repo.transaction() as own:
                yield own

    @staticmethod
    def _key(org_id: uuid.UUID, job_id: uuid.UUID, state_key: str) -> list[sa.ColumnElement[bool]]:
        s = schema.operator_state
        return [s.c.org_id == org_id, s.c.job_id == job_id, s.c.state_key == state_key]

    async def get(
        self,
        org_id: uuid.UUID,
        job_id: uuid.UUID,
        state_key: str = DEFAULT_STATE_KEY,
        *,
        tx: SqlTransaction | None = None,
    ) -> StateSnapshot | None:
        """The stored state and its version, or ``None`` if there is none."""
        s = schema.operator_state
        stmt = sa.select(s.c.state, s.c.version).where(*self._key(org_id, job_id, state_key))
        if tx is not None:
            row = (await tx.connection.execute(stmt)).first()
        else:
            async with self.repo.read() as rtx:
                row = (await rtx.connection.execute(stmt)).first()
        if row is None:
            return None
        return StateSnapshot(dict(row[0] or {}), int(row[1]))

    async def put(
        self,
        org_id: uuid.UUID,
        job_id: uuid.UUID,
        state: Mapping[str, Any],
        *,
        state_key: str = DEFAULT_STATE_KEY,
        expected_version: int | None,
        tx: SqlTransaction | None = None,
    ) -> StateSnapshot:
        """Write ``state`` if the stored version is ``expected_version``; the new snapshot.

        ``expected_version=None`` creates the state (version 1) and requires
        that none exists. Raises :class:`StateConflict`, changing nothing,
        when the stored version is another.
        """
        if not isinstance(state, Mapping):
            raise ConfigurationError(
                f"operator state must be a mapping, got {type(state).__name__}"
            )
        if not state_key:
            raise ConfigurationError("state_key must not be empty")
        s = schema.operator_state
        value = dict(state)
        now = self.clock.now()
        async with self._within(tx) as t:
            conn = t.connection
            if expected_version is None:
                stmt = (
                    t.insert(s)
                    .values(
                        org_id=org_id,
                        job_id=job_id,
                        state_key=state_key,
                        state=value,
                        version=1,
                        updated_at=now,
                    )
                    .on_conflict_do_nothing()
                    .returning(s.c.version)
                )
            else:
                stmt = (
                    sa.update(s)
                    .where(*self._key(org_id, job_id, state_key), s.c.version == expected_version)
                    .values(state=value, version=s.c.version + 1, updated_at=now)
                    .returning(s.c.version)
                )
            version = (await conn.execute(stmt)).scalar_one_or_none()
            if version is None:
                await self._conflict(t, org_id, job_id, state_key, expected_version)
        assert version is not None
        return StateSnapshot(value, int(version))

    async def delete(
        self,
        org_id: uuid.UUID,
        job_id: uuid.UUID,
        state_key: str = DEFAULT_STATE_KEY,
        *,
        expected_version: int | None = None,
        tx: SqlTransaction | None = None,
    ) -> bool:
        """Delete the state; whether there was one.

        With ``expected_version``, only that version is deleted; another one
        raises :class:`StateConflict` (a missing row too).
        """
        s = schema.operator_state
        where = self._key(org_id, job_id, state_key)
        if expected_version is not None:
            where.append(s.c.version == expected_version)
        async with self._within(tx) as t:
            result = await t.connection.execute(sa.delete(s).where(*where))
            deleted = bool(result.rowcount)
            if not deleted and expected_version is not None:
                await self._conflict(t, org_id, job_id, state_key, expected_version)
        return deleted

    async def _conflict(
        self,
        tx: SqlTransaction,
        org_id: uuid.UUID,
        job_id: uuid.UUID,
        state_key: str,
        expected_version: int | None,
    ) -> None:
        current = await self.get(org_id, job_id, state_key, tx=tx)
        raise StateConflict(
            org_id,
            job_id,
            state_key,
            expected_version,
            None if current is None else current.version,
        )
