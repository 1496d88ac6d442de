"""The attempts area of the repository port: a task's execution attempts as records.

Reached as ``tx.attempts`` on any :class:`~trace_core.storage.protocol.Transaction`.
worker-control-plane-v1.md "JobAttempt": one row per execution attempt. The
ownership protocol opens the row in the claim's statement and closes it with
the attempt's final status in the statement or transaction that ends the
attempt (completion, failure, reaper, cancellation); this area reads the
rows, and writes what only the caller knows: the transport that delivered
the job, the completion's ``result`` and the failure's structured ``error``,
each guarded by the attempt it belongs to.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

__all__ = ["AttemptOps", "AttemptRecord"]


@dataclass(frozen=True)
class AttemptRecord:
    """One execution attempt of a task.

    ``status`` is ``Running`` until the attempt ends, then one of
    ``Completed``, ``Failed``, ``Expired``, ``TimedOut`` or ``Canceled``
    (:data:`~trace_core.storage.schema.ATTEMPT_STATUSES`).
    ``error`` is ``{code, message, stack, retryable}`` for an attempt that
    failed, expired or timed out.
    """

    attempt_id: uuid.UUID
    task_id: uuid.UUID
    attempt: int
    worker_id: str
    stream: str | None
    message_id: str | None
    status: str
    started_at: datetime
    ended_at: datetime | None
    result: Mapping[str, Any] | None
    error: Mapping[str, Any] | None


class AttemptOps(Protocol):
    """Reads and guarded writes of task attempts, inside one transaction."""

    async def of_tasks(
        self, task_ids: Collection[uuid.UUID]
    ) -> dict[uuid.UUID, list[AttemptRecord]]:
        """The attempts of each task of ``task_ids`` that has any, oldest attempt
        first; tasks without attempts (never claimed, unknown) are left out;
        empty for an empty input."""
        ...

    async def find(self, attempt_id: uuid.UUID) -> AttemptRecord | None:
        """The attempt ``attempt_id``, or ``None`` when there is none."""
        ...

    async def find_by_number(self, task_id: uuid.UUID, attempt: int) -> AttemptRecord | None:
        """Attempt number ``attempt`` of ``task_id``, or ``None`` when there is none."""
        ...

    async def set_transport_if_running(
        self, task_id: uuid.UUID, attempt: int, *, stream: str, message_id: str
    ) -> bool:
        """Record the stream message that delivered attempt ``attempt`` of
        ``task_id``, only while that attempt is ``Running``; whether it wrote."""
        ...

    async def set_result_if_ended(
        self, task_id: uuid.UUID, attempt: int, *, status: str, result: Mapping[str, Any]
    ) -> bool:
        """Keep a completion's ``result`` on attempt ``attempt`` of ``task_id``,
        only when the attempt ended with ``status`` (the write that ended it is
        earlier in this transaction); whether it wrote."""
        ...

    async def set_error_if_ended(
        self,
        task_id: uuid.UUID,
        attempt: int,
        *,
        statuses: Collection[str],
        error: Mapping[str, Any],
    ) -> bool:
        """Keep a failure's structured ``error`` on attempt ``attempt`` of
        ``task_id``, only when the attempt ended with one of ``statuses``;
        whether it wrote."""
        ...
