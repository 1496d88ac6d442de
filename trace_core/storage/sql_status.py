"""The status area (:mod:`trace_core.storage.ports.status`) in SQL, for both engines."""

from __future__ import annotations

import uuid

import sqlalchemy as sa

from trace_core.storage import schema
from trace_core.storage.ports.status import DagDataset, OutputVersion, TaskListing
from trace_core.storage.sql_area import SqlArea

__all__ = ["SqlStatusOps"]


class SqlStatusOps(SqlArea):
    """:class:`~trace_core.storage.ports.status.StatusOps` on a SQL transaction."""

    async def dag_datasets(self, org_slug: str, dag_name: str) -> list[DagDataset]:
        v, dv, p = schema.dag_versions, schema.dataset_versions, schema.dag_version_datasets
        d, o, g, e = schema.datasets, schema.orgs, schema.dataset_version_progress, schema.events
        events = (
            sa.select(sa.func.count())
            .where(e.c.dataset_version == dv.c.id)
            .scalar_subquery()
            .label("events")
        )
        stmt = (
            sa.select(
                d.c.name,
                d.c.id,
                dv.c.id.label("version"),
                v.c.status,
                dv.c.storage_location,
                dv.c.range_start,
                dv.c.range_end,
                g.c.ranges,
                g.c.max_cursor,
                events,
            )
            .select_from(v)
            .join(o, o.c.id == v.c.org_id)
            .join(p, p.c.dag_version_id == v.c.id)
            .join(dv, dv.c.id == p.c.dataset_version)
            .join(d, d.c.id == p.c.dataset_uuid)
            .outerjoin(g, g.c.dataset_version == dv.c.id)
            .where(o.c.slug == org_slug, v.c.dag_name == dag_name)
            .where(v.c.status.in_(["current", "building"]))
            .order_by(v.c.status.desc(), d.c.name)
        )
        rows = await self._rows("dag datasets", stmt)
        return [
            DagDataset(
                name=row.name,
                dataset_uuid=row.id,
                dataset_version=row.version,
                dag_version_status=row.status,
                location=row.storage_location,
                range_start=row.range_start,
                range_end=row.range_end,
                ranges=list(row.ranges or []),
                max_cursor=row.max_cursor,
                events=int(row.events or 0),
            )
            for row in rows
        ]

    async def task_counts_by_job(self, org_slug: str, dag_name: str) -> dict[str, dict[str, int]]:
        t, j, o = schema.tasks, schema.jobs, schema.orgs
        stmt = (
            sa.select(j.c.name, t.c.status, sa.func.count())
            .select_from(t)
            .join(j, j.c.id == t.c.job_id)
            .join(o, o.c.id == j.c.org_id)
            .where(o.c.slug == org_slug, j.c.dag_name == dag_name)
            .group_by(j.c.name, t.c.status)
        )
        by_job: dict[str, dict[str, int]] = {}
        for job, status, count in await self._rows("task counts by job", stmt):
            by_job.setdefault(job, {})[status] = int(count)
        return by_job

    async def recent_tasks(
        self,
        org_slug: str,
        dag_name: str,
        *,
        limit: int,
        job_name: str | None = None,
        status: str | None = None,
    ) -> list[TaskListing]:
        t, j, o = schema.tasks, schema.jobs, schema.orgs
        stmt = (
            sa.select(
                t.c.id,
                j.c.name,
                t.c.partitions,
                t.c.status,
                t.c.attempt,
                t.c.queued_at,
                t.c.error_message,
            )
            .join(j, j.c.id == t.c.job_id)
            .join(o, o.c.id == j.c.org_id)
            .where(o.c.slug == org_slug, j.c.dag_name == dag_name)
            .order_by(t.c.queued_at.desc())
            .limit(limit)
        )
        if job_name is not None:
            stmt = stmt.where(j.c.name == job_name)
        if status is not None:
            stmt = stmt.where(t.c.status == status)
        return [
            TaskListing(r[0], r[1], tuple(r[2] or ()), r[3], r[4], r[5], r[6])
            for r in await self._rows("recent tasks", stmt)
        ]

    async def open_outbox_count(self) -> int:
        o = schema.outbox
        stmt = sa.select(sa.func.count()).where(o.c.status.in_(["Pending", "Processing"]))
        rows = await self._rows("open outbox rows", stmt)
        return int(rows[0][0] or 0)

    async def task_counts_by_dedupe_prefix(self, prefix: str) -> list[tuple[str, int, int]]:
        t = schema.tasks
        stmt = (
            sa.select(t.c.status, t.c.attempt, sa.func.count())
            .where(t.c.dedupe_key.startswith(prefix, autoescape=True))
            .group_by(t.c.status, t.c.attempt)
        )
        return [(r[0], int(r[1]), int(r[2])) for r in await self._rows("task counts", stmt)]

    async def org_of_task(self, task_id: uuid.UUID) -> uuid.UUID | None:
        t, j = schema.tasks, schema.jobs
        stmt = (
            sa.select(j.c.org_id)
            .select_from(t)
            .join(j, j.c.id == t.c.job_id)
            .where(t.c.id == task_id)
        )
        rows = await self._rows("find the task's org", stmt)
        return rows[0][0] if rows else None

    async def output_version(self, task_id: uuid.UUID, dataset: uuid.UUID) -> OutputVersion | None:
        t, j = schema.tasks, schema.jobs
        p, v = schema.dag_version_datasets, schema.dataset_versions
        stmt = (
            sa.select(j.c.org_id, j.c.output_datasets, v.c.id, v.c.storage_location)
            .select_from(t)
            .join(j, j.c.id == t.c.job_id)
            .join(p, sa.and_(p.c.dag_version_id == j.c.dag_version_id, p.c.dataset_uuid == dataset))
            .join(v, v.c.id == p.c.dataset_version)
            .where(t.c.id == task_id)
        )
        rows = await self._rows("output version", stmt)
        # output_datasets is a JSON list of UUID strings on both engines.
        if not rows or str(dataset) not in {str(d) for d in rows[0].output_datasets or ()}:
            return None
        row = rows[0]
        return OutputVersion(row.org_id, row.id, str(row.storage_location))
