"""Tasks for a handler under test, and concurrent workers that drain them.

:func:`drain_tasks` runs ``workers`` claimers in this process, each on a
repository (connections) of its own, as separate processes would: each
claims a batch, calls the handler under test *inside* the transaction of the
fenced completion (so a refused completion rolls the handler's writes back),
and carries on until nothing is left to claim. For processes that can be
killed, see :class:`~trace_testing.faults.WorkerFleet`.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio

from trace_core.clock import Clock
from trace_core.errors import StaleClaim
from trace_core.model import Lease
from trace_core.standalone import ensure_standalone_job
from trace_core.storage.protocol import NewTask, Repository
from trace_core.storage.sql import SqlRepository, SqlTransaction
from trace_core.tasks import TaskQueue

__all__ = ["DrainResult", "Handler", "create_tasks", "drain_tasks"]

Handler = Callable[[SqlTransaction, Lease], Awaitable[None]]
"""The code under test: does one task's work in the completion's transaction."""


async def create_tasks(
    repo: Repository,
    count: int,
    *,
    clock: Clock | None = None,
    max_attempts: int = 3,
    job_name: str | None = None,
) -> list[uuid.UUID]:
    """Create ``count`` queued tasks of a standalone job; their ids in creation order."""
    queue = TaskQueue(repo, clock=clock)
    job = await ensure_standalone_job(
        repo, job_name or f"kit-{uuid.uuid4().hex[:8]}", now=queue.clock.now()
    )
    created = await queue.create(
        [NewTask(job, dedupe_key=f"t{i}", max_attempts=max_attempts) for i in range(count)]
    )
    return [c.task_id for c in created]


@dataclass(frozen=True)
class DrainResult:
    """What the workers of :func:`drain_tasks` did."""

    completed: int
    """Completions that committed (with the handler's writes)."""
    stale: int
    """Completions refused as stale (the handler's writes rolled back)."""
    per_worker: dict[str, int]
    """Committed completions per worker name."""


async def drain_tasks(
    url: str,
    handler: Handler,
    *,
    workers: int = 4,
    batch: int = 5,
    clock: Clock | None = None,
) -> DrainResult:
    """Drain the queued tasks of database ``url`` with ``workers`` concurrent
    claimers running ``handler``; returns once nothing is left to claim."""
    if workers < 1 or batch < 1:
        raise ValueError("workers and batch must be >= 1")
    per_worker: dict[str, int] = {}
    stale = 0

    async def worker(name: str) -> None:
        nonlocal stale
        repo = SqlRepository(url)
        queue = TaskQueue(repo, clock=clock)
        per_worker[name] = 0
        try:
            while leases := await queue.claim_batch(name, batch):
                for lease in leases:
                    try:
                        async with repo.transaction() as tx:
                            await handler(tx, lease)
                            await queue.complete(lease.fence, tx=tx)
                    except StaleClaim:
                        stale += 1
                    else:
                        per_worker[name] += 1
        finally:
            await repo.close()

    async with anyio.create_task_group() as tg:
        for i in range(workers):
            tg.start_soon(worker, f"kit-worker-{i}")
    return DrainResult(sum(per_worker.values()), stale, per_worker)
