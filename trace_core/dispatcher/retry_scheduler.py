"""The retry scheduler: failed attempts whose backoff has passed go back to ``Queued``.

The reaper (and workers reporting errors) leave a retryable task ``Failed``
with ``next_retry_at``; this service moves the due ones back to ``Queued``
with a fresh ``enqueue_task`` wake-up in the same transaction, so a worker
claims the next attempt of the *same* task id (which is what keeps a source's
producer run id stable across restarts).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from trace_core.clock import Clock
from trace_core.dispatcher.periodic import DispatcherService, require_positive
from trace_core.errors import ConfigurationError
from trace_core.leasing import LeaseConfig
from trace_core.storage.protocol import Repository
from trace_core.tasks import TaskQueue

__all__ = ["RetryScheduler", "RetrySchedulerConfig"]


@dataclass(frozen=True)
class RetrySchedulerConfig:
    """Retry scheduler settings."""

    interval_seconds: float = 1.0
    """Time between passes: how late past ``next_retry_at`` a retry may start."""
    batch_size: int = 1000
    """Upper bound on the tasks requeued per pass (when the scheduler builds its
    own :class:`TaskQueue`; an injected one keeps its ``max_batch``)."""

    def __post_init__(self) -> None:
        require_positive("RetrySchedulerConfig.interval_seconds", self.interval_seconds)
        if not 1 <= self.batch_size <= 10_000:
            raise ConfigurationError("RetrySchedulerConfig.batch_size must be within 1..10000")


class RetryScheduler(DispatcherService):
    """Requeues due retries; see the module docstring."""

    def __init__(
        self,
        repo: Repository,
        *,
        clock: Clock | None = None,
        config: RetrySchedulerConfig | None = None,
        tasks: TaskQueue | None = None,
    ) -> None:
        self.config = config or RetrySchedulerConfig()
        super().__init__(repo, self.config.interval_seconds, clock=clock, tasks=tasks)

    def _own_task_queue(self) -> TaskQueue:
        # Its own queue claims retries in batches of the configured size.
        return TaskQueue(
            self.repo, clock=self.clock, config=LeaseConfig(max_batch=self.config.batch_size)
        )

    async def run_once(self) -> list[uuid.UUID]:
        """Move due retries back to ``Queued`` (with wake-ups); the task ids moved."""
        return [uuid.UUID(str(i)) for i in await self.tasks.requeue_due()]
