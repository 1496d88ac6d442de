"""Long-running loops through an outage: log once, back off with jitter, carry on.

Every loop of the control plane that must outlive a database restart (the
outbox relay, the Dispatcher's periodic services, the ``trace-lite worker``
claim loop) keeps one :class:`LoopHealth`. After a failed round the loop calls
:meth:`LoopHealth.backoff_after`: the first failure of a streak is logged (a warning
for an outage, an error with its traceback for anything else), the later ones
only at debug level, so a database that is down for ten minutes writes one
line, not one per retry; then it waits the delay of
:class:`~trace_core.retry.Backoff` (full jitter, so that many loops do not
come back in lockstep). The first round that succeeds again calls
:meth:`LoopHealth.succeeded`, which logs the recovery once.

The state is also what the readiness endpoint reports
(:meth:`LoopHealth.snapshot`): whether the loop runs, and whether its last
round failed and why. The wait goes through an injected ``sleep`` so that
tests drive the backoff without waiting for it.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from trace_core.errors import DatabaseUnavailable
from trace_core.retry import Backoff

__all__ = ["OUTAGE_BACKOFF", "LoopHealth", "Sleep"]

Sleep = Callable[[float], Awaitable[None]]
"""Waits for the given number of seconds (``anyio.sleep`` unless a test injects one)."""

OUTAGE_BACKOFF = Backoff(base_seconds=0.2, factor=2.0, cap_seconds=5.0, jitter=1.0)
"""The delay between failed rounds: 0.2 s growing to at most 5 s, full jitter.

Capped low on purpose: a loop should notice within seconds that the database
is back, and each retry costs one failed connection attempt."""


class LoopHealth:
    """The failure streak of one long-running loop, and its backoff between rounds.

    ``unavailable`` names the exceptions that mean "a dependency is down"
    (logged as a warning without a traceback); anything else is logged as an
    error with its traceback, once per streak as well.
    """

    def __init__(
        self,
        name: str,
        *,
        logger: logging.Logger | None = None,
        backoff: Backoff = OUTAGE_BACKOFF,
        sleep: Sleep | None = None,
        rng: random.Random | None = None,
        unavailable: tuple[type[BaseException], ...] = (DatabaseUnavailable,),
    ) -> None:
        self.name = name
        self.log = logger or logging.getLogger(__name__)
        self.backoff = backoff
        self.sleep: Sleep = sleep or anyio.sleep
        """Public so that a test can drive the backoff of a service it did not build."""
        self._rng = rng
        self._unavailable = unavailable
        self.running = False
        """True while the loop runs (set by the loop itself)."""
        self.failures = 0
        """Failed rounds since the last success (0: healthy)."""
        self.total_failures = 0
        """Failed rounds over the loop's life."""
        self.last_error: str | None = None
        """Type and message of the last failure (never cleared, for the operator)."""

    def describe(self, exc: BaseException) -> str:
        """``Type: message`` of ``exc``, its first line only."""
        text = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__

    def failed(self, exc: BaseException) -> float:
        """Record a failed round (logging the first of a streak); the seconds to wait."""
        self.failures += 1
        self.total_failures += 1
        self.last_error = self.describe(exc)
        delay = self.backoff.delay(self.failures, self._rng).total_seconds()
        if self.failures > 1:
            self.log.debug("%s: still failing (%s); retry %d", self.name, exc, self.failures)
        elif isinstance(exc, self._unavailable):
            self.log.warning(
                "%s: %s; backing off until it is back (logged once)", self.name, self.last_error
            )
        else:
            self.log.error(
                "%s failed; retrying with backoff (logged once)", self.name, exc_info=exc
            )
        return delay

    async def backoff_after(self, exc: BaseException) -> None:
        """:meth:`failed`, then wait its delay through ``sleep``."""
        await self.sleep(self.failed(exc))

    def succeeded(self) -> None:
        """Record a successful round; logs the recovery once after a streak."""
        if self.failures:
            self.log.warning("%s: recovered after %d failed round(s)", self.name, self.failures)
            self.failures = 0

    @property
    def healthy(self) -> bool:
        """Running, and its last round did not fail."""
        return self.running and self.failures == 0

    def snapshot(self) -> dict[str, Any]:
        """The state for a health endpoint (no secrets: type and first line of the error)."""
        return {
            "running": self.running,
            "healthy": self.healthy,
            "failures": self.failures,
            "total_failures": self.total_failures,
            "last_error": self.last_error,
        }
