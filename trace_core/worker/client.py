"""The worker's view of the Dispatcher: :class:`ControlPlaneClient`.

One protocol, two implementations with the same semantics, so the worker
wrapper has exactly one code path:
:class:`~trace_core.dispatcher.inprocess_client.InProcessClient` (the
Dispatcher's adapter of this port) calls its ``TaskControl`` directly (the lite
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from trace_core.authoring.events import AcceptResult, DatasetEvent
from trace_core.errors import (
    InvalidInput,
    TraceError,
)
from trace_core.model import Fence

__all__ = [
    "ClaimResult",
    "ControlPlaneClient",
    "ControlPlaneRejected",
    "ControlPlaneUnavailable",
    "HeartbeatResult",
    "task_id_of",
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


def task_id_of(fence: Fence) -> uuid.UUID:
    """The task a worker's fence names (tasks are keyed by UUID)."""
    if not isinstance(fence.item_id, uuid.UUID):
        raise InvalidInput("task_id", f"{fence.item_id!r} is not a task id")
    return fence.item_id


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
    claim_version: int | None = None
    """The claim's ``claim_version`` when the control plane tells it (in process);
    every later write of the attempt presents it as part of its fence."""

    @property
    def claimed(self) -> bool:
        """Whether the lease was granted."""
        return self.lease_token is not None

    @property
    def fence(self) -> Fence:
        """What every write of the claimed attempt presents."""
        if self.lease_token is None:
            raise ValueError(f"task {self.task_id} was not claimed: {self.reason}")
        return Fence(self.task_id, self.attempt, self.lease_token, self.claim_version)


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

    async def heartbeat(self, fence: Fence, capability_token: str | None = None) -> HeartbeatResult:
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
        fence: Fence,
        events: Sequence[DatasetEvent],
        outputs: Sequence[Mapping[str, Any]] | None,
    ) -> None:
        """Commit the final events and complete the attempt, atomically.

        A repeated completion of the same attempt (a retry after a lost answer)
        succeeds without changing anything.
        """
        ...

    async def fail(self, fence: Fence, error: str, retryable: bool) -> None:
        """Fail the attempt: a retry with backoff (``retryable``), or terminally.

        A repeated failure report of the same attempt changes nothing.
        """
        ...

    async def report_canceled(self, task_id: uuid.UUID, attempt: int) -> None:
        """Acknowledge that the task is canceled and was not run;
        :class:`ControlPlaneRejected` if it is not canceled."""
        ...
