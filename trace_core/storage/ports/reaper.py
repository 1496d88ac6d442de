"""The reaper area of the repository port: what the reaper reads about running attempts.

Reached as ``tx.reaper`` on any :class:`~trace_core.storage.protocol.Transaction`.
The reaper's writes are the ownership protocol's (reclaim and the fenced
``fail``); this area finds what they apply to, one statement per batch.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

__all__ = ["HeldLease", "ReaperOps", "TimedOutAttempt"]


@dataclass(frozen=True)
class HeldLease:
    """A task's job and the timestamps of the lease its attempt held."""

    job_id: uuid.UUID
    last_heartbeat: datetime | None
    lease_expires_at: datetime | None


@dataclass(frozen=True)
class TimedOutAttempt:
    """A running attempt older than its job's ``timeout_seconds``."""

    task_id: uuid.UUID
    attempt: int
    lease_token: uuid.UUID
    job_id: uuid.UUID
    timeout_seconds: int


class ReaperOps(Protocol):
    """Reads for the reaper, inside one transaction."""

    async def heartbeat_timeout_of_task(self, task_id: uuid.UUID) -> int | None:
        """The ``heartbeat_timeout_seconds`` of ``task_id``'s job; ``None`` when
        the job has none or the task does not exist."""
        ...

    async def held_leases(self, task_ids: Collection[uuid.UUID]) -> dict[uuid.UUID, HeldLease]:
        """Per existing task of ``task_ids``: its job, last heartbeat and lease
        expiry (unknown ids are left out; empty for an empty input)."""
        ...

    async def timed_out_attempts(self, *, now: datetime, limit: int) -> list[TimedOutAttempt]:
        """Up to ``limit`` ``Running`` attempts holding a lease whose ``started_at``
        is more than their job's ``timeout_seconds`` (positive) before ``now``,
        oldest start first; jobs without a timeout are left alone."""
        ...
