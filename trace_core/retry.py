"""Retry policy: exponential backoff with jitter and the retry classes of
euterpe-contract.md section 5.

Pure functions of their inputs plus an injected random source, so tests can
pin the jitter.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import Enum

from trace_core.errors import ConfigurationError

__all__ = ["Backoff", "RetryClass", "RetryDecision", "RetryPolicy"]


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with "full jitter" (AWS architecture blog).

    The delay before retry ``n`` (1-based) is uniform in
    ``[base * factor**(n-1) * (1 - jitter), base * factor**(n-1)]``, capped at
    ``cap``. ``jitter=1.0`` is full jitter; ``0`` is deterministic.
    """

    base_seconds: float = 1.0
    factor: float = 2.0
    cap_seconds: float = 300.0
    jitter: float = 1.0

    def __post_init__(self) -> None:
        if self.base_seconds <= 0:
            raise ConfigurationError("Backoff.base_seconds must be > 0")
        if self.factor < 1:
            raise ConfigurationError("Backoff.factor must be >= 1")
        if self.cap_seconds < self.base_seconds:
            raise ConfigurationError("Backoff.cap_seconds must be >= base_seconds")
        if not 0 <= self.jitter <= 1:
            raise ConfigurationError("Backoff.jitter must be within [0, 1]")

    def delay(self, retry_number: int, rng: random.Random | None = None) -> timedelta:
        """The delay before the ``retry_number``-th retry (1-based)."""
        if retry_number < 1:
            raise ConfigurationError("retry_number must be >= 1")
        exponent = min(retry_number - 1, 64)  # keeps factor**exponent finite
        ceiling = min(self.cap_seconds, self.base_seconds * self.factor**exponent)
        low = ceiling * (1 - self.jitter)
        seconds = (rng or random).uniform(low, ceiling)
        return timedelta(seconds=seconds)


class RetryClass(Enum):
    """How an error should be handled (euterpe-contract.md section 5)."""

    RETRYABLE = "retryable"
    """423 and 5xx: retry with the normal backoff."""
    THROTTLED = "throttled"
    """429: retry, with the larger backoff bucket."""
    CREDENTIAL_REFRESH = "credential_refresh"
    """401/403: refresh credentials, counted separately from attempts."""
    FATAL = "fatal"
    """Anything else: no retry; dead-letter at once."""


@dataclass(frozen=True)
class RetryDecision:
    """What to do with a failure: retry at ``retry_at``, or dead-letter."""

    retry: bool
    retry_at: datetime | None
    retry_class: RetryClass
    reason: str


@dataclass(frozen=True)
class RetryPolicy:
    """Classifies errors and schedules retries.

    ``normal`` is the bucket for 423/5xx and for unclassified retryable
    errors; ``throttled`` is the larger bucket for 429. Attempts are counted by
    the queue row (``attempt``), credential refreshes by their own counter, and
    the budget for each is separate.
    """

    normal: Backoff = field(default_factory=Backoff)
    throttled: Backoff = field(
        default_factory=lambda: Backoff(base_seconds=30.0, cap_seconds=900.0)
    )
    max_credential_refreshes: int = 3
    retryable_statuses: frozenset[int] = frozenset({423, 500, 502, 503, 504})
    throttled_statuses: frozenset[int] = frozenset({429})
    refresh_statuses: frozenset[int] = frozenset({401, 403})

    def classify(self, http_status: int | None, *, retryable: bool | None = None) -> RetryClass:
        """Classify a failure by its HTTP status, or by an explicit flag.

        ``http_status=None`` (a local exception) uses ``retryable``, defaulting
        to retryable: an unknown crash deserves another attempt while budget
        remains.
        """
        if http_status is None:
            return RetryClass.FATAL if retryable is False else RetryClass.RETRYABLE
        if http_status in self.throttled_statuses:
            return RetryClass.THROTTLED
        if http_status in self.refresh_statuses:
            return RetryClass.CREDENTIAL_REFRESH
        if http_status in self.retryable_statuses:
            return RetryClass.RETRYABLE
        return RetryClass.FATAL

    def decide(
        self,
        retry_class: RetryClass,
        *,
        attempt: int,
        max_attempts: int,
        now: datetime,
        credential_refreshes: int = 0,
        rng: random.Random | None = None,
    ) -> RetryDecision:
        """Decide whether attempt ``attempt`` (1-based) of ``max_attempts`` is retried."""
        if retry_class is RetryClass.FATAL:
            return RetryDecision(False, None, retry_class, "not retryable")
        if retry_class is RetryClass.CREDENTIAL_REFRESH:
            if credential_refreshes >= self.max_credential_refreshes:
                return RetryDecision(False, None, retry_class, "credential refreshes exhausted")
            return RetryDecision(True, now, retry_class, "refresh credentials and retry")
        if attempt >= max_attempts:
            return RetryDecision(False, None, retry_class, f"attempts exhausted ({attempt})")
        bucket = self.throttled if retry_class is RetryClass.THROTTLED else self.normal
        return RetryDecision(True, now + bucket.delay(attempt, rng), retry_class, "retry")
