"""The journal area (:mod:`trace_core.storage.ports.journal`) in SQL, for both engines."""

from __future__ import annotations

import uuid
from collections.abc import Collection, Mapping
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from trace_core.storage import schema
from trace_core.storage.ports.journal import JournalRecord
from trace_core.storage.sql_area import SqlArea

__all__ = ["SqlJournalOps"]


class SqlJournalOps(SqlArea):
    """:class:`~trace_core.storage.ports.journal.JournalOps` on a SQL transaction."""

    async def append(
        self,
        job_id: uuid.UUID,
        kind: str,
        message: str,
        *,
        now: datetime,
        detail: Mapping[str, Any] | None = None,
    ) -> None:
        stmt = sa.insert(schema.job_journal).values(
            job_id=job_id,
            at=now,
            kind=kind,
            message=message,
            detail=dict(detail) if detail is not None else None,
        )
        await self._run("journal entry", stmt)

    async def newest(self, job_id: uuid.UUID, *, limit: int) -> list[JournalRecord]:
        j = schema.job_journal
        stmt = (
            sa.select(j.c.at, j.c.kind, j.c.message, j.c.detail)
            .where(j.c.job_id == job_id)
            .order_by(j.c.at.desc(), j.c.id.desc())
            .limit(limit)
        )
        return [
            JournalRecord(row[0], str(row[1]), str(row[2]), row[3])
            for row in await self._rows("journal", stmt)
        ]

    async def jobs_with_entry(self, kind: str, job_ids: Collection[uuid.UUID]) -> set[uuid.UUID]:
        if not job_ids:
            return set()
        j = schema.job_journal
        stmt = sa.select(j.c.job_id).where(j.c.kind == kind, j.c.job_id.in_(list(job_ids)))
        return {row[0] for row in await self._rows("journaled jobs", stmt)}
