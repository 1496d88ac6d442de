"""The journal area of the repository port: why a job did or did not run.

Reached as ``tx.journal`` on any :class:`~trace_core.storage.protocol.Transaction`.
The job journal holds the decisions that are rare compared with events
(pauses and resumes, concurrency waits, source restarts, cron fires, version
swaps), appended by the Dispatcher's services and read by ``explain``.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

__all__ = ["JournalOps", "JournalRecord"]


@dataclass(frozen=True)
class JournalRecord:
    """One journal entry about a job."""

    at: datetime
    kind: str
    message: str
    detail: Mapping[str, Any] | None


class JournalOps(Protocol):
    """The job journal, inside one transaction."""

    async def append(
        self,
        job_id: uuid.UUID,
        kind: str,
        message: str,
        *,
        now: datetime,
        detail: Mapping[str, Any] | None = None,
    ) -> None:
        """Append one entry about ``job_id``, at ``now``; entries are never
        replaced (two alike are two entries)."""
        ...

    async def newest(self, job_id: uuid.UUID, *, limit: int) -> list[JournalRecord]:
        """The newest ``limit`` entries about ``job_id``, newest first (entries
        at the same time: the one appended last first). Other jobs' entries
        are left out."""
        ...

    async def jobs_with_entry(self, kind: str, job_ids: Collection[uuid.UUID]) -> set[uuid.UUID]:
        """Those of ``job_ids`` with at least one entry of ``kind``. Empty for
        empty ``job_ids`` (no statement runs)."""
        ...
