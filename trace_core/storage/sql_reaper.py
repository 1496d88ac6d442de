"""The reaper area (:mod:`trace_core.storage.ports.reaper`) in SQL, for both engines."""

from __future__ import annotations

import uuid
from collections.abc import Collection
from datetime import datetime, timedelta

import sqlalchemy as sa

from trace_core.storage import schema
from trace_core.storage.ports.reaper import HeldLease, TimedOutAttempt
from trace_core.storage.sql_area import SqlArea

__all__ = ["SqlReaperOps"]


class SqlReaperOps(SqlArea):
    """:class:`~trace_core.storage.ports.reaper.ReaperOps` on a SQL transaction."""

    async def heartbeat_timeout_of_task(self, task_id: uuid.UUID) -> int | None:
        t, j = schema.tasks, schema.jobs
        stmt = (
            sa.select(j.c.heartbeat_timeout_seconds)
            .join(t, t.c.job_id == j.c.id)
            .where(t.c.id == task_id)
        )
        rows = await self._rows("heartbeat timeout of task", stmt)
        return None if not rows or rows[0][0] is None else int(rows[0][0])

    async def held_leases(self, task_ids: Collection[uuid.UUID]) -> dict[uuid.UUID, HeldLease]:
        if not task_ids:
            return {}
        t = schema.tasks
        stmt = sa.select(t.c.id, t.c.job_id, t.c.last_heartbeat, t.c.lease_expires_at).where(
            t.c.id.in_(list(task_ids))
        )
        rows = await self._rows("held leases", stmt)
        return {row[0]: HeldLease(row[1], row[2], row[3]) for row in rows}

    async def timed_out_attempts(self, *, now: datetime, limit: int) -> list[TimedOutAttempt]:
        t, j = schema.tasks, schema.jobs
        running = t.c.status == sa.literal_column("'Running'")
        # One cutoff per distinct timeout keeps the comparison a plain timestamp
        # bind on both engines (no interval arithmetic in SQL).
        timeouts = [
            row[0]
            for row in await self._rows(
                "job timeouts",
                sa.select(j.c.timeout_seconds)
                .join(t, t.c.job_id == j.c.id)
                .where(running, j.c.timeout_seconds.is_not(None), j.c.timeout_seconds > 0)
                .distinct(),
            )
        ]
        if not timeouts:
            return []
        older = sa.or_(
            *(
                sa.and_(j.c.timeout_seconds == n, t.c.started_at < now - timedelta(seconds=n))
                for n in timeouts
            )
        )
        stmt = (
            sa.select(t.c.id, t.c.attempt, t.c.lease_token, t.c.job_id, j.c.timeout_seconds)
            .join(j, j.c.id == t.c.job_id)
            .where(running, t.c.lease_token.is_not(None), older)
            .order_by(t.c.started_at)
            .limit(limit)
        )
        return [TimedOutAttempt(*row) for row in await self._rows("timed-out attempts", stmt)]
