"""Settings of the webhook deliverer (euterpe-contract.md §12) and its retry policy."""

from __future__ import annotations

from dataclasses import dataclass

from trace_core.errors import ConfigurationError
from trace_core.retry import Backoff, RetryPolicy

__all__ = ["MAX_BATCH", "DelivererConfig", "webhook_retry_policy"]

MAX_BATCH = 25
"""The largest claim batch §12 allows (low-CPU pods, pending profiling)."""


@dataclass(frozen=True)
class DelivererConfig:
    """How one deliverer claims and posts; the defaults are §12's."""

    batch_size: int = 10
    """Events claimed per round, 1..25."""
    concurrency: int = 5
    """Webhook posts in flight at once per deliverer."""
    poll_min_seconds: float = 0.5
    poll_max_seconds: float = 1.5
    """Idle polls are jittered uniformly within these bounds."""
    lease_seconds: float = 30.0
    """An event's lease; a deliverer killed mid-post loses it after this long."""
    heartbeat_seconds: float = 10.0
    """How often a lease is extended while its post runs (< ``lease_seconds``)."""
    timeout_seconds: float = 10.0
    """Total time allowed for one post (the HTTP poster's timeout)."""
    connect_timeout_seconds: float = 5.0

    def __post_init__(self) -> None:
        if not 1 <= self.batch_size <= MAX_BATCH:
            raise ConfigurationError(
                f"DelivererConfig.batch_size must be within 1..{MAX_BATCH}, got {self.batch_size}"
            )
        if self.concurrency < 1:
            raise ConfigurationError("DelivererConfig.concurrency must be >= 1")
        if not 0 < self.poll_min_seconds <= self.poll_max_seconds:
            raise ConfigurationError(
                "DelivererConfig.poll_min_seconds must be > 0 and <= poll_max_seconds"
            )
        if self.lease_seconds <= 0:
            raise ConfigurationError("DelivererConfig.lease_seconds must be > 0")
        if not 0 < self.heartbeat_seconds < self.lease_seconds:
            raise ConfigurationError(
                "DelivererConfig.heartbeat_seconds must be > 0 and < lease_seconds"
            )
        if self.timeout_seconds <= 0 or self.connect_timeout_seconds <= 0:
            raise ConfigurationError("DelivererConfig timeouts must be > 0")


def webhook_retry_policy(
    normal: Backoff | None = None, throttled: Backoff | None = None
) -> RetryPolicy:
    """The deliverer's classification of answers (through ``RetryPolicy.classify``):

    - 2xx: delivered (decided before classifying);
    - 408, 423 and every 5xx, and no answer at all (timeout, refused
      connection): retried with exponential backoff and full jitter;
    - 429: retried from the larger, throttled backoff bucket (30 s doubling
      to 900 s, at least half of each step);
    - 401/403 (``CREDENTIAL_REFRESH`` in the shared policy): retried like a
      5xx: the receiver refused the signature, which a secret rotation in
      progress or its clock explains, and which a later attempt may pass;
    - any other answer (3xx, 400, 404, 410, 413, 422 …): dead-lettered at
      once. The receiver answered and refused this request; the next attempt
      posts the same bytes and would get the same answer, so retrying only
      delays the dead letter an operator has to look at.

    Retries are counted on the event's own ``attempts`` against its
    ``max_attempts``; exhausted, the event is dead-lettered.
    """
    return RetryPolicy(
        normal=normal or Backoff(base_seconds=1.0, factor=2.0, cap_seconds=300.0, jitter=1.0),
        # Half jitter: a 429 waits at least half its bucket, never almost nothing.
        throttled=throttled or Backoff(base_seconds=30.0, cap_seconds=900.0, jitter=0.5),
        retryable_statuses=frozenset({408, 423, *range(500, 600)}),
    )
