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

A worker without database credentials reaches its job's state through the
control plane (``/v1/task/state``): :meth:`OperatorStateStore.get_for_attempt`
and :meth:`~OperatorStateStore.put_for_attempt` name a task attempt instead of
an org and a job, and act only while that attempt holds the task's lease,
judged in the same transaction as the read or write.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from trace_core.authoring.state import DEFAULT_STATE_KEY, StateConflict, StateSnapshot
from trace_core.clock import Clock, SystemClock
from trace_core.dispatcher.payload import task_rows
from trace_core.errors import ConfigurationError, StaleClaim
from trace_core.model import TASKS
from trace_core.storage.ports.operator_state import OperatorStateKey
from trace_core.storage.protocol import Repository, Transaction

__all__ = ["DEFAULT_STATE_KEY", "OperatorStateStore", "StateConflict", "StateSnapshot"]

_JOBS_CACHE = 4096  # tasks


class OperatorStateStore:
    """Reads and versioned writes of ``operator_state`` rows (``tx.operator_state``)."""

    def __init__(self, repo: Repository, *, clock: Clock | None = None) -> None:
        self.repo = repo
        self.clock = clock or SystemClock()
        self._jobs: dict[uuid.UUID, tuple[uuid.UUID, uuid.UUID]] = {}

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

    async def get_for_attempt(
        self, task_id: uuid.UUID, attempt: int, state_key: str = DEFAULT_STATE_KEY
    ) -> StateSnapshot | None:
        """:meth:`get` on the task's job while ``attempt`` holds the lease;
        :class:`StaleClaim` otherwise."""
        async with self.repo.transaction() as tx:
            org_id, job_id = await self._leased_job(tx, task_id, attempt)
            return await self.get(org_id, job_id, state_key, tx=tx)

    async def put_for_attempt(
        self,
        task_id: uuid.UUID,
        attempt: int,
        state: Mapping[str, Any],
        *,
        state_key: str = DEFAULT_STATE_KEY,
        expected_version: int | None,
    ) -> StateSnapshot:
        """:meth:`put` on the task's job while ``attempt`` holds the lease;
        :class:`StaleClaim` otherwise, :class:`StateConflict` for a lost
        version check."""
        async with self.repo.transaction() as tx:
            org_id, job_id = await self._leased_job(tx, task_id, attempt)
            return await self.put(
                org_id,
                job_id,
                state,
                state_key=state_key,
                expected_version=expected_version,
                tx=tx,
            )

    async def _leased_job(
        self, tx: Transaction, task_id: uuid.UUID, attempt: int
    ) -> tuple[uuid.UUID, uuid.UUID]:
        """The task's ``(org_id, job_id)`` if ``attempt`` is its current one and
        holds the lease (a leased status); :class:`StaleClaim` otherwise.

        The task row is share-locked on Postgres until ``tx`` ends (SQLite's
        writers are serialized already), so a completion, a reclaim or a newer
        claim cannot slip between this check and the state's read or write.
        Unlike an event, state is not a late reply: an attempt the reaper
        marked timed out is refused at once.
        """
        found = await tx.events.lock_producer_attempt(task_id)
        if found is None:
            raise StaleClaim("tasks", task_id, "no such task")
        if found.attempt != attempt:
            raise StaleClaim(
                "tasks", task_id, f"attempt {attempt} is not current (attempt {found.attempt})"
            )
        if found.status not in TASKS.leased:
            raise StaleClaim(
                "tasks", task_id, f"attempt {attempt} does not hold the lease ({found.status})"
            )
        job = self._jobs.get(task_id)
        if job is None:
            rows = await task_rows(tx, [task_id])
            if not rows:
                raise StaleClaim("tasks", task_id, "no such task")
            job = (_uuid(rows[0]["org_id"]), _uuid(rows[0]["job_id"]))
            if len(self._jobs) >= _JOBS_CACHE:
                self._jobs.clear()
            self._jobs[task_id] = job  # a task's job never changes
        return job

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


def _uuid(value: Any) -> uuid.UUID:
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))
