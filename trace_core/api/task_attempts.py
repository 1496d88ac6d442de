"""``GET /internal/tasks/{task_id}``: a task's state and its execution attempts.

=================================  ============================================
route                              answers
=================================  ============================================
``GET /internal/tasks/{task_id}``  200 the task's status, attempt counters,
                                   retry time, last error, and every attempt
                                   (oldest first) with its worker, transport
                                   message, start and end, final status,
                                   ``result`` and ``error``; 404 no such task
=================================  ============================================

Read-only. The lease token of the running attempt is never shown: it is
the holder's secret (whoever has it may complete the attempt).
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel

from trace_core.api.errors import ERROR_RESPONSES, answer_doc
from trace_core.dispatcher.service import Dispatcher
from trace_core.storage.ports import AttemptRecord

__all__ = ["AttemptView", "TaskView", "attempts_router"]

_NOT_FOUND: dict[int | str, dict[str, Any]] = {404: answer_doc("No such task")}


class AttemptView(BaseModel):
    """One execution attempt (a ``job_attempts`` record)."""

    attempt_id: uuid.UUID
    attempt: int
    worker_id: str
    stream: str | None
    message_id: str | None
    status: str
    started_at: datetime
    ended_at: datetime | None
    result: dict[str, Any] | None
    error: dict[str, Any] | None

    @classmethod
    def of(cls, record: AttemptRecord) -> AttemptView:
        """The view of ``record``."""
        return cls(
            attempt_id=record.attempt_id,
            attempt=record.attempt,
            worker_id=record.worker_id,
            stream=record.stream,
            message_id=record.message_id,
            status=record.status,
            started_at=record.started_at,
            ended_at=record.ended_at,
            result=dict(record.result) if record.result is not None else None,
            error=dict(record.error) if record.error is not None else None,
        )


class TaskView(BaseModel):
    """A task's ownership state and its attempts, oldest first."""

    task_id: uuid.UUID
    status: str
    attempt: int
    max_attempts: int
    lease_expires_at: datetime | None
    retry_at: datetime | None
    last_error: str | None
    attempts: list[AttemptView]


def attempts_router(dispatcher: Dispatcher) -> APIRouter:
    """The route of the module docstring, on ``dispatcher``."""
    router = APIRouter(prefix="/internal", tags=["ops"], responses=ERROR_RESPONSES)

    @router.get("/tasks/{task_id}", responses=_NOT_FOUND)
    async def task(task_id: uuid.UUID) -> TaskView:
        """The task's state and its attempts with their results and errors."""
        state = await dispatcher.tasks.leases.inspect(task_id)  # NotFound: 404
        async with dispatcher.repo.read() as tx:
            records = (await tx.attempts.of_tasks([task_id])).get(task_id, [])
        return TaskView(
            task_id=task_id,
            status=state.status,
            attempt=state.attempt,
            max_attempts=state.max_attempts,
            lease_expires_at=state.lease_expires_at,
            retry_at=state.retry_at,
            last_error=state.last_error,
            attempts=[AttemptView.of(r) for r in records],
        )

    return router
