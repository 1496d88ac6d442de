"""Where each queue's protocol columns live in the schema.

The ownership protocol speaks of "the attempt", "the heartbeat", "the retry
time"; the spec gives them different names per table (``tasks.attempt`` vs
``inbox_jobs.attempt_count``, ``last_heartbeat`` vs ``heartbeat_at``). This
map is the only place that knows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from trace_core.storage import schema

__all__ = ["QUEUE_TABLES", "QueueTable"]

Col = sa.Column[Any]


@dataclass(frozen=True)
class QueueTable:
    """The physical columns behind one queue's protocol roles."""

    table: sa.Table
    attempt: Col
    heartbeat: Col
    retry_at: Col
    """When a retry is due: a separate waiting status (tasks, inbox) or the
    availability gate itself (outboxes)."""
    ready_at: Col | None
    """Claims take only rows with ``ready_at <= now``; ``None`` = always ready."""
    error: Col
    finished_at: Col
    started_at: Col | None
    order_by: tuple[Col, ...]
    data: tuple[Col, ...]
    """Columns returned with a claim, into :attr:`Lease.data`."""

    @property
    def c(self) -> Any:
        """The table's column collection."""
        return self.table.c


def _q(
    table: sa.Table,
    *,
    attempt: str,
    heartbeat: str,
    retry_at: str,
    ready_at: str | None,
    error: str,
    finished_at: str,
    started_at: str | None,
    order_by: tuple[str, ...],
    data: tuple[str, ...],
) -> QueueTable:
    c = table.c
    return QueueTable(
        table=table,
        attempt=c[attempt],
        heartbeat=c[heartbeat],
        retry_at=c[retry_at],
        ready_at=c[ready_at] if ready_at else None,
        error=c[error],
        finished_at=c[finished_at],
        started_at=c[started_at] if started_at else None,
        order_by=tuple(c[n] for n in order_by),
        data=tuple(c[n] for n in data),
    )


QUEUE_TABLES: Mapping[str, QueueTable] = {
    "tasks": _q(
        schema.tasks,
        attempt="attempt",
        heartbeat="last_heartbeat",
        retry_at="next_retry_at",
        ready_at=None,
        error="error_message",
        finished_at="completed_at",
        started_at="started_at",
        order_by=("queued_at",),
        data=("job_id", "dedupe_key", "partitions", "input_versions"),
    ),
    "outbox": _q(
        schema.outbox,
        attempt="attempts",
        heartbeat="heartbeat_at",
        retry_at="available_at",
        ready_at="available_at",
        error="last_error",
        finished_at="processed_at",
        started_at=None,
        order_by=("available_at", "id"),
        data=("kind", "payload"),
    ),
    "inbox_jobs": _q(
        schema.inbox_jobs,
        attempt="attempt_count",
        heartbeat="heartbeat_at",
        retry_at="available_at",
        ready_at="available_at",
        error="last_error",
        finished_at="finished_at",
        started_at=None,
        order_by=("available_at", "created_at"),
        data=("requester_id", "request", "credential_version", "status_webhook_url"),
    ),
    "job_outbox_events": _q(
        schema.job_outbox_events,
        attempt="attempts",
        heartbeat="heartbeat_at",
        retry_at="available_at",
        ready_at="available_at",
        error="last_error",
        finished_at="delivered_at",
        started_at=None,
        order_by=("available_at", "created_at"),
        data=("job_id", "event_type", "payload"),
    ),
}
