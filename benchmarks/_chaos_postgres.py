"""Chaos scenarios on Postgres: a crash-restart during a drain, and an idle
snapshot during a sustained drain.

Postgres only: neither fault exists on SQLite. Each run starts a cluster of
its own with PostgreSQL's durable defaults (``synchronous_commit`` and
``fsync`` on, :class:`~trace_lite.pgcluster.PostgresCluster`): a crash must
not lose an acknowledged commit, or ``lost`` would measure the settings, not
Trace.

``pg-crash-restart``
    Consumers (in this process, each on connections of its own) drain tasks,
    recording each effect in the history ledger
    (:class:`~trace_testing.history.EffectLedger`) in the transaction of the
    fenced completion. At a third of the drain the server is crash-restarted
    (``pg_ctl stop -m immediate``, then a start: crash recovery). Consumers
    back off through the outage (:class:`~trace_core.outage.LoopHealth`) and
    carry on; leases the crash cut expire and are reclaimed. The row: the
    frame's phases, ``recover_s``, and the history check (``lost``,
    ``duplicate_effects``, ``out_of_fence``).

``pg-idle-snapshot``
    A sustained drain (a producer keeps a backlog queued while consumers
    claim and complete in batches) with a ``REPEATABLE READ`` transaction
    left idle after its first read for the middle phase
    (:func:`~trace_testing.faults.hold_snapshot`): vacuum cannot remove row
    versions that died since, so the claim's index scan walks over them.
    The same run without the hold is the control. The row: the held run's
    phases; claim latency p50/p95 per phase for both runs; both runs'
    throughput per phase; and the ratios held/control of throughput and of
    claim latency p50 in a window starting 15 s after the hold ended (the
    issue's target: both within 20 % of the control, i.e. throughput ratio
    >= 0.8 and latency ratio <= 1.2), and the same window against the held
    run's own phase before (less exposed to a busy machine's drift).

``--scale`` multiplies the task count (crash) and every phase's length
(snapshot: 20 s before, 60 s held, 30 s after at scale 1).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import anyio.to_thread

from benchmarks._chaos import ChaosScenario, Timeline
from benchmarks._common import Engine, count_tasks, percentile
from trace_core.errors import DatabaseUnavailable, StaleClaim
from trace_core.leasing import LeaseConfig
from trace_core.model import Lease
from trace_core.outage import LoopHealth
from trace_core.standalone import ensure_standalone_job
from trace_core.storage.migrate import upgrade
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import TaskQueue
from trace_lite.pgcluster import PostgresCluster
from trace_testing.faults import hold_snapshot
from trace_testing.history import EffectLedger

__all__ = ["CRASH_RESTART", "IDLE_SNAPSHOT", "SCENARIOS"]

_CONSUMERS = 4
_BATCH = 8
_LEASE_S = 2.0
"""Short, so leases the crash cut come back soon (reclaimed once expired)."""
_MAINTENANCE_S = 0.25
_IDLE_S = 0.02
_CRASH_TASKS = 6000
_BACKLOG = 2000
"""Tasks the snapshot scenario's producer keeps queued."""
_PRODUCE = 500
_PHASES_S = (20.0, 60.0, 30.0)
"""Before, during and after the held snapshot, at scale 1."""
_AFTER_OFFSET_S = 15.0
_AFTER_WINDOW_S = 5.0


def _cluster_database(cluster: PostgresCluster, label: str) -> str:
    name = f"chaos_{label}_{uuid.uuid4().hex[:6]}"
    cluster.create_database(name)
    url = cluster.url(name)
    upgrade(url)
    return url


async def _create(repo: SqlRepository, count: int, *, first: int = 0) -> list[uuid.UUID]:
    # No wake-up rows: these consumers poll, and no Dispatcher relays them.
    queue = TaskQueue(repo, wakeup_outbox=False)
    job = await ensure_standalone_job(repo, "chaos", now=queue.clock.now())
    created = await queue.create(
        [NewTask(job, dedupe_key=f"t{i}", max_attempts=20) for i in range(first, first + count)]
    )
    return [c.task_id for c in created]


# --- crash-restart -------------------------------------------------------------


async def _crash_drain(url: str, cluster: PostgresCluster, total: int) -> Timeline:
    """Drain ``total`` tasks with a crash-restart at a third; the timeline."""
    timeline = Timeline()
    check = _DoneCheck(url)
    third = anyio.Event()

    async def consumer(name: str) -> None:
        repo = SqlRepository(url)
        queue = TaskQueue(repo, config=LeaseConfig(lease_seconds=_LEASE_S))
        health = LoopHealth(f"consumer {name}")
        next_maintenance = 0.0
        try:
            while not check.done.is_set():
                try:
                    if time.monotonic() >= next_maintenance:
                        await queue.reclaim_expired()
                        await queue.requeue_due()
                        next_maintenance = time.monotonic() + _MAINTENANCE_S
                    leases = await queue.claim_batch(name, _BATCH)
                    if not leases:
                        await check.idle()
                        continue
                    for lease in leases:
                        if await _complete_with_effect(repo, queue, lease):
                            timeline.done()
                    if len(timeline.completions) >= total // 3:
                        third.set()
                    health.succeeded()
                except DatabaseUnavailable as exc:
                    await health.backoff_after(exc)
        finally:
            await repo.close()

    async def crash() -> None:
        await third.wait()
        timeline.fault_started()
        await anyio.to_thread.run_sync(cluster.crash_restart)
        timeline.fault_ended()

    async with anyio.create_task_group() as tg:
        tg.start_soon(crash)
        for i in range(_CONSUMERS):
            tg.start_soon(consumer, f"c{i}")
    timeline.finished()
    return timeline


async def _complete_with_effect(repo: SqlRepository, queue: TaskQueue, lease: Lease) -> bool:
    """The effect and the fenced completion in one transaction; False if stale."""
    try:
        async with repo.transaction() as tx:
            await EffectLedger.record(tx, lease.fence, lease.worker_id)
            await queue.complete(lease.fence, tx=tx)
    except StaleClaim:
        return False
    return True


class _DoneCheck:
    """Whether every task completed, read from the database at most every
    :data:`_MAINTENANCE_S` (a count per idle poll of every consumer would
    load the server it measures)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.done = anyio.Event()
        self._next = 0.0

    async def idle(self) -> None:
        """An empty claim: check (now and then), else wait a poll interval
        (the rest are leased, or their leases wait to be reclaimed)."""
        if time.monotonic() >= self._next:
            self._next = time.monotonic() + _MAINTENANCE_S
            counts = await anyio.to_thread.run_sync(count_tasks, self.url)
            if set(counts) <= {"Completed"}:
                self.done.set()
                return
        await anyio.sleep(_IDLE_S)


def _run_crash(engine: Engine, options: Mapping[str, Any]) -> dict[str, Any]:
    total = max(200, round(_CRASH_TASKS * float(options["scale"])))
    with PostgresCluster() as cluster:
        url = _cluster_database(cluster, "crash")

        async def prepare() -> list[uuid.UUID]:
            repo = SqlRepository(url)
            try:
                await EffectLedger(repo).create()
                return await _create(repo, total)
            finally:
                await repo.close()

        tasks = anyio.run(prepare)
        timeline = anyio.run(_crash_drain, url, cluster, total)

        async def check() -> dict[str, int]:
            repo = SqlRepository(url)
            try:
                return (await EffectLedger(repo).check_tasks(tasks)).summary()
            finally:
                await repo.close()

        report = anyio.run(check)
    return {
        **timeline.phases(),
        "tasks": total,
        "lost": report["lost"],
        "duplicate_effects": report["duplicate_effects"],
        "out_of_fence": report["out_of_fence"],
        "unexpected": report["unexpected"],
    }


CRASH_RESTART = ChaosScenario(
    name="pg-crash-restart",
    summary="Postgres crash-restarted (immediate stop, recovery) a third into a drain",
    engines=("postgres",),
    run=_run_crash,
)


# --- idle snapshot -------------------------------------------------------------


@dataclass
class _Drain:
    """One sustained drain's measurements."""

    timeline: Timeline
    claims: list[tuple[float, float]] = field(default_factory=list)
    """(when the claim returned, its latency in seconds), for non-empty claims."""
    produced: int = 0
    held_xmin: int | None = None


async def _sustained_drain(url: str, phases: Sequence[float], *, hold: bool) -> _Drain:
    """Drain for ``sum(phases)`` seconds while a producer keeps a backlog;
    with ``hold``, a snapshot is held open for the middle phase."""
    drain = _Drain(Timeline())
    timeline = drain.timeline
    stop = anyio.Event()
    repo = SqlRepository(url)
    try:
        drain.produced = len(await _create(repo, _BACKLOG))

        async def producer() -> None:
            while not stop.is_set():
                if drain.produced - len(timeline.completions) < _BACKLOG:
                    await _create(repo, _PRODUCE, first=drain.produced)
                    drain.produced += _PRODUCE
                else:
                    await anyio.sleep(0.01)  # polls the backlog's depth

        async def consumer(name: str) -> None:
            own = SqlRepository(url)
            queue = TaskQueue(own, config=LeaseConfig(lease_seconds=30))
            try:
                while not stop.is_set():
                    started = time.monotonic()
                    leases = await queue.claim_batch(name, _BATCH)
                    if not leases:
                        await anyio.sleep(_IDLE_S)
                        continue
                    drain.claims.append((time.monotonic(), time.monotonic() - started))
                    await queue.complete_many([lease.fence for lease in leases])
                    timeline.done(len(leases))
            finally:
                await own.close()

        async def fault() -> None:
            before, during, after = phases
            await anyio.sleep(before)  # the phase's length, not a wait for state
            with contextlib.ExitStack() as stack:
                timeline.fault_started()
                if hold:
                    held = await anyio.to_thread.run_sync(stack.enter_context, hold_snapshot(url))
                    drain.held_xmin = await _backend_xmin(repo, held.backend_pid)
                await anyio.sleep(during)
                await anyio.to_thread.run_sync(stack.close)
                timeline.fault_ended()
            await anyio.sleep(after)
            timeline.finished()
            stop.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(fault)
            tg.start_soon(producer)
            for i in range(_CONSUMERS):
                tg.start_soon(consumer, f"c{i}")
    finally:
        await repo.close()
    return drain


async def _backend_xmin(repo: SqlRepository, pid: int | None) -> int | None:
    import sqlalchemy as sa

    async with repo.read() as tx:
        row = (
            await tx.connection.execute(
                sa.text("SELECT backend_xmin::text::bigint FROM pg_stat_activity WHERE pid = :pid"),
                {"pid": pid},
            )
        ).one_or_none()
    return None if row is None or row[0] is None else int(row[0])


def _claims_ms(drain: _Drain, lo: float, hi: float) -> dict[str, float | None]:
    latencies = [lat for at, lat in drain.claims if lo <= at < hi]
    if not latencies:
        return {"p50": None, "p95": None}
    return {
        "p50": round(percentile(latencies, 50) * 1000, 2),
        "p95": round(percentile(latencies, 95) * 1000, 2),
    }


def _phase_bounds(timeline: Timeline) -> dict[str, tuple[float, float]]:
    assert timeline.fault_start is not None and timeline.fault_end is not None
    assert timeline.end is not None
    return {
        "before": (timeline.start, timeline.fault_start),
        "during": (timeline.fault_start, timeline.fault_end),
        "after": (timeline.fault_end, timeline.end),
    }


def _window(drain: _Drain, offset: float, width: float) -> tuple[float, float | None]:
    """Throughput and claim p50 (ms) in ``[end of fault + offset, + width)``."""
    timeline = drain.timeline
    assert timeline.fault_end is not None
    lo = timeline.fault_end + offset
    hi = lo + width
    count = sum(1 for at in timeline.completions if lo <= at < hi)
    return count / width, _claims_ms(drain, lo, hi)["p50"]


def _ratio(held: float | None, control: float | None) -> float | None:
    return None if not held or not control else round(held / control, 3)


def _run_snapshot(engine: Engine, options: Mapping[str, Any]) -> dict[str, Any]:
    scale = float(options["scale"])
    phases = [max(1.0, s * scale) for s in _PHASES_S]
    offset = _AFTER_OFFSET_S * min(1.0, scale)
    width = max(0.5, _AFTER_WINDOW_S * min(1.0, scale))
    phases[2] = max(phases[2], offset + width)
    drains: dict[str, _Drain] = {}
    lost = 0
    with PostgresCluster() as cluster:
        for label, hold in (("control", False), ("held", True)):
            url = _cluster_database(cluster, label)
            drains[label] = anyio.run(partial(_sustained_drain, url, phases, hold=hold))
            counts = count_tasks(url)
            # Units of work the run created and did not complete (none
            # should be left leased: every claim was completed).
            lost += sum(n for status, n in counts.items() if status not in ("Completed", "Queued"))
    held, control = drains["held"], drains["control"]
    row: dict[str, Any] = {**held.timeline.phases(), "lost": lost}
    control_phases = control.timeline.phases()
    for phase in ("before", "during", "after"):
        row[f"control_{phase}_per_s"] = control_phases[f"{phase}_per_s"]
    for label, drain in drains.items():
        for phase, (lo, hi) in _phase_bounds(drain.timeline).items():
            claims = _claims_ms(drain, lo, hi)
            row[f"{label}_claim_{phase}_p50_ms"] = claims["p50"]
            row[f"{label}_claim_{phase}_p95_ms"] = claims["p95"]
    held_rate, held_p50 = _window(held, offset, width)
    control_rate, control_p50 = _window(control, offset, width)
    row.update(
        {
            "held_xmin": held.held_xmin,
            "after_offset_s": round(offset, 3),
            "throughput_ratio_after": _ratio(held_rate, control_rate),
            "claim_p50_ratio_after": _ratio(held_p50, control_p50),
            # The same window against the held run's own phase before: on a
            # busy machine the control run drifts more than the run itself.
            "throughput_after_vs_before": _ratio(held_rate, row["before_per_s"]),
            "claim_p50_after_vs_before": _ratio(held_p50, row["held_claim_before_p50_ms"]),
        }
    )
    return row


IDLE_SNAPSHOT = ChaosScenario(
    name="pg-idle-snapshot",
    summary="a REPEATABLE READ transaction idle after its first read during a sustained drain",
    engines=("postgres",),
    run=_run_snapshot,
)

SCENARIOS = (CRASH_RESTART, IDLE_SNAPSHOT)
"""This module's scenarios, for :mod:`benchmarks.chaos`."""
