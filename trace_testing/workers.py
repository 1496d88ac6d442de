"""A task worker run as an OS process by :class:`~trace_testing.faults.WorkerFleet`.

Importable (``multiprocessing``'s spawn context pickles the entry point by
name). The worker claims tasks in batches, does a fake "effect" (a short
pause, now and then one longer than the lease), and records the effect in
the :class:`~trace_testing.history.EffectLedger` in the *same* transaction as
the fenced completion: if the completion is stale the transaction rolls back
and the ledger row vanishes. It also runs the reaper's and the retry
scheduler's cores (``reclaim_expired`` and ``requeue_due``) on a timer.

A ledger row refused by its unique key (a second effect under one attempt)
would mean two holders of one lease: it is counted as a protocol violation.
After the run, :func:`~trace_testing.history.check_history` reports lost,
duplicated and out-of-fence effects.

It reports through shared memory only (a ``RawArray`` of counters, see
:data:`STAT_NAMES`), so that a ``SIGKILL`` at any instant cannot corrupt a
pipe the parent reads; details of a protocol violation or a crash go to the
report file.
"""

from __future__ import annotations

import importlib
import random
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

import anyio

from trace_core.errors import DuplicateItem, StaleClaim
from trace_core.leasing import LeaseConfig
from trace_core.retry import Backoff, RetryPolicy
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import TaskQueue
from trace_testing.drain import Handler
from trace_testing.history import EffectLedger
from trace_testing.process_target import ProcessConfig, report_line, run_process

__all__ = [
    "STAT_NAMES",
    "WorkerConfig",
    "load_handler",
    "report_line",
    "run_worker",
    "work_until_stopped",
]

# Indexes into a worker's shared counters.
CLAIMED = 0
COMPLETED = 1
STALE = 2
VIOLATIONS = 3
HOLDING = 4
"""Leases claimed and not yet completed or given up (the kill target)."""
RECLAIMED = 5
DEAD_LETTERED = 6
REQUEUED = 7
LATE_ACCEPTED = 8
"""Completions accepted although the lease had already expired (late replies)."""
HEARTBEATS = 9
HEARTBEAT_STALE = 10
STARTED = 11
"""Set to 1 once the worker is connected and about to claim."""
IN_EFFECT = 12
"""1 while the worker does an effect's work (outside any transaction): the
moment to pause it without freezing a database lock with it."""
STAT_NAMES = (
    "claimed",
    "completed",
    "stale",
    "violations",
    "holding",
    "reclaimed",
    "dead_lettered",
    "requeued",
    "late_accepted",
    "heartbeats",
    "heartbeat_stale",
    "started",
    "in_effect",
)
"""The counters of one worker, in the order of its ``RawArray``."""


@dataclass(frozen=True)
class WorkerConfig(ProcessConfig):
    """What one worker process does; picklable. Its report file gets
    protocol violations and crashes."""

    seed: int
    batch: int = 8
    lease_seconds: float = 1.5
    max_effect_seconds: float = 0.004
    long_hold_probability: float = 0.004
    long_hold_seconds: float = 2.0
    """Longer than the lease: the lease expires under the worker's feet."""
    maintenance_seconds: float = 0.25
    idle_seconds: float = 0.02
    complete_together: bool = False
    """Commit a claimed batch in one transaction (every effect and fenced
    completion), each task on its own again if one of them is refused: a
    cheap worker, to drain tens of thousands of tasks in a test."""
    handler: str | None = None
    """``"module:function"`` of the code under test, an async ``(tx, lease)``
    (a :data:`~trace_testing.drain.Handler`): it runs in the completion's
    transaction, after the ledger record, so its writes share the fate of
    the fenced completion. Importable by name: the worker is a fresh
    interpreter."""


def load_handler(spec: str) -> Handler:
    """The function ``"module:function"`` names; a clear error if it does not exist."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"handler must be 'module:function', not {spec!r}")
    handler = getattr(importlib.import_module(module_name), attribute, None)
    if not callable(handler):
        raise ValueError(f"handler {spec!r}: {module_name} has no function {attribute!r}")
    return cast(Handler, handler)


def run_worker(config: WorkerConfig, stats: Any, stop: Any) -> None:
    """Process entry point (a :class:`~trace_testing.faults.WorkerFleet`
    target): work until ``stop`` is set; exit 1 on any crash."""
    run_process(work_until_stopped, config, stats, stop)


async def work_until_stopped(config: WorkerConfig, stats: Any, stop: Any) -> None:
    """:func:`run_worker`'s loop in the current event loop: claim, process, repeat
    until ``stop`` is set; a database error ends it (the caller decides what next)."""
    handler = load_handler(config.handler) if config.handler else None
    rng = random.Random(config.seed)
    repo = SqlRepository(config.url)
    queue = TaskQueue(
        repo,
        config=LeaseConfig(lease_seconds=config.lease_seconds),
        retry=RetryPolicy(normal=Backoff(base_seconds=0.01, cap_seconds=0.05)),
        rng=random.Random(config.seed + 1),
    )
    next_maintenance = 0.0
    stats[STARTED] = 1
    try:
        while not stop.is_set():
            if time.monotonic() >= next_maintenance:
                report = await queue.reclaim_expired()
                stats[RECLAIMED] += len(report.retried)
                stats[DEAD_LETTERED] += len(report.dead_lettered)
                stats[REQUEUED] += len(await queue.requeue_due())
                next_maintenance = time.monotonic() + config.maintenance_seconds
            leases = await queue.claim_batch(config.name, config.batch)
            if not leases:
                await anyio.sleep(config.idle_seconds)  # idle poll, not a wait for state
                continue
            stats[CLAIMED] += len(leases)
            stats[HOLDING] = len(leases)
            if config.complete_together and len(leases) > 1:
                await _process_together(queue, repo, config, rng, stats, leases, handler)
                stats[HOLDING] = 0
                continue
            for i, lease in enumerate(leases):
                await _process(queue, repo, config, rng, stats, lease, handler)
                stats[HOLDING] = len(leases) - i - 1
    finally:
        await repo.close()


async def _process(
    queue: TaskQueue,
    repo: SqlRepository,
    config: WorkerConfig,
    rng: random.Random,
    stats: Any,
    lease: Any,
    handler: Handler | None,
) -> None:
    fence = lease.fence
    expires_at = lease.expires_at
    # Heartbeat a lease past half its life before working under it.
    remaining = (expires_at - datetime.now(UTC)).total_seconds()
    if remaining < config.lease_seconds / 2:
        try:
            expires_at = await queue.heartbeat(fence)
            stats[HEARTBEATS] += 1
        except StaleClaim:
            stats[HEARTBEAT_STALE] += 1
            return
    await _effect_work(config, rng, stats)
    await _commit(queue, repo, config, stats, lease, handler, expires_at)


async def _effect_work(config: WorkerConfig, rng: random.Random, stats: Any) -> None:
    """The effect's work, outside any transaction (SQLite has one writer)."""
    stats[IN_EFFECT] = 1
    if rng.random() < config.long_hold_probability:
        await anyio.sleep(config.long_hold_seconds)
    else:
        await anyio.sleep(rng.uniform(0, config.max_effect_seconds))
    stats[IN_EFFECT] = 0


async def _process_together(
    queue: TaskQueue,
    repo: SqlRepository,
    config: WorkerConfig,
    rng: random.Random,
    stats: Any,
    leases: list[Any],
    handler: Handler | None,
) -> None:
    """The batch's effects, then one transaction for all (see ``complete_together``)."""
    for _ in leases:
        await _effect_work(config, rng, stats)
    try:
        async with repo.transaction() as tx:
            for lease in leases:
                await EffectLedger.record(tx, lease.fence, config.name)
                if handler is not None:
                    await handler(tx, lease)
                await queue.complete(lease.fence, tx=tx)
    except (StaleClaim, DuplicateItem):
        # The whole batch rolled back: commit each on its own, so that the
        # leases still held complete and the refused one is counted.
        for lease in leases:
            await _commit(queue, repo, config, stats, lease, handler, lease.expires_at)
        return
    stats[COMPLETED] += len(leases)
    if datetime.now(UTC) > leases[0].expires_at:
        stats[LATE_ACCEPTED] += len(leases)


async def _commit(
    queue: TaskQueue,
    repo: SqlRepository,
    config: WorkerConfig,
    stats: Any,
    lease: Any,
    handler: Handler | None,
    expires_at: datetime,
) -> None:
    """The effect and the fenced completion of ``lease``, in one transaction."""
    fence = lease.fence
    try:
        async with repo.transaction() as tx:
            # The effect first, then the fenced completion: if the completion
            # is stale, the transaction rolls back and the effect vanishes.
            await EffectLedger.record(tx, fence, config.name)
            if handler is not None:
                await handler(tx, lease)
            await queue.complete(fence, tx=tx)
    except StaleClaim:
        stats[STALE] += 1
    except DuplicateItem as exc:
        # A second effect under this very attempt: another holder of the same
        # lease committed one. Exclusivity is broken.
        stats[VIOLATIONS] += 1
        report_line(
            config,
            f"VIOLATION {config.name} task={lease.item_id} attempt={lease.attempt} "
            f"claim_version={lease.claim_version}: {exc}",
        )
    else:
        stats[COMPLETED] += 1
        if datetime.now(UTC) > expires_at:
            stats[LATE_ACCEPTED] += 1
