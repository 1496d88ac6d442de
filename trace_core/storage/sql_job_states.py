"""The job-states area (:mod:`trace_core.storage.ports.job_states`) in SQL, for both engines."""

from __future__ import annotations

import uuid
from collections.abc import Collection, Mapping
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from trace_core.errors import InvalidInput
from trace_core.storage import schema
from trace_core.storage.ports.job_states import JOB_STATE_FIELDS, ScaleState, by_job_id
from trace_core.storage.sql_area import SqlArea

__all__ = ["SqlJobStateOps"]

IDLE = "Idle"
RUNNING = "Running"


def _fields(what: str, names: Mapping[str, object]) -> None:
    for name in names:
        if name not in JOB_STATE_FIELDS:
            raise InvalidInput(f"{what}.{name}", "is not a field of a job's state")


def _same_as(column: sa.ColumnElement[Any], value: object) -> sa.ColumnElement[bool]:
    """``column = value``, or ``column IS NULL`` for ``None`` (compare-and-set guards)."""
    return column.is_(None) if value is None else column == value


class SqlJobStateOps(SqlArea):
    """:class:`~trace_core.storage.ports.job_states.JobStateOps` on a SQL transaction."""

    async def ensure(self, job_ids: Collection[uuid.UUID], *, now: datetime) -> None:
        ordered = by_job_id(job_ids)
        if not ordered:
            return
        stmt = self._tx.insert(schema.job_states).on_conflict_do_nothing()
        await self._run(
            "create job states", stmt, [{"job_id": j, "updated_at": now} for j in ordered]
        )

    async def lock(self, job_ids: Collection[uuid.UUID]) -> None:
        ordered = by_job_id(job_ids)
        if not ordered or self.engine_name != "postgres":
            return
        s = schema.job_states
        # FOR UPDATE above ORDER BY takes the locks in the sorted order.
        await self._run(
            "lock job states",
            sa.select(s.c.job_id)
            .where(s.c.job_id.in_(ordered))
            .order_by(s.c.job_id)
            .with_for_update(),
        )

    async def lock_for_claims(self, job_id: uuid.UUID, *, now: datetime) -> None:
        if self.engine_name != "postgres":
            return
        await self.ensure([job_id], now=now)
        await self.lock([job_id])

    async def update_if_matches(
        self,
        job_id: uuid.UUID,
        values: Mapping[str, object],
        *,
        now: datetime,
        expected: Mapping[str, object] | None = None,
    ) -> bool:
        expected = expected or {}
        _fields("values", values)
        _fields("expected", expected)
        await self.ensure([job_id], now=now)
        s = schema.job_states
        guards = [_same_as(s.c[name], value) for name, value in expected.items()]
        stmt = (
            sa.update(s).where(s.c.job_id == job_id, *guards).values({**values, "updated_at": now})
        )
        return bool(await self._count("update job state", stmt))

    async def pause_state(self, job_id: uuid.UUID) -> tuple[bool, str | None]:
        s = schema.job_states
        rows = await self._rows(
            "read pause", sa.select(s.c.paused, s.c.pause_reason).where(s.c.job_id == job_id)
        )
        return (False, None) if not rows else (bool(rows[0][0]), rows[0][1])

    async def paused_jobs(self) -> dict[uuid.UUID, str | None]:
        s = schema.job_states
        stmt = sa.select(s.c.job_id, s.c.pause_reason).where(s.c.paused == sa.true())
        return {job_id: reason for job_id, reason in await self._rows("paused jobs", stmt)}

    @staticmethod
    def _paused_by(job_id: uuid.UUID, reason_prefix: str) -> list[sa.ColumnElement[bool]]:
        s = schema.job_states
        return [
            s.c.job_id == job_id,
            s.c.paused == sa.true(),
            s.c.pause_reason.startswith(reason_prefix, autoescape=True),
        ]

    async def resume_if_paused_by(
        self, job_id: uuid.UUID, reason_prefix: str, *, now: datetime
    ) -> bool:
        s = schema.job_states
        stmt = (
            sa.update(s)
            .where(*self._paused_by(job_id, reason_prefix))
            .values(paused=False, pause_reason=None, paused_at=None, updated_at=now)
            .returning(s.c.job_id)
        )
        return bool(await self._rows("resume job", stmt))

    async def relabel_if_paused_by(
        self, job_id: uuid.UUID, reason_prefix: str, reason: str, *, now: datetime
    ) -> bool:
        s = schema.job_states
        stmt = (
            sa.update(s)
            .where(*self._paused_by(job_id, reason_prefix))
            .values(pause_reason=reason, updated_at=now)
        )
        return bool(await self._count("relabel pause", stmt))

    async def scale_states(self, job_ids: Collection[uuid.UUID]) -> dict[uuid.UUID, ScaleState]:
        if not job_ids:
            return {}
        s = schema.job_states
        stmt = sa.select(s.c.job_id, s.c.scale_state, s.c.last_activity_at).where(
            s.c.job_id.in_(list(job_ids))
        )
        return {r[0]: ScaleState(str(r[1]), r[2]) for r in await self._rows("scale states", stmt)}

    async def mark_running_if_idle(
        self, job_ids: Collection[uuid.UUID], *, now: datetime
    ) -> set[uuid.UUID]:
        if not job_ids:
            return set()
        s = schema.job_states
        stmt = (
            sa.update(s)
            .where(s.c.job_id.in_(list(job_ids)), s.c.scale_state == IDLE)
            .values(scale_state=RUNNING, last_activity_at=now, updated_at=now)
            .returning(s.c.job_id)
        )
        return {row[0] for row in await self._rows("scale up", stmt)}

    async def touch_activity(self, job_ids: Collection[uuid.UUID], *, now: datetime) -> None:
        if not job_ids:
            return
        s = schema.job_states
        await self._run(
            "job activity",
            sa.update(s)
            .where(s.c.job_id.in_(list(job_ids)))
            .values(last_activity_at=now, updated_at=now),
        )

    async def mark_idle_if_unchanged(
        self, job_id: uuid.UUID, last_activity_at: datetime | None, *, now: datetime
    ) -> bool:
        s = schema.job_states
        stmt = (
            sa.update(s)
            .where(
                s.c.job_id == job_id,
                s.c.scale_state == RUNNING,
                _same_as(s.c.last_activity_at, last_activity_at),
            )
            .values(scale_state=IDLE, updated_at=now)
        )
        return bool(await self._count("scale to zero", stmt))
