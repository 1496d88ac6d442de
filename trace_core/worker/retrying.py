"""Riding out control-plane outages: :class:`RetryingClient`.

Wraps any :class:`~trace_core.worker.client.ControlPlaneClient` and retries
:class:`~trace_core.worker.client.ControlPlaneUnavailable` with exponential
backoff and full jitter (:class:`~trace_core.retry.Backoff`), honouring a
server's ``Retry-After``, until ``max_elapsed_seconds`` have passed since the
call began; then the last error is raised. Every other error (stale claim,
4xx, not found) is the answer and passes through at once.

Every call of the contract is safe to repeat: heartbeats extend, emits are
deduplicated per unit of work, and a repeated completion or failure report
of the same attempt is recognized as a duplicate. A claim whose answer was
lost is the one exception: the retry is refused (``AlreadyRunning``) and the
lease simply expires, after which the task is retried like any lost attempt.

Sleep, clock and random source are injected, so tests run an outage without
waiting.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import anyio

from trace_core.authoring.events import AcceptResult, DatasetEvent
from trace_core.errors import ConfigurationError
from trace_core.model import Fence
from trace_core.retry import Backoff
from trace_core.worker.client import (
    ClaimResult,
    ControlPlaneClient,
    ControlPlaneUnavailable,
    HeartbeatResult,
)

__all__ = ["DEFAULT_BACKOFF", "OutageRetry", "RetryingClient"]

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_BACKOFF = Backoff(base_seconds=0.5, factor=2.0, cap_seconds=30.0, jitter=1.0)
"""Half a second, doubling up to thirty, full jitter: a fleet of workers does
not hammer a recovering Dispatcher in lockstep."""


class OutageRetry:
    """Retries a call while it raises
    :class:`~trace_core.worker.client.ControlPlaneUnavailable` (module docstring);
    shared by :class:`RetryingClient` and the worker's other control-plane
    clients (:class:`~trace_core.worker.http_state.HttpOperatorState`)."""

    def __init__(
        self,
        *,
        backoff: Backoff = DEFAULT_BACKOFF,
        max_elapsed_seconds: float = 600.0,
        sleep: Callable[[float], Awaitable[None]] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if max_elapsed_seconds < 0:
            raise ConfigurationError("max_elapsed_seconds must be >= 0")
        self.backoff = backoff
        self.max_elapsed_seconds = max_elapsed_seconds
        self._sleep = sleep or anyio.sleep
        self._monotonic = monotonic
        self._rng = rng
        self.retries = 0
        """Retries made so far, over all calls (for tests and metrics)."""

    async def __call__(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """``call()``'s answer, retrying outages until the budget is spent."""
        started = self._monotonic()
        retry = 0
        while True:
            try:
                return await call()
            except ControlPlaneUnavailable as exc:
                retry += 1
                delay = self.backoff.delay(retry, self._rng).total_seconds()
                if exc.retry_after is not None:
                    delay = max(delay, exc.retry_after)
                if self._monotonic() - started + delay > self.max_elapsed_seconds:
                    log.warning("%s: giving up after %d retries: %s", what, retry - 1, exc)
                    raise
                log.info(
                    "%s: control plane unavailable (%s); retry %d in %.2fs", what, exc, retry, delay
                )
                self.retries += 1
                await self._sleep(delay)


class RetryingClient:
    """A :class:`~trace_core.worker.client.ControlPlaneClient` that retries outages."""

    def __init__(
        self,
        inner: ControlPlaneClient,
        *,
        backoff: Backoff = DEFAULT_BACKOFF,
        max_elapsed_seconds: float = 600.0,
        sleep: Callable[[float], Awaitable[None]] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.inner = inner
        self.retry = OutageRetry(
            backoff=backoff,
            max_elapsed_seconds=max_elapsed_seconds,
            sleep=sleep,
            monotonic=monotonic,
            rng=rng,
        )
        """The retry loop; pass it to the worker's other clients to share its budget rules."""

    @property
    def backoff(self) -> Backoff:
        """The delays between retries."""
        return self.retry.backoff

    @property
    def max_elapsed_seconds(self) -> float:
        """How long a call is retried before its last error is raised."""
        return self.retry.max_elapsed_seconds

    @property
    def retries(self) -> int:
        """Retries made so far, over all calls (for tests and metrics)."""
        return self.retry.retries

    async def claim(self, task_id: uuid.UUID, worker_id: str) -> ClaimResult:
        """See :meth:`ControlPlaneClient.claim`."""
        return await self.retry("claim", lambda: self.inner.claim(task_id, worker_id))

    async def fetch(self, task_id: uuid.UUID) -> dict[str, Any]:
        """See :meth:`ControlPlaneClient.fetch`."""
        return await self.retry("fetch", lambda: self.inner.fetch(task_id))

    async def heartbeat(self, fence: Fence, capability_token: str | None = None) -> HeartbeatResult:
        """See :meth:`ControlPlaneClient.heartbeat`."""
        return await self.retry("heartbeat", lambda: self.inner.heartbeat(fence, capability_token))

    async def emit(
        self, task_id: uuid.UUID, attempt: int, events: Sequence[DatasetEvent]
    ) -> AcceptResult:
        """See :meth:`ControlPlaneClient.emit`."""
        return await self.retry("emit", lambda: self.inner.emit(task_id, attempt, events))

    async def complete(
        self,
        fence: Fence,
        events: Sequence[DatasetEvent],
        outputs: Sequence[Mapping[str, Any]] | None,
    ) -> None:
        """See :meth:`ControlPlaneClient.complete`."""
        await self.retry("complete", lambda: self.inner.complete(fence, events, outputs))

    async def fail(self, fence: Fence, error: str, retryable: bool) -> None:
        """See :meth:`ControlPlaneClient.fail`."""
        await self.retry("fail", lambda: self.inner.fail(fence, error, retryable))

    async def report_canceled(self, task_id: uuid.UUID, attempt: int) -> None:
        """See :meth:`ControlPlaneClient.report_canceled`."""
        await self.retry("report_canceled", lambda: self.inner.report_canceled(task_id, attempt))
