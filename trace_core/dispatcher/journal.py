"""The job journal: why a job did or did not run, for ``explain``.

Only decisions that are rare compared with events go here (pauses and
resumes, concurrency waits, source restarts, cron fires, version swaps);
per-event routing outcomes live on the ``events`` rows themselves.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from trace_core.storage import schema

__all__ = ["JournalEntry", "read_journal", "record"]


async def record(
    conn: AsyncConnection,
    job_id: uuid.UUID,
    kind: str,
    message: str,
    *,
    now: datetime,
    detail: Mapping[str, Any] | None = None,
) -> None:
    """Append one decision about ``job_id`` in the caller's transaction."""
    await conn.execute(
        sa.insert(schema.job_journal).values(
            job_id=job_id,
            at=now,
            kind=kind,
            message=message,
            detail=dict(detail) if detail is not None else None,
        )
    )


class JournalEntry(dict[str, Any]):
    """One journal row as a mapping: ``at``, ``kind``, ``message``, ``detail``."""


async def read_journal(
    conn: AsyncConnection, job_id: uuid.UUID, *, limit: int = 50
) -> list[JournalEntry]:
    """The newest ``limit`` entries about ``job_id``, newest first."""
    j = schema.job_journal
    rows = await conn.execute(
        sa.select(j.c.at, j.c.kind, j.c.message, j.c.detail)
        .where(j.c.job_id == job_id)
        .order_by(j.c.at.desc(), j.c.id.desc())
        .limit(limit)
    )
    return [JournalEntry(row._mapping) for row in rows]
