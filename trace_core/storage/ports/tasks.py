"""The tasks area of the repository port: reads of the task table by job and runtime.

Reached as ``tx.tasks`` on any :class:`~trace_core.storage.protocol.Transaction`.
Claiming and fenced writes are the ownership protocol's (the methods of the
transaction itself); this area only finds task ids for them.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from typing import Protocol

__all__ = ["RuntimeRoute", "TaskOps"]

RuntimeRoute = tuple[str, str | None]
"""``(runtime name, operator)``; operator ``None`` matches any operator."""


class TaskOps(Protocol):
    """Task lookups, inside one transaction."""

    async def oldest_queued(self, routes: Sequence[RuntimeRoute], *, limit: int) -> list[uuid.UUID]:
        """Up to ``limit`` ``Queued`` tasks whose job matches one of ``routes``,
        in claim order (``queued_at``, then id). Empty when ``routes`` is."""
        ...

    async def queued_in_id_order(
        self, routes: Sequence[RuntimeRoute], *, after: uuid.UUID | None, limit: int
    ) -> list[uuid.UUID]:
        """Up to ``limit`` ``Queued`` tasks whose job matches one of ``routes``,
        in id order, each id greater than ``after`` when given: pages over
        every such task, as one that stays ``Queued`` is not skipped by claim
        order's next page. Empty when ``routes`` is."""
        ...

    async def unfinished_of_jobs(self, job_ids: Collection[uuid.UUID]) -> list[uuid.UUID]:
        """The tasks of these jobs that can still run: ``Queued``, ``Running``,
        or ``Failed`` with a retry scheduled; oldest first."""
        ...
