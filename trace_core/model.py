"""Values of the ownership protocol: queue descriptions, leases, fences, claims."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from trace_core.states import (
    INBOX_LIFECYCLE,
    JOB_OUTBOX_LIFECYCLE,
    OUTBOX_LIFECYCLE,
    TASK_LIFECYCLE,
    Lifecycle,
)

__all__ = [
    "INBOX_JOBS",
    "JOB_OUTBOX_EVENTS",
    "OUTBOX",
    "QUEUES",
    "TASKS",
    "ClaimOutcome",
    "Fence",
    "Holder",
    "ItemState",
    "Lease",
    "NotClaimedReason",
    "QueueSpec",
]

ItemId = uuid.UUID | int


@dataclass(frozen=True)
class QueueSpec:
    """How one durable queue maps onto the generic ownership protocol.

    The protocol is written once (:mod:`trace_core.leasing`); each queue only
    says which of its lifecycle's statuses play which role.
    """

    name: str
    lifecycle: Lifecycle
    ready: str
    """The claimable status."""
    claimed: str
    """The status a claim sets."""
    leased: frozenset[str]
    """Statuses in which a worker holds the lease (claim and later stages)."""
    done: str
    """The success status."""
    retry_to: str
    """Where a retryable failure goes (with its retry time set)."""
    dead: str
    """Where an exhausted or unrecoverable failure goes."""
    first_claim_keeps_attempt: bool
    """``True`` when a new row already counts attempt 1 (tasks, 1-based by spec)."""
    expiry_bumps_claim_version: bool
    """Whether the expiry mark itself fences out the old holder.

    Tasks keep the old holder's fence until the next claim, because the
    contract accepts a late reply for the current attempt after the timeout
    mark as long as no newer attempt started.
    """

    def __post_init__(self) -> None:
        for status in (self.ready, self.claimed, self.done, self.retry_to, self.dead):
            self.lifecycle.require_status(status)
        if self.claimed not in self.leased:
            raise ValueError(f"{self.name}: claimed status must be leased")

    def is_dead_letter(self, status: str, retry_at: object) -> bool:
        """Whether an item in ``status`` (with its retry time) is dead-lettered.

        Where one status is both "waiting for a retry" and the dead letter
        (tasks' ``Failed``), only the one without a retry time is dead.
        """
        return status == self.dead and (self.dead != self.retry_to or retry_at is None)

    @property
    def requeues_later(self) -> bool:
        """Whether retries wait in a separate status until due (then move to ready)."""
        return self.retry_to != self.ready


TASKS = QueueSpec(
    name="tasks",
    lifecycle=TASK_LIFECYCLE,
    ready="Queued",
    claimed="Running",
    leased=frozenset({"Running"}),
    done="Completed",
    retry_to="Failed",
    dead="Failed",
    first_claim_keeps_attempt=True,
    expiry_bumps_claim_version=False,
)

INBOX_JOBS = QueueSpec(
    name="inbox_jobs",
    lifecycle=INBOX_LIFECYCLE,
    ready="queued",
    claimed="claimed",
    leased=frozenset({"claimed", "fetching", "processing", "uploading"}),
    done="succeeded",
    retry_to="failed",
    dead="dead_letter",
    first_claim_keeps_attempt=False,
    expiry_bumps_claim_version=True,
)

OUTBOX = QueueSpec(
    name="outbox",
    lifecycle=OUTBOX_LIFECYCLE,
    ready="Pending",
    claimed="Processing",
    leased=frozenset({"Processing"}),
    done="Done",
    retry_to="Pending",
    dead="Failed",
    first_claim_keeps_attempt=False,
    expiry_bumps_claim_version=True,
)

JOB_OUTBOX_EVENTS = QueueSpec(
    name="job_outbox_events",
    lifecycle=JOB_OUTBOX_LIFECYCLE,
    ready="pending",
    claimed="delivering",
    leased=frozenset({"delivering"}),
    done="delivered",
    retry_to="pending",
    dead="dead_letter",
    first_claim_keeps_attempt=False,
    expiry_bumps_claim_version=True,
)

QUEUES: Mapping[str, QueueSpec] = {
    q.name: q for q in (TASKS, INBOX_JOBS, OUTBOX, JOB_OUTBOX_EVENTS)
}


@dataclass(frozen=True)
class Fence:
    """What a worker presents on every write: the item and its current claim.

    ``attempt`` and ``lease_token`` are always checked; ``claim_version`` too
    when the caller knows it (HTTP task callers know only attempt + token,
    which is as strong: a lease token is fresh random per claim).
    """

    item_id: ItemId
    attempt: int
    lease_token: uuid.UUID
    claim_version: int | None = None


@dataclass(frozen=True)
class Holder:
    """Who a report says holds a task's attempt (the v1 worker contract): a
    fenced write of tasks that carries it also requires the attempt's record,
    when there is one, to name ``worker_id``, and, given a ``stream``, the
    stream message the record names (if it names one) to be
    ``stream``/``message_id``. Checked in the write itself, so one statement
    does what a read of the record and a write did."""

    worker_id: str
    stream: str | None = None
    message_id: str | None = None


@dataclass(frozen=True)
class Lease:
    """A granted claim on one item."""

    queue: str
    item_id: ItemId
    attempt: int
    claim_version: int
    lease_token: uuid.UUID
    worker_id: str
    expires_at: datetime
    max_attempts: int
    data: Mapping[str, Any] = field(default_factory=dict)
    """Queue-specific columns of the claimed row (e.g. outbox kind and payload)."""
    attempt_id: uuid.UUID | None = None
    """The execution attempt's record (``job_attempts``), on queues that keep one (tasks)."""

    @property
    def fence(self) -> Fence:
        """The fence for writes under this lease."""
        return Fence(self.item_id, self.attempt, self.lease_token, self.claim_version)


@dataclass(frozen=True)
class ItemState:
    """The ownership columns of one item, as read for explaining a refusal."""

    item_id: ItemId
    status: str
    attempt: int
    claim_version: int
    lease_token: uuid.UUID | None
    lease_expires_at: datetime | None
    max_attempts: int
    retry_at: datetime | None
    last_error: str | None


class NotClaimedReason(StrEnum):
    """Why a claim by id was refused (interface-contracts.md, task-claim).

    ``NotReady`` is ours: the item exists but is neither leased nor finished
    (a failure waiting for its retry time, or a row not yet available).
    ``ConcurrencyLimit`` is the Dispatcher's: the job already runs
    ``scaling.max_concurrency`` tasks; the wake-up should be retried later.
    """

    ALREADY_RUNNING = "AlreadyRunning"
    COMPLETED = "Completed"
    CANCELED = "Canceled"
    NOT_FOUND = "NotFound"
    DEAD_LETTERED = "DeadLettered"
    NOT_READY = "NotReady"
    CONCURRENCY_LIMIT = "ConcurrencyLimit"


@dataclass(frozen=True)
class ClaimOutcome:
    """The answer to a claim by id: a lease, or the reason there is none."""

    lease: Lease | None
    reason: NotClaimedReason | None = None

    @property
    def claimed(self) -> bool:
        """Whether the claim was granted."""
        return self.lease is not None
