"""The explain area (:mod:`trace_core.storage.ports.explain`) in SQL, for both engines."""

from __future__ import annotations

import uuid
from collections.abc import Collection

import sqlalchemy as sa

from trace_core.storage import schema
from trace_core.storage.ports.explain import (
    ExplainedJob,
    FailedAttempt,
    InputEvent,
    JobStateFlags,
)
from trace_core.storage.sql_area import SqlArea

__all__ = ["SqlExplainOps"]


class SqlExplainOps(SqlArea):
    """:class:`~trace_core.storage.ports.explain.ExplainOps` on a SQL transaction."""

    async def find_job(self, org_slug: str, dag_name: str, job_name: str) -> ExplainedJob | None:
        j, dv, o = schema.jobs, schema.dag_versions, schema.orgs
        rank = sa.case((dv.c.status == "current", 0), (dv.c.status == "building", 1), else_=2)
        stmt = (
            sa.select(
                j.c.id,
                j.c.dag_version_id,
                dv.c.status,
                j.c.activation,
                j.c.operator,
                j.c.runtime,
                j.c.input_datasets,
            )
            .join(dv, dv.c.id == j.c.dag_version_id)
            .join(o, o.c.id == j.c.org_id)
            .where(o.c.slug == org_slug, j.c.dag_name == dag_name, j.c.name == job_name)
            .order_by(rank, dv.c.created_at.desc())
            .limit(1)
        )
        rows = await self._rows("find job", stmt)
        if not rows:
            return None
        job_id, version, status, activation, operator, runtime, inputs = rows[0]
        return ExplainedJob(
            job_id,
            version,
            status,
            activation,
            operator,
            runtime,
            tuple(uuid.UUID(str(d)) for d in inputs or ()),
        )

    async def job_state(self, job_id: uuid.UUID) -> JobStateFlags | None:
        s = schema.job_states
        stmt = sa.select(s.c.paused, s.c.pause_reason, s.c.source_status, s.c.scale_state).where(
            s.c.job_id == job_id
        )
        rows = await self._rows("job state", stmt)
        if not rows:
            return None
        paused, reason, source_status, scale_state = rows[0]
        return JobStateFlags(bool(paused), reason, source_status, scale_state)

    async def task_status_counts(self, job_id: uuid.UUID | None = None) -> dict[str, int]:
        t = schema.tasks
        stmt = sa.select(t.c.status, sa.func.count()).group_by(t.c.status)
        if job_id is not None:
            stmt = stmt.where(t.c.job_id == job_id)
        return {status: int(n) for status, n in await self._rows("tasks by status", stmt)}

    async def failed_attempts(self, job_id: uuid.UUID, *, limit: int) -> list[FailedAttempt]:
        t = schema.tasks
        stmt = (
            sa.select(t.c.id, t.c.attempt, t.c.status, t.c.error_message, t.c.next_retry_at)
            .where(t.c.job_id == job_id, t.c.error_message.is_not(None))
            .order_by(t.c.created_at.desc())
            .limit(limit)
        )
        return [FailedAttempt(*row) for row in await self._rows("failed attempts", stmt)]

    async def recent_input_events(
        self, dataset_uuids: Collection[uuid.UUID], *, limit: int
    ) -> list[InputEvent]:
        if not dataset_uuids:
            return []
        e, d = schema.events, schema.datasets
        stmt = (
            sa.select(
                e.c.received_at,
                d.c.name,
                e.c.dataset_version,
                e.c.unit_key,
                e.c.deliveries,
                e.c.route_status,
                e.c.route_detail,
            )
            .join(d, d.c.id == e.c.dataset_uuid)
            .where(e.c.dataset_uuid.in_(list(dataset_uuids)))
            .order_by(e.c.received_at.desc(), e.c.id)
            .limit(limit)
        )
        return [InputEvent(*row) for row in await self._rows("recent input events", stmt)]
