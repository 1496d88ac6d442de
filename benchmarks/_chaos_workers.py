"""Chaos scenario ``workers-sigkill``: worker processes SIGKILLed at random
while they drain 10,000 tasks (``--scale`` multiplies the count).

Four :func:`~trace_testing.workers.run_worker` processes drain the backlog;
four times, at evenly spaced shares of it, one holding leases is SIGKILLed
and replaced at once (:func:`trace_testing.chaos_workers.kill_drain`). The
fault lasts from the first kill to the last restart; the victims' leases
come back after their TTL (1.5 s). The row adds the history checker's
findings (``lost``, ``duplicated``, ``out_of_fence``: all 0 when the
protocol holds) and the kills.

Also the shared parts of the worker scenarios: their runner (:func:`run_fresh`,
:func:`run_drain`), their size (:func:`scaled`) and the history checker's
columns of their rows (:func:`history_columns`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import anyio

from benchmarks._chaos import ChaosScenario, Timeline
from benchmarks._common import Databases, Engine
from trace_testing.chaos_workers import Progress, kill_drain
from trace_testing.history import HistoryReport

__all__ = ["SCENARIO", "FromFirstUnit", "history_columns", "run_drain", "run_fresh", "scaled"]

T = TypeVar("T")

TASKS = 10_000
KILLS = 4


class FromFirstUnit:
    """A :class:`~benchmarks._chaos.Timeline` whose "before" phase starts at
    the first unit done, not while the worker processes start (seconds of
    interpreter start-up that would read as a slow "before")."""

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self._first = True

    def done(self, units: int = 1) -> None:
        """``units`` finished now (the first call starts the timeline)."""
        if self._first:
            self._first = False
            self.timeline.start = self.timeline.clock()
        self.timeline.done(units)

    def fault_started(self) -> None:
        """The fault begins now."""
        self.timeline.fault_started()

    def fault_ended(self) -> None:
        """The fault is over now."""
        self.timeline.fault_ended()

    def finished(self) -> None:
        """The workload is over now."""
        self.timeline.finished()


def run_fresh(
    engine: Engine, label: str, scenario: Callable[[str, Path, Progress], Awaitable[T]]
) -> tuple[dict[str, Any], T]:
    """Run ``scenario(url, workdir, progress)`` on a fresh database of
    ``engine`` (a throwaway Postgres cluster of its own); the timeline's
    phases and what the scenario returned."""
    timeline = Timeline()
    with (
        Databases(engine, None) as dbs,
        tempfile.TemporaryDirectory(prefix="trace-chaos-") as workdir,
    ):
        url = dbs.fresh(label)
        result = anyio.run(scenario, url, Path(workdir), FromFirstUnit(timeline), backend="asyncio")
    return timeline.phases(), result


def run_drain(
    engine: Engine,
    label: str,
    drain: Callable[..., Awaitable[T]],
    report_name: str,
    **arguments: Any,
) -> tuple[dict[str, Any], T]:
    """:func:`run_fresh` of ``drain(url, report_path=..., progress=...,
    **arguments)`` (a scenario of :mod:`trace_testing.chaos_workers` or
    :mod:`trace_testing.relay_chaos`), its processes reporting to the file
    ``report_name`` of the work directory."""

    async def scenario(url: str, workdir: Path, progress: Progress) -> T:
        return await drain(url, report_path=workdir / report_name, progress=progress, **arguments)

    return run_fresh(engine, label, scenario)


def scaled(count: int, options: Mapping[str, Any]) -> int:
    """``count`` multiplied by the runner's ``--scale``, at least 100."""
    return max(100, round(count * float(options.get("scale", 1.0))))


def history_columns(history: HistoryReport) -> dict[str, int]:
    """The history checker's findings as columns of a row (all 0 when the
    protocol holds; ``duplicated`` counts effects beyond the first)."""
    return {
        "lost": len(history.lost),
        "duplicated": history.duplicate_effects,
        "out_of_fence": len(history.out_of_fence),
        "unexpected": len(history.unexpected),
    }


def _run(engine: Engine, options: Mapping[str, Any]) -> dict[str, Any]:
    tasks = scaled(TASKS, options)
    phases, report = run_drain(
        engine,
        "chaos_workers",
        kill_drain,
        "workers.txt",
        tasks=tasks,
        kills=KILLS,
        bound_seconds=600.0,
    )
    return {
        **phases,
        "tasks": tasks,
        **history_columns(report.history),
        "kills": len(report.killed),
        "orphaned": sum(report.orphaned),
        "retried": report.retried,
        "violations": report.stats["violations"],
        "drain_s": round(report.seconds, 2),
        "clean_exits": report.survivors_exited_cleanly() and not report.worker_reports,
    }


SCENARIO = ChaosScenario(
    name="workers-sigkill",
    summary="worker processes SIGKILLed at random during 10,000 tasks",
    engines=("sqlite", "postgres"),
    run=_run,
)
