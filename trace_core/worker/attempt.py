"""One claimed attempt as the wrapper runs it: its lease, heartbeats and fenced calls.

:class:`Attempt` is the :class:`~trace_core.authoring.context.AttemptControl`
behind every :class:`~trace_core.authoring.context.TaskContext`. It remembers
the lease (token, expiry), computes the heartbeat schedule from the lease's
time to live, and is the single place that decides the attempt is lost:

* ``stale``: a heartbeat, emit or directive was refused as no longer current;
* ``abandoned``: a heartbeat could not reach the control plane even after
  the client's retries, so the lease cannot be kept.

Losing the lease cancels :attr:`Attempt.work` (the operator's scope), and
every later call is refused locally with :class:`~trace_core.errors.StaleClaim`,
so nothing more is written by a stale attempt.

It also holds the attempt's capability token: every heartbeat presents it,
and a renewed one in the answer is handed to :attr:`Attempt.on_renewed` (the
wrapper swaps it into the task context with freshly minted credentials)
before it replaces the old one, so the attempt keeps its data access for as
long as it keeps its lease.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

import anyio

from trace_core.authoring.events import AcceptResult, DatasetEvent
from trace_core.clock import Clock
from trace_core.errors import ConfigurationError, InvalidInput, NotFound, StaleClaim
from trace_core.model import Fence
from trace_core.worker.client import (
    ControlPlaneClient,
    ControlPlaneRejected,
    ControlPlaneUnavailable,
    HeartbeatResult,
    task_id_of,
)

__all__ = ["Attempt", "AttemptSettings"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttemptSettings:
    """Heartbeat and directive timing of the attempts a wrapper runs."""

    heartbeat_fraction: float = 1 / 3
    """Heartbeat every ``lease_ttl * heartbeat_fraction`` (the TTL as granted
    by the last claim or heartbeat)."""
    heartbeat_seconds: float | None = None
    """A fixed heartbeat period instead (keep it well under the lease)."""
    min_heartbeat_seconds: float = 0.5
    """Floor of the derived period (a skewed clock must not make it spin)."""
    directive_refresh_seconds: float = 1.0
    """A source's ``directive()`` reuses the last heartbeat's answer this long."""

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_fraction < 1:
            raise ConfigurationError("heartbeat_fraction must be within (0, 1)")
        if self.heartbeat_seconds is not None and self.heartbeat_seconds <= 0:
            raise ConfigurationError("heartbeat_seconds must be > 0")
        if self.min_heartbeat_seconds <= 0:
            raise ConfigurationError("min_heartbeat_seconds must be > 0")
        if self.directive_refresh_seconds < 0:
            raise ConfigurationError("directive_refresh_seconds must be >= 0")


class Attempt:
    """A claimed attempt: see the module docstring."""

    def __init__(
        self,
        client: ControlPlaneClient,
        fence: Fence,
        expires_at: datetime,
        *,
        settings: AttemptSettings,
        clock: Clock,
        capability_token: str | None = None,
    ) -> None:
        self.client = client
        self.fence = fence
        """What every write of the attempt presents (claim_version when known)."""
        self.task_id = task_id_of(fence)
        self.attempt = fence.attempt
        self.settings = settings
        self.clock = clock
        self.work = anyio.CancelScope()
        """The operator's scope: cancelled when the lease is lost."""
        self.heartbeats = 0
        self.capability_token = capability_token
        """The attempt's current capability token (renewed by heartbeats)."""
        self.on_renewed: Callable[[str], Awaitable[None]] | None = None
        """Takes a renewed token before the attempt adopts it; if it raises, the
        old token stays and the next heartbeat asks again."""
        self._lost: str | None = None
        self._closed = False
        self._ttl_seconds = 0.0
        self._directive: str | None = None
        self._directive_at: datetime | None = None
        self._granted(expires_at)

    @property
    def lost(self) -> str | None:
        """``stale`` or ``abandoned`` once the lease is lost; ``finished`` after
        :meth:`close`; else ``None``."""
        if self._lost is None and self._closed:
            return "finished"
        return self._lost

    @property
    def ttl_seconds(self) -> float:
        """The lease's time to live as last granted."""
        return self._ttl_seconds

    def heartbeat_delay(self) -> float:
        """Seconds until the next heartbeat is due."""
        if self.settings.heartbeat_seconds is not None:
            return self.settings.heartbeat_seconds
        return max(
            self.settings.min_heartbeat_seconds,
            self._ttl_seconds * self.settings.heartbeat_fraction,
        )

    def close(self) -> None:
        """The operator is done: refuse any further call from its context (an
        abandoned thread's, a timed-out operator's)."""
        self._closed = True

    def lose(self, reason: str) -> None:
        """Mark the lease lost and cancel the operator's work (first reason wins)."""
        if self._lost is None:
            self._lost = reason
        self.work.cancel()

    async def heartbeat(self) -> HeartbeatResult:
        """Extend the lease now; :class:`StaleClaim` once it is lost."""
        self._check()
        try:
            beat = await self.client.heartbeat(self.fence, self.capability_token)
        except (StaleClaim, NotFound) as exc:
            self.lose("stale")
            raise StaleClaim("tasks", self.task_id, f"heartbeat refused: {exc}") from exc
        except (ControlPlaneUnavailable, ControlPlaneRejected, InvalidInput) as exc:
            self.lose("abandoned")
            raise StaleClaim("tasks", self.task_id, f"lease not confirmed: {exc}") from exc
        except Exception as exc:
            # Whatever broke, the lease can no longer be kept: stop the work
            # rather than let it run on unfenced.
            log.exception("task %s: heartbeat failed", self.task_id)
            self.lose("abandoned")
            raise StaleClaim("tasks", self.task_id, f"lease not confirmed: {exc!r}") from exc
        self.heartbeats += 1
        self._granted(beat.expires_at)
        self._directive, self._directive_at = beat.directive, self.clock.now()
        if beat.capability_token is not None:
            await self._renewed(beat.capability_token)
        return beat

    async def _renewed(self, token: str) -> None:
        try:
            if self.on_renewed is not None:
                await self.on_renewed(token)
        except Exception as exc:
            # The lease is fine; the old token is still valid for a while, and
            # the next heartbeat is answered with a renewal again.
            log.warning("task %s: renewed capability not adopted: %r", self.task_id, exc)
            return
        self.capability_token = token

    async def directive(self) -> str:
        """The latest directive, refreshed by a heartbeat when older than
        ``directive_refresh_seconds`` (over HTTP it only comes with heartbeats)."""
        self._check()
        now = self.clock.now()
        fresh = self._directive_at is not None and (
            (now - self._directive_at).total_seconds() < self.settings.directive_refresh_seconds
        )
        if self._directive is not None and fresh:
            return self._directive
        return (await self.heartbeat()).directive

    async def emit(self, events: Sequence[DatasetEvent]) -> AcceptResult:
        """Emit events mid-task through the fenced client."""
        self._check()
        if not events:
            return AcceptResult([], 0, 0)
        try:
            return await self.client.emit(self.task_id, self.attempt, events)
        except StaleClaim:
            self.lose("stale")
            raise

    def _check(self) -> None:
        if self.lost is not None:
            raise StaleClaim("tasks", self.task_id, f"attempt {self.attempt} is {self.lost}")

    def _granted(self, expires_at: datetime) -> None:
        self._ttl_seconds = max(0.0, (expires_at - self.clock.now()).total_seconds())
