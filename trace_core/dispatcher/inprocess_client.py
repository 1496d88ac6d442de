"""The worker's control-plane port served in this process: :class:`InProcessClient`.

The adapter of :class:`~trace_core.worker.client.ControlPlaneClient` onto a
:class:`~trace_core.dispatcher.control.TaskControl`, for the lite profile and
the Dispatcher's own in-process runner. It lives with the Dispatcher (the port
lives with the worker) so that the worker never imports the control plane. It
translates core errors into the client contract's answers exactly as
:class:`~trace_core.worker.http_client.HttpControlPlaneClient` does for HTTP.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from trace_core.authoring.events import AcceptResult, DatasetEvent
from trace_core.dispatcher.control import TaskControl
from trace_core.errors import DatabaseUnavailable, InvalidTransition, NotFound, StaleClaim
from trace_core.model import Fence
from trace_core.worker.client import (
    ClaimResult,
    ControlPlaneRejected,
    ControlPlaneUnavailable,
    HeartbeatResult,
    task_id_of,
)

__all__ = ["InProcessClient"]


class InProcessClient:
    """:class:`ControlPlaneClient` on a :class:`TaskControl` in this process."""

    def __init__(self, control: TaskControl) -> None:
        self.control = control

    async def claim(self, task_id: uuid.UUID, worker_id: str) -> ClaimResult:
        """See :meth:`ControlPlaneClient.claim`."""
        with _translated():
            claimed = await self.control.claim(task_id, worker_id)
        lease = claimed.outcome.lease
        if lease is None or claimed.task is None:
            reason = claimed.outcome.reason
            return ClaimResult(task_id, reason=str(reason.value) if reason else "NotReady")
        return ClaimResult(
            task_id,
            attempt=lease.attempt,
            lease_token=lease.lease_token,
            lease_expires_at=lease.expires_at,
            task=claimed.task,
            claim_version=lease.claim_version,
        )

    async def fetch(self, task_id: uuid.UUID) -> dict[str, Any]:
        """See :meth:`ControlPlaneClient.fetch`."""
        with _translated():
            return await self.control.fetch(task_id)

    async def heartbeat(self, fence: Fence, capability_token: str | None = None) -> HeartbeatResult:
        """See :meth:`ControlPlaneClient.heartbeat`."""
        task_id = task_id_of(fence)
        with _translated(stale_if_missing=task_id):
            expires = await self.control.heartbeat(fence)
            directive = await self.control.directive(task_id)
            # After the fenced extension only, like /internal/heartbeat.
            renewed = await self.control.refresh_capability(
                task_id, fence.attempt, capability_token
            )
        return HeartbeatResult(expires, directive, renewed)

    async def emit(
        self, task_id: uuid.UUID, attempt: int, events: Sequence[DatasetEvent]
    ) -> AcceptResult:
        """See :meth:`ControlPlaneClient.emit`."""
        with _translated(stale_if_missing=task_id):
            return await self.control.emit(task_id, attempt, events)

    async def complete(
        self,
        fence: Fence,
        events: Sequence[DatasetEvent],
        outputs: Sequence[Mapping[str, Any]] | None,
    ) -> None:
        """See :meth:`ControlPlaneClient.complete`."""
        with _translated(stale_if_missing=task_id_of(fence)):
            try:
                await self.control.complete(fence, events=events, outputs=outputs)
            except InvalidTransition:
                # Our own earlier report may have committed (its answer lost to
                # an outage): recognized as a duplicate, like the HTTP endpoint.
                if (await self._reported(fence)) != "Completed":
                    raise

    async def fail(self, fence: Fence, error: str, retryable: bool) -> None:
        """See :meth:`ControlPlaneClient.fail`."""
        with _translated(stale_if_missing=task_id_of(fence)):
            try:
                await self.control.fail(fence, error, retryable=retryable)
            except InvalidTransition:
                if (await self._reported(fence)) not in ("Failed", "Queued"):
                    raise

    async def report_canceled(self, task_id: uuid.UUID, attempt: int) -> None:
        """See :meth:`ControlPlaneClient.report_canceled`."""
        with _translated():
            state = await self.control.tasks.leases.inspect(task_id)
        if state.status != "Canceled":
            raise ControlPlaneRejected(
                409, "not_canceled", f"task {task_id} is {state.status}, not Canceled"
            )

    async def _reported(self, fence: Fence) -> str:
        """The task's status when ``fence``'s attempt still owns it; else stale."""
        state = await self.control.tasks.leases.inspect(fence.item_id)
        if (
            state.attempt != fence.attempt
            or state.lease_token != fence.lease_token
            or fence.claim_version not in (None, state.claim_version)
        ):
            raise StaleClaim("tasks", fence.item_id, f"attempt {fence.attempt} is not current")
        if state.status == "Canceled":
            raise StaleClaim("tasks", fence.item_id, "the task was canceled")
        return state.status


@contextmanager
def _translated(*, stale_if_missing: uuid.UUID | None = None) -> Iterator[None]:
    """Core errors as the client contract's errors (the module docstring)."""
    try:
        yield
    except DatabaseUnavailable as exc:
        raise ControlPlaneUnavailable(str(exc)) from exc
    except InvalidTransition as exc:
        raise ControlPlaneRejected(409, "invalid_transition", str(exc)) from exc
    except NotFound as exc:
        if stale_if_missing is None:
            raise
        # A fenced call on a task that no longer exists: our claim cannot be current.
        raise StaleClaim("tasks", stale_if_missing, "no such task") from exc
