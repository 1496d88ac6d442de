"""Injected time.

Every component that reads the time takes a :class:`Clock`, so lease expiry,
backoff and reclaim are tested by advancing a :class:`ManualClock` instead of
sleeping.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import Protocol

__all__ = ["Clock", "ManualClock", "SystemClock"]


class Clock(Protocol):
    """A source of timezone-aware UTC timestamps."""

    def now(self) -> datetime:
        """Return the current time, timezone-aware, in UTC."""
        ...


class SystemClock:
    """The wall clock."""

    def now(self) -> datetime:
        """Return ``datetime.now(UTC)``."""
        return datetime.now(UTC)


class ManualClock:
    """A clock that moves only when told to; thread-safe."""

    def __init__(self, start: datetime | None = None) -> None:
        if start is not None and start.tzinfo is None:
            raise ValueError("ManualClock start must be timezone-aware")
        self._now = start or datetime(2026, 1, 1, tzinfo=UTC)
        self._lock = threading.Lock()

    def now(self) -> datetime:
        """Return the current manual time."""
        with self._lock:
            return self._now

    def advance(self, seconds: float = 0.0, **delta: float) -> datetime:
        """Move time forward by ``seconds`` (plus any ``timedelta`` keywords)."""
        step = timedelta(seconds=seconds, **delta)
        if step < timedelta(0):
            raise ValueError("ManualClock cannot go backwards")
        with self._lock:
            self._now += step
            return self._now
