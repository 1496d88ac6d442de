"""The job journal: why a job did or did not run, for ``explain``.

Only decisions that are rare compared with events go here (pauses and
resumes, concurrency waits, source restarts, cron fires, version swaps);
per-event routing outcomes live on the ``events`` rows themselves.
"""

from __future__ import annotations

import uuid
from typing import Any

from trace_core.storage.protocol import Transaction

__all__ = ["JournalEntry", "read_journal"]


class JournalEntry(dict[str, Any]):
    """One journal row as a mapping: ``at``, ``kind``, ``message``, ``detail``."""


async def read_journal(
    tx: Transaction, job_id: uuid.UUID, *, limit: int = 50
) -> list[JournalEntry]:
    """The newest ``limit`` entries about ``job_id``, newest first."""
    return [
        JournalEntry(at=e.at, kind=e.kind, message=e.message, detail=e.detail)
        for e in await tx.journal.newest(job_id, limit=limit)
    ]
