"""The job-states area of the repository port: the one per-job row of the
Dispatcher, and the job journal.

Reached as ``tx.job_states`` on any :class:`~trace_core.storage.protocol.Transaction`.
Every service that keeps per-job state (backpressure, sources, cron, the
manual trigger, the idle scaler, the concurrency gate) reads and writes it
here, and journals its decisions about a job. Every method runs inside that
transaction and sees its earlier writes; nothing commits by itself.

**Lock order.** Whatever locks several rows takes them in job id order
(:func:`by_job_id`, the order of Postgres ``uuid``), and ``job_states`` rows
before task rows; so no two services deadlock. Writes that name one row lock
it until the transaction ends (Postgres); SQLite has a single writer and
needs no row locks.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

__all__ = ["JOB_STATE_FIELDS", "JobStateOps", "ScaleState", "by_job_id"]

JOB_STATE_FIELDS = frozenset(
    {
        "paused",
        "pause_reason",
        "paused_at",
        "source_status",
        "source_task_id",
        "source_restarts",
        "next_fire_at",
        "last_fired_at",
        "scale_state",
        "last_activity_at",
    }
)
"""The fields of a job's row a service may set or compare (``updated_at`` is
kept by every write itself)."""


def by_job_id(job_ids: Iterable[uuid.UUID]) -> list[uuid.UUID]:
    """``job_ids`` deduplicated, in the lock order (Postgres ``uuid`` order)."""
    return sorted(set(job_ids), key=lambda j: j.int)


@dataclass(frozen=True)
class ScaleState:
    """A job's scale-to-zero state as stored."""

    scale_state: str
    """``Idle`` or ``Running``."""
    last_activity_at: datetime | None


class JobStateOps(Protocol):
    """Per-job state rows, inside one transaction."""

    async def ensure(self, job_ids: Collection[uuid.UUID], *, now: datetime) -> None:
        """Create the missing rows of ``job_ids`` (defaults, ``updated_at`` =
        ``now``), in lock order; existing rows are left unchanged. Nothing for
        an empty ``job_ids``."""
        ...

    async def lock(self, job_ids: Collection[uuid.UUID]) -> None:
        """Lock the existing rows of ``job_ids`` until the transaction ends, in
        lock order (Postgres; on SQLite, whose write transaction already
        excludes every other writer, nothing). Creates no row."""
        ...

    async def lock_for_claims(self, job_id: uuid.UUID, *, now: datetime) -> None:
        """Serialize the claims of the job's tasks until the transaction ends:
        on Postgres, create the job's row when missing and lock it (the lock
        order holds for callers that take one job at a time in job id order);
        on SQLite, whose write transaction already serializes claims, nothing
        (no row is created)."""
        ...

    async def update_if_matches(
        self,
        job_id: uuid.UUID,
        values: Mapping[str, object],
        *,
        now: datetime,
        expected: Mapping[str, object] | None = None,
    ) -> bool:
        """Create the job's row when missing, then set ``values`` (and
        ``updated_at`` = ``now``) if every field of ``expected`` holds its value
        (``None``: the field is unset); whether it was set. Other rows and
        fields are left alone. A field outside :data:`JOB_STATE_FIELDS` is
        :class:`~trace_core.errors.InvalidInput` naming it."""
        ...

    async def pause_state(self, job_id: uuid.UUID) -> tuple[bool, str | None]:
        """Whether the job is paused (by backpressure or by hand) and why; not
        paused when it has no row yet."""
        ...

    async def paused_jobs(self) -> dict[uuid.UUID, str | None]:
        """Every paused job and its reason (whoever paused it); empty when none is."""
        ...

    async def resume_if_paused_by(
        self, job_id: uuid.UUID, reason_prefix: str, *, now: datetime
    ) -> bool:
        """Unpause the job (reason and pause time cleared) if it is paused with
        a reason starting with ``reason_prefix`` (taken literally, ``%`` and
        ``_`` included); whether it was. A pause with another reason is left alone."""
        ...

    async def relabel_if_paused_by(
        self, job_id: uuid.UUID, reason_prefix: str, reason: str, *, now: datetime
    ) -> bool:
        """Replace the pause reason with ``reason`` under the guard of
        :meth:`resume_if_paused_by`, keeping the job paused; whether it did."""
        ...

    async def scale_states(self, job_ids: Collection[uuid.UUID]) -> dict[uuid.UUID, ScaleState]:
        """The scale state of each of ``job_ids`` that has a row (jobs without
        one are absent); empty for an empty ``job_ids``."""
        ...

    async def mark_running_if_idle(
        self, job_ids: Collection[uuid.UUID], *, now: datetime
    ) -> set[uuid.UUID]:
        """Move the ``Idle`` rows of ``job_ids`` to ``Running`` with
        ``last_activity_at`` = ``now``; the jobs moved. ``Running`` rows are
        left alone (a compare-and-set: concurrent scalers move a job once)."""
        ...

    async def touch_activity(self, job_ids: Collection[uuid.UUID], *, now: datetime) -> None:
        """Set ``last_activity_at`` = ``now`` on the rows of ``job_ids``, whatever
        their state. Nothing for an empty ``job_ids``."""
        ...

    async def mark_idle_if_unchanged(
        self, job_id: uuid.UUID, last_activity_at: datetime | None, *, now: datetime
    ) -> bool:
        """Move the job's row from ``Running`` to ``Idle`` if its
        ``last_activity_at`` is still ``last_activity_at`` (``None``: unset);
        whether it moved. ``last_activity_at`` itself is kept."""
        ...
