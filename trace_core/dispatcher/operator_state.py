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

from trace_core.clock import Clock, SystemClock
from trace_core.errors import ConfigurationError, TraceError
from trace_core.storage.ports.operator_state import OperatorStateKey
from trace_core.storage.protocol import Repository, Transaction

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
    """Reads and versioned writes of ``operator_state`` rows (``tx.operator_state``)."""

    def __init__(self, repo: Repository, *, clock: Clock | None = None) -> None:
        self.repo = repo
        self.clock = clock or SystemClock()

    @asynccontextmanager
    async def _within(self, tx: Transaction | None) -> AsyncIterator[Transaction]:
        if tx is not None:
            yield tx
        else:
            async with self.repo.transaction() as own:
                yield own

    async def get(
        self,
        org_id: uuid.UUID,
        job_id: uuid.UUID,
        state_key: str = DEFAULT_STATE_KEY,
        *,
        tx: Transaction | None = None,
    ) -> StateSnapshot | None:
        """The stored state and its version, or ``None`` if there is none."""
        key = OperatorStateKey(org_id, job_id, state_key)
        if tx is not None:
            found = await tx.operator_state.get(key)
        else:
            async with self.repo.read() as rtx:
                found = await rtx.operator_state.get(key)
        return None if found is None else StateSnapshot(found.state, found.version)

    async def put(
        self,
        org_id: uuid.UUID,
        job_id: uuid.UUID,
        state: Mapping[str, Any],
        *,
        state_key: str = DEFAULT_STATE_KEY,
        expected_version: int | None,
        tx: Transaction | None = None,
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
        key = OperatorStateKey(org_id, job_id, state_key)
        value = dict(state)
        now = self.clock.now()
        async with self._within(tx) as t:
            version: int | None
            if expected_version is None:
                created = await t.operator_state.insert_if_absent(key, value, now=now)
                version = 1 if created else None
            else:
                version = await t.operator_state.update_if_version(
                    key, value, version=expected_version, now=now
                )
            if version is None:
                await self._conflict(t, key, expected_version)
        assert version is not None
        return StateSnapshot(value, version)

    async def delete(
        self,
        org_id: uuid.UUID,
        job_id: uuid.UUID,
        state_key: str = DEFAULT_STATE_KEY,
        *,
        expected_version: int | None = None,
        tx: Transaction | None = None,
    ) -> bool:
        """Delete the state; whether there was one.

        With ``expected_version``, only that version is deleted; another one
        raises :class:`StateConflict` (a missing row too).
        """
        key = OperatorStateKey(org_id, job_id, state_key)
        async with self._within(tx) as t:
            deleted = await t.operator_state.delete_if_version(key, version=expected_version)
            if not deleted and expected_version is not None:
                await self._conflict(t, key, expected_version)
        return deleted

    async def _conflict(
        self, tx: Transaction, key: OperatorStateKey, expected_version: int | None
    ) -> None:
        current = await tx.operator_state.get(key)
        raise StateConflict(
            key.org_id,
            key.job_id,
            key.state_key,
            expected_version,
            None if current is None else current.version,
        )
