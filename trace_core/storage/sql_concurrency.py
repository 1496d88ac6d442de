"""The concurrency area (:mod:`trace_core.storage.ports.concurrency`) in SQL, for both engines."""

from __future__ import annotations

import uuid
from collections.abc import Collection

import sqlalchemy as sa

from trace_core.storage import schema
from trace_core.storage.ports.concurrency import JobClaimSettings, QueuedTasks
from trace_core.storage.sql_area import SqlArea
from trace_core.storage.sql_leasing import status_in

__all__ = ["SqlConcurrencyOps"]


class SqlConcurrencyOps(SqlArea):
    """:class:`~trace_core.storage.ports.concurrency.ConcurrencyOps` on a SQL transaction."""

    async def running_by_job(
        self, job_ids: Collection[uuid.UUID] | None = None
    ) -> dict[uuid.UUID, int]:
        t = schema.tasks
        stmt = sa.select(t.c.job_id, sa.func.count()).where(status_in(t.c.status, "Running"))
        if job_ids is not None:
            if not job_ids:
                return {}
            stmt = stmt.where(t.c.job_id.in_(list(job_ids)))
        rows = await self._rows("running tasks", stmt.group_by(t.c.job_id))
        return {job_id: int(n) for job_id, n in rows}

    async def running_by_operator(self) -> dict[str, int]:
        t, j = schema.tasks, schema.jobs
        stmt = (
            sa.select(j.c.operator, sa.func.count())
            .select_from(t.join(j, j.c.id == t.c.job_id))
            .where(status_in(t.c.status, "Running"))
            .group_by(j.c.operator)
        )
        return {operator: int(n) for operator, n in await self._rows("tasks in flight", stmt)}

    async def queued_by_job(self) -> dict[uuid.UUID, QueuedTasks]:
        t = schema.tasks
        stmt = (
            sa.select(t.c.job_id, sa.func.count(), sa.func.min(t.c.created_at))
            .where(status_in(t.c.status, "Queued"))
            .group_by(t.c.job_id)
        )
        return {
            job_id: QueuedTasks(int(depth), oldest)
            for job_id, depth, oldest in await self._rows("queued tasks", stmt)
        }

    async def active_by_job(self, job_ids: Collection[uuid.UUID]) -> dict[uuid.UUID, int]:
        if not job_ids:
            return {}
        t = schema.tasks
        stmt = (
            sa.select(t.c.job_id, sa.func.count())
            .where(t.c.status.in_(("Queued", "Running")), t.c.job_id.in_(list(job_ids)))
            .group_by(t.c.job_id)
        )
        return {job_id: int(n) for job_id, n in await self._rows("active tasks", stmt)}

    async def claim_settings(
        self, job_ids: Collection[uuid.UUID]
    ) -> dict[uuid.UUID, JobClaimSettings]:
        if not job_ids:
            return {}
        j = schema.jobs
        stmt = sa.select(j.c.id, j.c.scaling, j.c.heartbeat_timeout_seconds).where(
            j.c.id.in_(list(job_ids))
        )
        return {
            job_id: JobClaimSettings(scaling, heartbeat)
            for job_id, scaling, heartbeat in await self._rows("job claim settings", stmt)
        }

    async def job_of_task(self, task_id: uuid.UUID) -> uuid.UUID | None:
        t = schema.tasks
        rows = await self._rows("job of task", sa.select(t.c.job_id).where(t.c.id == task_id))
        return rows[0][0] if rows else None

    async def oldest_queued_of_job(self, job_id: uuid.UUID, *, limit: int) -> list[uuid.UUID]:
        if limit < 1:
            return []
        t = schema.tasks
        stmt = (
            sa.select(t.c.id)
            .where(t.c.job_id == job_id, status_in(t.c.status, "Queued"))
            .order_by(t.c.queued_at, t.c.id)
            .limit(limit)
        )
        return [row[0] for row in await self._rows("queued tasks of job", stmt)]

    async def oldest_queued_except_jobs(
        self, excluded: Collection[uuid.UUID], *, limit: int
    ) -> list[tuple[uuid.UUID, uuid.UUID]]:
        t = schema.tasks
        stmt = sa.select(t.c.id, t.c.job_id).where(status_in(t.c.status, "Queued"))
        if excluded:
            stmt = stmt.where(t.c.job_id.not_in(list(excluded)))
        stmt = stmt.order_by(t.c.queued_at, t.c.id).limit(limit)
        return [(row[0], row[1]) for row in await self._rows("claim candidates", stmt)]

    async def lock_claim_candidates(self, task_ids: Collection[uuid.UUID]) -> set[uuid.UUID]:
        if not task_ids:
            return set()
        if self.engine_name != "postgres":
            return set(task_ids)
        t = schema.tasks
        stmt = (
            sa.select(t.c.id)
            .where(t.c.id.in_(list(task_ids)), status_in(t.c.status, "Queued"))
            .with_for_update(skip_locked=True)
        )
        return {row[0] for row in await self._rows("lock claim candidates", stmt)}
