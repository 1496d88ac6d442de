"""Chaos scenarios with worker processes, for Trace's own suite and yours.

- :func:`kill_drain`: workers (:func:`~trace_testing.workers.run_worker`)
  drain a backlog of tasks while some are SIGKILLed at random, each replaced
  by a successor; the report says whether every task completed exactly once
  (:class:`~trace_testing.history.HistoryReport`: lost, duplicated and
  out-of-fence effects).
- :func:`pause_past_lease`: a worker holding leases (the
  :mod:`~trace_testing.probe`) is SIGSTOPped until other workers have
  reclaimed and finished its tasks, then SIGCONTed: the report counts each of
  its later writes, accepted or refused.

Both take a :class:`Progress` (``benchmarks._chaos.Timeline`` is one) told of
completions and of the fault's start and end, and wait only on conditions
(the database's state, the workers' shared counters), each with a deadline.
Give them a fresh database: they count every task in it.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import anyio

from trace_core.storage.sql import SqlRepository
from trace_core.tasks import TaskQueue
from trace_testing import workers
from trace_testing.drain import create_tasks
from trace_testing.faults import WorkerFleet, process_state
from trace_testing.history import EffectLedger, HistoryReport
from trace_testing.probe import PROBE_STATS, ProbeConfig, run_probe

__all__ = [
    "KillDrainReport",
    "PauseReport",
    "Progress",
    "kill_drain",
    "pause_outside_writes",
    "pause_past_lease",
    "read_reports",
    "survivors_exited_cleanly",
    "wait_for",
]

_TASK_PREFIX = "t"
"""The dedupe keys of :func:`~trace_testing.drain.create_tasks` (``t0``, ``t1`` …)."""


class Progress(Protocol):
    """What a scenario tells its observer (``benchmarks._chaos.Timeline`` is one)."""

    def done(self, units: int = 1) -> None:
        """``units`` of work finished now."""

    def fault_started(self) -> None:
        """The fault begins now."""

    def fault_ended(self) -> None:
        """The fault is over now."""

    def finished(self) -> None:
        """The workload is over now."""


class _Unobserved:
    def done(self, units: int = 1) -> None:
        pass

    def fault_started(self) -> None:
        pass

    def fault_ended(self) -> None:
        pass

    def finished(self) -> None:
        pass


async def wait_for(
    what: str,
    condition: Callable[[], bool | Awaitable[bool]],
    deadline: float,
    *,
    describe: Callable[[], str | Awaitable[str]] = lambda: "",
    interval: float = 0.02,
) -> None:
    """Poll ``condition`` (sync or async) every ``interval`` seconds until it
    holds; :class:`TimeoutError` naming ``what`` and ``describe()`` (sync or
    async) once ``time.monotonic()`` passes ``deadline``."""
    while True:
        result = condition()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            detail = describe()
            if not isinstance(detail, str):
                detail = await detail
            raise TimeoutError(f"timed out waiting for {what}: {detail}")
        await anyio.sleep(interval)


class _Completions:
    """Reports the fleets' ``completed`` counters to a :class:`Progress` as they grow."""

    def __init__(self, progress: Progress, *fleets: WorkerFleet) -> None:
        self.progress = progress
        self.fleets = fleets
        self.seen = 0

    def tick(self) -> int:
        total = sum(
            fleet.total("completed") for fleet in self.fleets if "completed" in fleet.stat_names
        )
        if total > self.seen:
            self.progress.done(total - self.seen)
            self.seen = total
        return total


@asynccontextmanager
async def _fresh_backlog(
    url: str, tasks: int
) -> AsyncIterator[tuple[SqlRepository, EffectLedger, list[uuid.UUID]]]:
    """A repository of database ``url`` (closed on exit), its effect ledger,
    created, and the ids of ``tasks`` new tasks."""
    repo = SqlRepository(url)
    try:
        ledger = EffectLedger(repo)
        await ledger.create()
        yield repo, ledger, await create_tasks(repo, tasks, max_attempts=10)
    finally:
        await repo.close()


def _drain_options(
    worker_options: Mapping[str, Any] | None, batch: int, lease_seconds: float
) -> dict[str, Any]:
    """``worker_options`` with the scenario's ``batch`` and ``lease_seconds`` as defaults."""
    options = dict(worker_options or {})
    options.setdefault("batch", batch)
    options.setdefault("lease_seconds", lease_seconds)
    return options


def _start_workers(
    fleet: WorkerFleet,
    url: str,
    count: int,
    report_path: Path,
    seed: int,
    options: Mapping[str, Any],
) -> None:
    """Start workers ``w0`` … ``w<count-1>``, each with a seed of its own."""
    for i in range(count):
        fleet.start(_worker_config(url, f"w{i}", report_path, seed * 100 + i, options))


async def _wait_all_completed(
    repo: SqlRepository,
    tasks: int,
    completions: _Completions,
    deadline: float,
    describe: Callable[[], str],
) -> None:
    """Wait until ``tasks`` tasks are completed, reporting completions meanwhile."""

    async def all_completed() -> bool:
        completions.tick()
        return (await _task_counts(repo))[0] >= tasks

    await wait_for(
        "every task to be completed", all_completed, deadline, describe=describe, interval=0.1
    )


async def _task_counts(repo: SqlRepository) -> tuple[int, int]:
    """Completed tasks, and tasks on an attempt after their first."""
    async with repo.read() as tx:
        rows = await tx.status.task_counts_by_dedupe_prefix(_TASK_PREFIX)
    completed = sum(n for status, _, n in rows if status == "Completed")
    retried = sum(n for _, attempt, n in rows if attempt > 1)
    return completed, retried


def _worker_config(
    url: str, name: str, report_path: Path, seed: int, options: Mapping[str, Any]
) -> workers.WorkerConfig:
    # Cheap by default: no effect pause, no lease overrun of its own, a
    # batch committed at once; the faults are the scenario's.
    base: dict[str, Any] = {
        "max_effect_seconds": 0.0,
        "long_hold_probability": 0.0,
        "complete_together": True,
    }
    return workers.WorkerConfig(
        url=url, name=name, report_path=str(report_path), seed=seed, **{**base, **options}
    )


def read_reports(path: Path) -> str:
    """The text the worker processes appended to ``path`` (empty if none)."""
    return path.read_text(encoding="utf-8") if path.exists() else ""


def survivors_exited_cleanly(exit_codes: Mapping[str, int | None], killed: Iterable[str]) -> bool:
    """Every process of ``exit_codes`` not in ``killed`` (SIGKILLed) stopped with exit code 0."""
    victims = set(killed)
    return all(code == 0 for name, code in exit_codes.items() if name not in victims)


@dataclass(frozen=True)
class KillDrainReport:
    """What :func:`kill_drain` saw."""

    tasks: int
    killed: tuple[str, ...]
    """The workers SIGKILLed, in order."""
    orphaned: tuple[int, ...]
    """Leases each victim held, claimed and not completed, when it died."""
    seconds: float
    """From the first worker's start to the last task's completion."""
    retried: int
    """Tasks completed by an attempt after their first (orphans reclaimed)."""
    history: HistoryReport
    stats: dict[str, int]
    """The workers' counters, summed (:data:`~trace_testing.workers.STAT_NAMES`)."""
    exit_codes: dict[str, int | None]
    worker_reports: str
    """Protocol violations and crashes the workers wrote (empty when none)."""

    def survivors_exited_cleanly(self) -> bool:
        """Every worker not SIGKILLed stopped with exit code 0."""
        return survivors_exited_cleanly(self.exit_codes, self.killed)


async def kill_drain(
    url: str,
    *,
    tasks: int,
    report_path: Path,
    workers_running: int = 4,
    kills: int = 4,
    seed: int = 7,
    lease_seconds: float = 1.5,
    batch: int = 16,
    bound_seconds: float = 120.0,
    progress: Progress | None = None,
    worker_options: Mapping[str, Any] | None = None,
) -> KillDrainReport:
    """Drain ``tasks`` new tasks of database ``url`` with ``workers_running``
    worker processes, SIGKILLing ``kills`` of them (a random one holding
    leases, at evenly spaced shares of the drain), each replaced at once.

    ``worker_options`` are fields of :class:`~trace_testing.workers.WorkerConfig`
    (e.g. ``handler``); workers do no work of their own by default.
    :class:`TimeoutError` if the drain takes more than ``bound_seconds``."""
    if tasks < 1 or workers_running < 1 or kills < 0:
        raise ValueError("tasks and workers_running must be >= 1, kills >= 0")
    observer: Progress = progress or _Unobserved()
    options = _drain_options(worker_options, batch, lease_seconds)
    rng = random.Random(seed)
    async with _fresh_backlog(url, tasks) as (repo, ledger, ids):
        fleet = WorkerFleet(workers.run_worker, workers.STAT_NAMES, rng=random.Random(seed))
        completions = _Completions(observer, fleet)
        orphaned: list[int] = []
        started = time.monotonic()
        deadline = started + bound_seconds

        def describe() -> str:
            return f"completed={completions.tick()}, killed={fleet.killed}, {fleet.totals()}"

        try:
            _start_workers(fleet, url, workers_running, report_path, seed, options)
            for k in range(kills):
                mark = tasks * (k + 1) // (kills + 2)

                def ready(mark: int = mark) -> bool:
                    return completions.tick() >= mark and any(
                        fleet.stat(name, "holding") > 0 for name in fleet.alive()
                    )

                await wait_for(
                    f"kill {k + 1} at {mark} completions", ready, deadline, describe=describe
                )
                holders = sorted(n for n in fleet.alive() if fleet.stat(n, "holding") > 0)
                victim = rng.choice(holders) if holders else rng.choice(sorted(fleet.alive()))
                if k == 0:
                    observer.fault_started()
                fleet.kill(victim)
                orphaned.append(fleet.stat(victim, "holding"))  # frozen by the kill
                fleet.restart(victim, seed=rng.randrange(1 << 30))
            observer.fault_ended()
            await _wait_all_completed(repo, tasks, completions, deadline, describe)
            seconds = time.monotonic() - started
            observer.finished()
        finally:
            codes = fleet.shutdown()
        completions.tick()
        return KillDrainReport(
            tasks=tasks,
            killed=tuple(fleet.killed),
            orphaned=tuple(orphaned),
            seconds=seconds,
            retried=(await _task_counts(repo))[1],
            history=await ledger.check_tasks(ids),
            stats=fleet.totals(),
            exit_codes=codes,
            worker_reports=read_reports(report_path),
        )


async def pause_outside_writes(
    fleet: WorkerFleet, name: str, deadline: float, *, in_write: str = "in_write"
) -> None:
    """SIGSTOP worker ``name`` at a moment its ``in_write`` counter is 0.

    A process frozen inside a write transaction would freeze its locks with
    it (on SQLite, every other writer): the worker is stopped, its counter
    read while it cannot change, and resumed to finish the write when it was
    inside one, until a stop lands outside."""
    pid = fleet.pid(name)
    while True:
        fleet.pause(name)
        await wait_for(f"{name} to be stopped", lambda: process_state(pid) in ("T", "t"), deadline)
        if not fleet.stat(name, in_write):
            return
        fleet.resume(name)
        await wait_for(
            f"{name} to finish its write", lambda: not fleet.stat(name, in_write), deadline
        )


@dataclass(frozen=True)
class PauseReport:
    """What :func:`pause_past_lease` saw."""

    tasks: int
    held: dict[str, int]
    """Task id -> the attempt the paused worker held."""
    finished_by: dict[str, int]
    """Task id -> the attempt that completed it."""
    paused_seconds: float
    probe: dict[str, int]
    """The paused worker's counters (:data:`~trace_testing.probe.PROBE_STATS`)."""
    stale_effects: int
    """Effects in the ledger recorded by the paused worker (refused writes leave none)."""
    history: HistoryReport
    stats: dict[str, int]
    """The other workers' counters, summed."""
    exit_codes: dict[str, int | None]
    worker_reports: str


PROBE_NAME = "paused"
"""The probe's worker name (its effects, if any, carry it as their holder)."""


async def pause_past_lease(
    url: str,
    *,
    tasks: int,
    report_path: Path,
    workers_running: int = 2,
    held: int = 4,
    seed: int = 11,
    lease_seconds: float = 2.0,
    batch: int = 16,
    bound_seconds: float = 60.0,
    progress: Progress | None = None,
    worker_options: Mapping[str, Any] | None = None,
) -> PauseReport:
    """Drain ``tasks`` new tasks with ``workers_running`` worker processes
    while a probe (:mod:`trace_testing.probe`) claims ``held`` of them and
    heartbeats them; once a third are done the probe is SIGSTOPped outside a
    write, stays frozen until each of its tasks was completed by a later
    attempt, and is SIGCONTed to try every write under its stale leases."""
    if tasks < held or held < 1 or workers_running < 1:
        raise ValueError("need 1 <= held <= tasks and workers_running >= 1")
    observer: Progress = progress or _Unobserved()
    options = _drain_options(worker_options, batch, lease_seconds)
    async with _fresh_backlog(url, tasks) as (repo, ledger, ids):
        queue = TaskQueue(repo)
        probes = WorkerFleet(run_probe, PROBE_STATS)
        fleet = WorkerFleet(workers.run_worker, workers.STAT_NAMES)
        completions = _Completions(observer, fleet)
        deadline = time.monotonic() + bound_seconds
        held_attempts: dict[str, int] = {}
        finished_by: dict[str, int] = {}

        def describe() -> str:
            probe = {k: probes.stat(PROBE_NAME, k) for k in PROBE_STATS}
            return f"completed={completions.tick()}, probe={probe}, workers={fleet.totals()}"

        try:
            probes.start(
                ProbeConfig(
                    url, PROBE_NAME, str(report_path), seed, batch=held, lease_seconds=lease_seconds
                )
            )
            await wait_for(
                "the probe to hold its leases",
                lambda: probes.stat(PROBE_NAME, "in_effect") == 1,
                deadline,
                describe=describe,
            )
            for line in read_reports(report_path).splitlines():
                if line.startswith("HELD "):
                    _, task_id, attempt = line.split()
                    held_attempts[task_id] = int(attempt)
            _start_workers(fleet, url, workers_running, report_path, seed, options)
            await wait_for(
                "a third of the tasks to be done before the pause",
                lambda: completions.tick() >= tasks // 3,
                deadline,
                describe=describe,
            )
            await pause_outside_writes(probes, PROBE_NAME, deadline)
            if probes.stat(PROBE_NAME, "in_effect") != 1:
                probes.resume(PROBE_NAME)
                raise RuntimeError(
                    "the probe lost its leases before the pause: a heartbeat came later "
                    f"than the lease ({lease_seconds} s; a starved machine?): {describe()}"
                )
            observer.fault_started()
            paused_at = time.monotonic()

            async def redone() -> bool:
                completions.tick()
                for task_id, attempt in held_attempts.items():
                    if task_id in finished_by:
                        continue
                    state = await queue.leases.inspect(uuid.UUID(task_id))
                    if state.status == "Completed" and state.attempt > attempt:
                        finished_by[task_id] = state.attempt
                return len(finished_by) == len(held_attempts)

            await wait_for(
                "the paused worker's tasks to be completed by others",
                redone,
                deadline,
                describe=describe,
                interval=0.05,
            )
            # Its work "finished" while it was frozen; it thaws to write.
            probes.stats[PROBE_NAME][PROBE_STATS.index("released")] = 1
            probes.resume(PROBE_NAME)
            paused_seconds = time.monotonic() - paused_at
            observer.fault_ended()
            await wait_for(
                "the resumed worker to try its writes",
                lambda: probes.stat(PROBE_NAME, "probed") == 1,
                deadline,
                describe=describe,
            )
            await _wait_all_completed(repo, tasks, completions, deadline, describe)
            observer.finished()
        finally:
            codes = {**fleet.shutdown(), **probes.shutdown()}
        completions.tick()
        effects = await ledger.effects()
        return PauseReport(
            tasks=tasks,
            held=held_attempts,
            finished_by=finished_by,
            paused_seconds=paused_seconds,
            probe={k: probes.stat(PROBE_NAME, k) for k in PROBE_STATS},
            stale_effects=sum(1 for e in effects if e.holder == PROBE_NAME),
            history=await ledger.check_tasks(ids),
            stats=fleet.totals(),
            exit_codes=codes,
            worker_reports=read_reports(report_path),
        )
