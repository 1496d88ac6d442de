"""The inbox area of the repository port: Euterpe's transcode jobs.

Reached as ``tx.inbox`` on any :class:`~trace_core.storage.protocol.Transaction`.
The ownership protocol of ``inbox_jobs`` (claim, heartbeat, stage changes,
failure, reclaim) is the generic one (:mod:`trace_core.leasing`); this area
holds what is particular to Euterpe's jobs: their insertion, the history and
webhook event rows every transition writes (euterpe-contract.md §3, §8), the
credential-refresh counter (§5, §7), the status read (§6) and retention
pruning with tombstones.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from trace_core.model import Fence
from trace_core.storage.ports.inbox_credentials import SealedCredentials

__all__ = [
    "EventDelivery",
    "HistoryEntry",
    "InboxJobRecord",
    "InboxOps",
    "JobSnapshot",
    "JobStatusRecord",
    "NewInboxJob",
    "NewJobEvent",
    "RefreshCount",
    "Tombstone",
]


@dataclass(frozen=True)
class NewInboxJob:
    """A job to insert, in status ``queued``, claimable from ``available_at``."""

    job_id: uuid.UUID
    requester_id: str
    request: Mapping[str, Any]
    status_webhook_url: str | None
    refresh_url: str | None
    max_attempts: int
    available_at: datetime
    credential_version: int = 0
    sealed: SealedCredentials | None = None


@dataclass(frozen=True)
class JobSnapshot:
    """The columns of a job a transition's history row and event are built from,
    and the ``sequence`` its next event takes."""

    job_id: uuid.UUID
    status: str
    attempt_count: int
    max_attempts: int
    claim_version: int
    worker_id: str | None
    credential_refresh_count: int
    credential_version: int
    status_webhook_url: str | None
    available_at: datetime
    next_sequence: int


@dataclass(frozen=True)
class HistoryEntry:
    """One status a job passed through (``from_status`` is ``None`` for the insert)."""

    job_id: uuid.UUID
    from_status: str | None
    to_status: str
    claim_version: int
    attempt_count: int
    worker_id: str | None
    reason: str | None
    at: datetime


@dataclass(frozen=True)
class NewJobEvent:
    """A webhook event to insert as ``pending`` (its ``event_id`` is the row id)."""

    event_id: uuid.UUID
    job_id: uuid.UUID
    sequence: int
    event_type: str
    payload: Mapping[str, Any]
    available_at: datetime
    max_attempts: int


@dataclass(frozen=True)
class EventDelivery:
    """Where one of a job's webhook events stands."""

    event_id: uuid.UUID
    sequence: int
    event_type: str
    status: str
    attempts: int
    last_error: str | None
    created_at: datetime
    delivered_at: datetime | None


@dataclass(frozen=True)
class InboxJobRecord:
    """A job's row, without its sealed credentials."""

    job_id: uuid.UUID
    requester_id: str
    status: str
    request: Mapping[str, Any]
    status_webhook_url: str | None
    refresh_url: str | None
    attempt_count: int
    max_attempts: int
    credential_refresh_count: int
    credential_version: int
    claim_version: int
    worker_id: str | None
    lease_expires_at: datetime | None
    heartbeat_at: datetime | None
    available_at: datetime
    last_error: str | None
    outputs: Any
    created_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True)
class JobStatusRecord:
    """Everything a status read shows of one job."""

    job: InboxJobRecord
    history: list[HistoryEntry]
    events: list[EventDelivery]


@dataclass(frozen=True)
class RefreshCount:
    """The answer of :meth:`InboxOps.count_credential_refresh_if_current_claim`."""

    counted: bool
    """Whether this call counted a refresh (False: the budget was spent)."""
    count: int
    """The job's ``credential_refresh_count`` after the call."""


@dataclass(frozen=True)
class Tombstone:
    """What remains of a job removed by retention pruning."""

    job_id: uuid.UUID
    requester_id: str
    final_status: str
    pruned_at: datetime


class InboxOps(Protocol):
    """Euterpe's inbox jobs, their history and their webhook events, inside one transaction."""

    async def insert_job(self, job: NewInboxJob, *, now: datetime) -> None:
        """Insert ``job`` as ``queued`` with ``attempt_count`` and
        ``claim_version`` 0, created at ``now``. An existing id raises
        :class:`~trace_core.errors.DuplicateItem` (nothing is written)."""
        ...

    async def lock_jobs_for_transition(
        self, job_ids: Collection[uuid.UUID]
    ) -> dict[uuid.UUID, JobSnapshot]:
        """The snapshot of each of ``job_ids`` that exists, its row locked until
        the transaction ends (Postgres: ``FOR UPDATE``, taken in id order;
        SQLite: the write transaction already holds the database).

        ``next_sequence`` is 1 + the highest ``sequence`` of the job's events
        (1 when it has none), read after the lock is held: no other
        transaction can add an event to a locked job before this one ends, so
        two writers never take the same number. Unknown ids are left out;
        empty input returns ``{}`` (no statement runs)."""
        ...

    async def append_history(self, entries: Sequence[HistoryEntry]) -> None:
        """Append each entry to its job's history; entries are never replaced.
        Empty input writes nothing."""
        ...

    async def insert_events(self, events: Sequence[NewJobEvent], *, now: datetime) -> None:
        """Insert each event as ``pending`` with 0 attempts, created at ``now``.
        An existing event id raises :class:`~trace_core.errors.DuplicateItem`.
        Empty input writes nothing."""
        ...

    async def count_credential_refresh_if_current_claim(
        self, fence: Fence, *, budget: int
    ) -> RefreshCount | None:
        """Add 1 to the job's ``credential_refresh_count`` if ``fence`` is its
        current claim (id, attempt, lease token and claim_version all match,
        the job in a leased stage) and the count is below ``budget``.

        ``None`` when the fence is not current (nothing changed);
        ``RefreshCount(False, count)`` when it is but the budget is spent.
        ``attempt_count`` is never touched."""
        ...

    async def job_status(self, job_id: uuid.UUID) -> JobStatusRecord | None:
        """The job's row, its history in the order the job passed through it
        (by claim_version, then stage order, then time: steps written in one
        transaction share their time) and its events by ``sequence``; ``None``
        for an unknown job."""
        ...

    async def prune_finished_before(
        self,
        cutoff: datetime,
        *,
        statuses: Collection[str],
        limit: int,
        now: datetime,
    ) -> list[Tombstone]:
        """Remove up to ``limit`` jobs in one of ``statuses`` that finished
        before ``cutoff`` and have no event still ``pending`` or
        ``delivering``: for each, a tombstone (pruned at ``now``) is written,
        then its events, history and row are deleted. Oldest finished first;
        the tombstones written are returned in that order. Jobs another
        pruner holds are skipped (Postgres ``SKIP LOCKED``)."""
        ...

    async def tombstone(self, job_id: uuid.UUID) -> Tombstone | None:
        """The tombstone of a pruned job; ``None`` if it was never pruned."""
        ...
