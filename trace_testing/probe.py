"""A worker that outlives its leases on purpose: the stale holder of the
pause scenario (:func:`trace_testing.chaos_workers.pause_past_lease`).

Run as a :class:`~trace_testing.faults.WorkerFleet` target, it claims a batch
of tasks, writes their ids and attempts to its report file (``HELD`` lines),
and "works" on them while heartbeating four times per lease, as a real
worker's wrapper does: left alone, it would hold its leases for ever. Only a
SIGSTOP lets them run out. Its work ends when the parent sets its
``released`` counter (the parent does so while the probe is frozen, so from
the probe's side the work simply finished while it was away).

Then, for every lease, it tries each write a holder can make and counts
whether it was accepted or refused: a heartbeat, the effect with the fenced
completion in one transaction (the
:class:`~trace_testing.history.EffectLedger` record rolls back with a refused
completion), and a failure. ``in_write`` is 1 around every database write,
so that the parent can pause it outside one (a process frozen inside a
SQLite write transaction would freeze every other writer with it).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import anyio

from trace_core.errors import StaleClaim
from trace_core.leasing import LeaseConfig
from trace_core.model import Lease
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import TaskQueue
from trace_testing.history import EffectLedger
from trace_testing.process_target import ProcessConfig, run_process, wait_until_stopped

__all__ = ["PROBE_STATS", "ProbeConfig", "run_probe", "wait_until_stopped"]

PROBE_STATS = (
    "started",
    "holding",
    "in_effect",
    "in_write",
    "heartbeats",
    "released",
    "heartbeat_accepted",
    "heartbeat_refused",
    "complete_accepted",
    "complete_refused",
    "fail_accepted",
    "fail_refused",
    "probed",
)
"""The probe's counters; ``released`` is the one the parent writes."""

_IX = {name: i for i, name in enumerate(PROBE_STATS)}


@dataclass(frozen=True)
class ProbeConfig(ProcessConfig):
    """What the probe does; picklable. Its report file gets ``HELD <task id>
    <attempt>`` per lease claimed, and any crash."""

    seed: int = 0
    batch: int = 4
    lease_seconds: float = 2.0


def run_probe(config: ProbeConfig, stats: Any, stop: Any) -> None:
    """Process entry point (a :class:`~trace_testing.faults.WorkerFleet` target)."""
    run_process(_probe, config, stats, stop)


async def _probe(config: ProbeConfig, stats: Any, stop: Any) -> None:
    repo = SqlRepository(config.url)
    queue = TaskQueue(
        repo,
        config=LeaseConfig(lease_seconds=config.lease_seconds),
        rng=random.Random(config.seed),
    )
    stats[_IX["started"]] = 1
    try:
        leases: list[Lease] = []
        while not leases:
            if stop.is_set():
                return
            stats[_IX["in_write"]] = 1
            leases = await queue.claim_batch(config.name, config.batch)
            stats[_IX["in_write"]] = 0
            if not leases:
                await anyio.sleep(0.02)  # idle poll until tasks exist
        _write_held(config.report_path, leases)
        stats[_IX["holding"]] = len(leases)
        stats[_IX["in_effect"]] = 1
        await _work(queue, config, stats, stop, leases)
        stats[_IX["in_effect"]] = 0
        for lease in leases:
            await _try_every_write(queue, repo, config, stats, lease)
        stats[_IX["probed"]] = 1
        await anyio.to_thread.run_sync(wait_until_stopped, stop)
    finally:
        await repo.close()


def _write_held(path: str, leases: list[Lease]) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        for lease in leases:
            fh.write(f"HELD {lease.item_id} {lease.attempt}\n")


async def _work(
    queue: TaskQueue, config: ProbeConfig, stats: Any, stop: Any, leases: list[Lease]
) -> None:
    """Keep the leases alive until released (or a heartbeat is refused)."""
    # Four heartbeats per lease: a process starved of CPU for a moment on a
    # busy machine must not lose its leases before the pause does.
    period = config.lease_seconds / 4
    while not stats[_IX["released"]] and not stop.is_set():
        for lease in leases:
            stats[_IX["in_write"]] = 1
            try:
                await queue.heartbeat(lease.fence)
            except StaleClaim:
                # Frozen past the lease between the release check and this
                # heartbeat: the work is over all the same.
                stats[_IX["heartbeat_refused"]] += 1
                return
            finally:
                stats[_IX["in_write"]] = 0
            stats[_IX["heartbeats"]] += 1
        await anyio.sleep(period)  # the heartbeat period, as a worker wrapper's


async def _try_every_write(
    queue: TaskQueue, repo: SqlRepository, config: ProbeConfig, stats: Any, lease: Lease
) -> None:
    fence = lease.fence
    stats[_IX["in_write"]] = 1
    try:
        try:
            await queue.heartbeat(fence)
            stats[_IX["heartbeat_accepted"]] += 1
        except StaleClaim:
            stats[_IX["heartbeat_refused"]] += 1
        try:
            async with repo.transaction() as tx:
                await EffectLedger.record(tx, fence, config.name)
                await queue.complete(fence, tx=tx)
            stats[_IX["complete_accepted"]] += 1
        except StaleClaim:
            stats[_IX["complete_refused"]] += 1
        try:
            await queue.fail(fence, "the stale probe's failure")
            stats[_IX["fail_accepted"]] += 1
        except StaleClaim:
            stats[_IX["fail_refused"]] += 1
    finally:
        stats[_IX["in_write"]] = 0
