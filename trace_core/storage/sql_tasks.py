"""The tasks area (:mod:`trace_core.storage.ports.tasks`) in SQL, for both engines."""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence

import sqlalchemy as sa

from trace_core.storage import schema
from trace_core.storage.ports.tasks import RuntimeRoute
from trace_core.storage.sql_area import SqlArea
from trace_core.storage.sql_leasing import status_in

__all__ = ["SqlTaskOps"]


def _queued(routes: Sequence[RuntimeRoute]) -> sa.Select[tuple[uuid.UUID]]:
    """The ids of the ``Queued`` tasks whose job matches one of ``routes``."""
    t, j = schema.tasks, schema.jobs
    routed = [
        j.c.runtime == runtime
        if operator is None
        else sa.and_(j.c.runtime == runtime, j.c.operator == operator)
        for runtime, operator in routes
    ]
    return (
        sa.select(t.c.id)
        .join(j, j.c.id == t.c.job_id)
        .where(status_in(t.c.status, "Queued"), sa.or_(*routed))
    )


class SqlTaskOps(SqlArea):
    """:class:`~trace_core.storage.ports.tasks.TaskOps` on a SQL transaction."""

    async def oldest_queued(self, routes: Sequence[RuntimeRoute], *, limit: int) -> list[uuid.UUID]:
        if not routes:
            return []
        t = schema.tasks
        stmt = _queued(routes).order_by(t.c.queued_at, t.c.id).limit(limit)
        return [row[0] for row in await self._rows("queued tasks", stmt)]

    async def queued_in_id_order(
        self, routes: Sequence[RuntimeRoute], *, after: uuid.UUID | None, limit: int
    ) -> list[uuid.UUID]:
        if not routes:
            return []
        t = schema.tasks
        stmt = _queued(routes).order_by(t.c.id).limit(limit)
        if after is not None:
            stmt = stmt.where(t.c.id > after)
        return [row[0] for row in await self._rows("queued tasks by id", stmt)]

    async def unfinished_of_jobs(self, job_ids: Collection[uuid.UUID]) -> list[uuid.UUID]:
        if not job_ids:
            return []
        t = schema.tasks
        unfinished = sa.or_(
            t.c.status.in_(["Queued", "Running"]),
            sa.and_(t.c.status == "Failed", t.c.next_retry_at.is_not(None)),
        )
        stmt = (
            sa.select(t.c.id)
            .where(t.c.job_id.in_(list(job_ids)), unfinished)
            .order_by(t.c.created_at)
        )
        return [row[0] for row in await self._rows("unfinished tasks", stmt)]
