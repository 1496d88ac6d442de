"""What the conformance tests share: tasks to claim, queues on a clock, and
repositories of their own for concurrent actors."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from trace_core.clock import ManualClock
from trace_core.leasing import LeaseConfig
from trace_core.retry import Backoff, RetryPolicy
from trace_core.storage.protocol import Repository
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import TaskQueue
from trace_testing.drain import create_tasks

__all__ = ["LEASE_SECONDS", "RETRY", "make_tasks", "repositories", "task_queue"]

LEASE_SECONDS = 30.0
RETRY = RetryPolicy(normal=Backoff(base_seconds=1.0, cap_seconds=1.0, jitter=0.0))
"""Retries due one second after a failure: the tests move the clock past it."""


def task_queue(repo: Repository, clock: ManualClock) -> TaskQueue:
    """A task queue on ``clock`` with :data:`LEASE_SECONDS` leases and :data:`RETRY`."""
    return TaskQueue(
        repo, clock=clock, config=LeaseConfig(lease_seconds=LEASE_SECONDS), retry=RETRY
    )


async def make_tasks(queue: TaskQueue, count: int, *, max_attempts: int = 3) -> list[uuid.UUID]:
    """Create ``count`` queued tasks of a standalone job; their ids in creation order."""
    return await create_tasks(queue.repo, count, clock=queue.clock, max_attempts=max_attempts)


@asynccontextmanager
async def repositories(url: str, count: int) -> AsyncIterator[list[SqlRepository]]:
    """``count`` repositories on ``url``, each with connections of its own (as
    separate processes would have), closed on leaving the block."""
    repos = [SqlRepository(url) for _ in range(count)]
    try:
        yield repos
    finally:
        for repo in repos:
            await repo.close()
