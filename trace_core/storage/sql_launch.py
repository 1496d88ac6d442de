"""The launch area (:mod:`trace_core.storage.ports.launch`) in SQL, for both engines."""

from __future__ import annotations

import uuid
from collections.abc import Collection

import sqlalchemy as sa

from trace_core.storage import schema
from trace_core.storage.ports.launch import StartableTask
from trace_core.storage.sql_area import SqlArea

__all__ = ["SqlLaunchOps"]


class SqlLaunchOps(SqlArea):
    """:class:`~trace_core.storage.ports.launch.LaunchOps` on a SQL transaction."""

    async def startable_tasks(self, task_ids: Collection[uuid.UUID]) -> list[StartableTask]:
        if not task_ids:
            return []
        t, j = schema.tasks, schema.jobs
        stmt = (
            sa.select(t.c.id, j.c.runtime, j.c.operator)
            .join(j, j.c.id == t.c.job_id)
            .where(t.c.id.in_(list(task_ids)), t.c.status == "Queued")
        )
        return [StartableTask(r[0], r[1], r[2]) for r in await self._rows("startable tasks", stmt)]
