"""The worker's view of the Dispatcher: :class:`ControlPlaneClient`.

One protocol, two implementations with the same semantics, so the worker
wrapper has exactly one code path: :class:`InProcessClient` calls a
:class:`~trace_core.dispatcher.control.TaskControl` directly (the lite
profile, the Dispatcher's own in-process runner), and
:class:`~trace_core.worker.http_client.HttpControlPlaneClient` calls the
``/internal/*`` endpoints (interface-contracts.md, "Worker -> Dispatcher").

Both translate failures into the same four answers:

* :class:`~trace_core.errors.StaleClaim`: the attempt or lease is no longer
  current (reclaimed, superseded, canceled, or the task is gone). Never retried;
  the worker aborts and writes nothing more.
* :class:`ControlPlaneUnavailable`: the Dispatcher or its database could not be
  reached (transport error, 5xx, 503, :class:`~trace_core.errors.DatabaseUnavailable`).
  Retried with backoff by :class:`~trace_core.worker.retrying.RetryingClient`.
* :class:`~trace_core.errors.InvalidInput`: the request was malformed (400).
* :class:`ControlPlaneRejected`: any other refusal (401, 403, a 409 that is not
  ``stale``...). Never retried.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from trace_core.errors import (
    DatabaseUnavailable,
    InvalidTransition,
    NotFound,
    StaleClaim,
    TraceError,
)
from trace_core.model import Fence

if TYPE_CHECKING:
    from trace_core.dispatcher.control import TaskControl
    from trace_core.dispatcher.events import AcceptResult, DatasetEvent

__all__ = [
    "ClaimResult",
    "ControlPlaneClient",
    "ControlPlaneRejected",
    "ControlPlaneUnavailable",
    "HeartbeatResult",
    "InProcessClient",
]


class ControlPlaneUnavailable(TraceError):
    """The Dispatcher (or its state database) could not be reached; retry later.

    ``retry_after`` is the server's ``Retry-After`` in seconds, when it sent one.
    """

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ControlPlaneRejected(TraceError):
    """The Dispatcher refused the request for good (not retried).

    ``status`` is the HTTP status (or its in-process equivalent) and ``error``
    the stable error code of the answer (``unauthorized``, ``not_canceled``...).
    """

    def __init__(self, status: int, error: str, reason: str) -> None:
        super().__init__(f"{status} {error}: {reason}")
        self.status = status
        self.error = error
        self.reason = reason


@dataclass(frozen=True)
class ClaimResult:
    """The answer to a claim: a lease on the task's current attempt, or the reason
    there is none (``AlreadyRunning``, ``Completed``, ``Canceled``, ``NotFound``...)."""

    task_id: uuid.UUID
    reason: str | None = None
    attempt: int = 0
    lease_token: uuid.UUID | None = None
    lease_expires_at: datetime | None = None
    task: dict[str, Any] | None = None
    """The full task payload (the ``/internal/task-fetch`` shape), when claimed."""

    @property
    def claimed(self) -> bool:
        """Whether the lease was granted."""
        return self.lease_token is not None


@dataclass(frozen=True)
class HeartbeatResult:
    """An extended lease and what a running source should do now."""

    expires_at: datetime
    directive: str
    """``run``, ``pause`` (emit nothing until resumed) or ``stop`` (finish)."""
    capability_token: str | None = None
    """A renewed capability token for the attempt, when the presented one was due."""


class ControlPlaneClient(Protocol):
    """The calls a worker makes to the Dispatcher (see the module docstring for
    the errors every method may raise)."""

    async def claim(self, task_id: uuid.UUID, worker_id: str) -> ClaimResult:
        """Lease the task's next attempt and return its payload, or why not.

        Not being claimed is a normal answer: the worker must not run the task.
        """
        ...

    async def fetch(self, task_id: uuid.UUID) -> dict[str, Any]:
        """The task's full payload, read-only; :class:`NotFound` if it does not exist."""
        ...

    async def heartbeat(
        self,
        task_id: uuid.UUID,
        attempt: int,
        lease_token: uuid.UUID,
        capability_token: str | None = None,
    ) -> HeartbeatResult:
        """Extend the lease of the current attempt; :class:`StaleClaim` if it is not.

        With the attempt's ``capability_token``, the answer carries a renewed
        one once that token nears its expiry (never for a stale attempt).
        """
        ...

    async def emit(
        self, task_id: uuid.UUID, attempt: int, events: Sequence[DatasetEvent]
    ) -> AcceptResult:
        """Accept mid-task events of the current attempt (idempotent per unit of
        work, so a retried emit stores nothing twice)."""
        ...

    async def complete(
        self,
        task_id: uuid.UUID,
        attempt: int,
        lease_token: uuid.UUID,
        events: Sequence[DatasetEvent],
        outputs: Sequence[Mapping[str, Any]] | None,
    ) -> None:
        """Commit the final events and complete the attempt, atomically.

        A repeated completion of the same attempt (a retry after a lost answer)
        succeeds without changing anything.
        """
        ...

    async def fail(
        self,
        task_id: uuid.UUID,
        attempt: int,
        lease_token: uuid.UUID,
        error: str,
        retryable: bool,
    ) -> None:
        """Fail the attempt: a retry with backoff (``retryable``), or terminally.

        A repeated failure report of the same attempt changes nothing.
        """
        ...

    async def report_canceled(self, task_id: uuid.UUID, attempt: int) -> None:
        """Acknowledge that the task is canceled and was not run;
        :class:`ControlPlaneRejected` if it is not canceled."""
        ...


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
        )

    async def fetch(self, task_id: uuid.UUID) -> dict[str, Any]:
        """See :meth:`ControlPlaneClient.fetch`."""
        with _translated():
            return await self.control.fetch(task_id)

    async def heartbeat(
        self,
        task_id: uuid.UUID,
        attempt: int,
        lease_token: uuid.UUID,
        capability_token: str | None = None,
    ) -> HeartbeatResult:
        """See :meth:`ControlPlaneClient.heartbeat`."""
        with _translated(stale_if_missing=task_id):
            expires = await self.control.heartbeat(Fence(task_id, attempt, lease_token))
            directive = await self.control.directive(task_id)
            # After the fenced extension only, like /internal/heartbeat.
            renewed = await self.control.refresh_capability(task_id, attempt, capability_token)
        return HeartbeatResult(expires, directive, renewed)

    async def emit(
        self, task_id: uuid.UUID, attempt: int, events: Sequence[DatasetEvent]
    ) -> AcceptResult:
        """See :meth:`ControlPlaneClient.emit`."""
        with _translated(stale_if_missing=task_id):
            return await self.control.emit(task_id, attempt, events)

    async def complete(
        self,
        task_id: uuid.UUID,
        attempt: int,
        lease_token: uuid.UUID,
        events: Sequence[DatasetEvent],
        outputs: Sequence[Mapping[str, Any]] | None,
    ) -> None:
        """See :meth:`ControlPlaneClient.complete`."""
        fence = Fence(task_id, attempt, lease_token)
        with _translated(stale_if_missing=task_id):
            try:
                await self.control.complete(fence, events=events, outputs=outputs)
            except InvalidTransition:
                # Our own earlier report may have committed (its answer lost to
                # an outage): recognized as a duplicate, like the HTTP endpoint.
                if (await self._reported(fence)) != "Completed":
                    raise

    async def fail(
        self,
        task_id: uuid.UUID,
        attempt: int,
        lease_token: uuid.UUID,
        error: str,
        retryable: bool,
    ) -> None:
        """See :meth:`ControlPlaneClient.fail`."""
        fence = Fence(task_id, attempt, lease_token)
        with _translated(stale_if_missing=task_id):
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
        if state.attempt != fence.attempt or state.lease_token != fence.lease_token:
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
