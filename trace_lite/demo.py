"""The demo job: the ownership protocol at work, printed as it happens.

Enqueues tasks (with their wake-up outbox rows), runs a few workers that claim
in batches, heartbeat, fail some attempts on purpose (retried with backoff)
and complete; one worker "crashes" holding a lease, which the reaper reclaims;
a stale write from the crashed worker is refused. Ends with a summary. The
in-process platform of a later issue replaces this as the main job.
"""

from __future__ import annotations

import random
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TextIO

import anyio

from trace_core.clock import ManualClock
from trace_core.errors import StaleClaim
from trace_core.leasing import LeaseConfig
from trace_core.model import Lease
from trace_core.outbox import OutboxRelay
from trace_core.retry import Backoff, RetryPolicy
from trace_core.standalone import ensure_standalone_job
from trace_core.storage.migrate import upgrade
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import TaskQueue

__all__ = ["DemoConfig", "run_demo"]

LEASE_SECONDS = 30.0


@dataclass(frozen=True)
class DemoConfig:
    """What the demo does."""

    database_url: str
    tasks: int = 1000
    workers: int = 4
    batch: int = 25
    failure_rate: float = 0.05
    seed: int = 7


async def run_demo(config: DemoConfig, out: TextIO) -> dict[str, Any]:
    """Run the demo against ``config.database_url``; print progress; return the summary."""

    def say(message: str) -> None:
        print(message, file=out, flush=True)

    revision = upgrade(config.database_url)
    say(f"database {config.database_url} at schema revision {revision}")
    repo = SqlRepository(config.database_url)
    # A manual clock lets the demo expire a lease without waiting 30 s.
    clock = ManualClock(start=datetime.now(UTC))
    rng = random.Random(config.seed)
    retry = RetryPolicy(normal=Backoff(base_seconds=1, cap_seconds=8, jitter=0.5))
    tq = TaskQueue(
        repo, clock=clock, config=LeaseConfig(lease_seconds=LEASE_SECONDS), retry=retry, rng=rng
    )
    started = time.perf_counter()
    try:
        job = await ensure_standalone_job(repo, "demo", now=clock.now(), max_attempts=3)
        run = uuid.uuid4().hex[:8]
        keys = [f"demo:{run}:{i}" for i in range(config.tasks)]
        created = await tq.create([NewTask(job, dedupe_key=k, max_attempts=3) for k in keys])
        say(f"run {run}: enqueued {sum(c.created for c in created)} tasks")
        again = await tq.create([NewTask(job, dedupe_key=k) for k in keys[:10]])
        say(
            f"re-enqueued 10 of the same dedupe keys: {sum(c.created for c in again)} created, "
            f"same task ids: {[c.task_id for c in again] == [c.task_id for c in created[:10]]}"
        )

        wakeups = 0

        async def count_wakeup(payload: Mapping[str, Any]) -> None:
            nonlocal wakeups
            wakeups += len(payload["task_ids"])

        relay = OutboxRelay(repo, {"enqueue_task": count_wakeup}, clock=clock)
        crashed = await _crash_one_worker(tq, say)
        stats = Counter[str]()
        while True:
            async with anyio.create_task_group() as tg:
                for n in range(config.workers):
                    tg.start_soon(_worker, tq, f"worker-{n}", config, rng, stats)
            while await relay.run_once():
                pass
            if not await _queue_has_work(repo, job):
                break
            clock.advance(LEASE_SECONDS + 10)  # time passes: leases expire, retries fall due
            reclaimed = await tq.reclaim_expired()
            if reclaimed.retried or reclaimed.dead_lettered:
                say(
                    f"reaper: {len(reclaimed.retried)} expired lease(s) failed for retry, "
                    f"{len(reclaimed.dead_lettered)} dead-lettered"
                )
            requeued = await tq.requeue_due()
            if requeued:
                say(f"retry scheduler: {len(requeued)} task(s) back to Queued")
        try:
            await tq.complete(crashed.fence)
            say("late reply from the crashed worker: accepted (no newer attempt had started)")
        except StaleClaim:
            stats["stale_refused"] += 1
            say("late write from the crashed worker: refused as stale (a newer attempt owns it)")
        summary = await _summary(repo, run)
        summary |= {
            "claimed": stats["claimed"],
            "failed_on_purpose": stats["failed"],
            "stale_writes_refused": stats["stale_refused"],
            "wakeups_delivered": wakeups,
            "seconds": round(time.perf_counter() - started, 2),
        }
        say("")
        say("summary")
        for key, value in summary.items():
            say(f"  {key:<24} {value}")
        return summary
    finally:
        await repo.close()


async def _crash_one_worker(tq: TaskQueue, say: Any) -> Lease:
    [lease] = await tq.claim_batch("crashing-worker", 1)
    say(f"crashing-worker claimed task {lease.item_id} (attempt {lease.attempt}) and died")
    return lease


async def _worker(
    tq: TaskQueue, name: str, config: DemoConfig, rng: random.Random, stats: Counter[str]
) -> None:
    while leases := await tq.claim_batch(name, config.batch):
        stats["claimed"] += len(leases)
        ok = []
        for lease in leases:
            await tq.heartbeat(lease.fence)
            if rng.random() < config.failure_rate:
                stats["failed"] += 1
                await tq.fail(lease.fence, "simulated operator error")
            else:
                ok.append(lease.fence)
        await tq.complete_many(ok)


async def _queue_has_work(repo: SqlRepository, job_id: uuid.UUID) -> bool:
    async with repo.read() as tx:
        return bool(await tx.tasks.unfinished_of_jobs([job_id]))


async def _summary(repo: SqlRepository, run: str) -> dict[str, Any]:
    async with repo.read() as tx:
        rows = await tx.status.task_counts_by_dedupe_prefix(f"demo:{run}:")
    by_status = Counter[str]()
    by_attempt = Counter[int]()
    for status, attempt, count in rows:
        by_status[status] += count
        by_attempt[attempt] += count
    return {
        "tasks_by_status": dict(sorted(by_status.items())),
        "tasks_by_attempt": dict(sorted(by_attempt.items())),
    }
