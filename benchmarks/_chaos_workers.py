"""Chaos scenario ``workers-sigkill``: worker processes SIGKILLed at random
while they drain 10,000 tasks (``--scale`` multiplies the count).

Four :func:`~trace_testing.workers.run_worker` processes drain the backlog;
four times, at evenly spaced shares of it, one holding leases is SIGKILLed
and replaced at once (:func:`trace_testing.chaos_workers.kill_drain`). The
fault lasts from the first kill to the last restart; the victims' leases
come back after their TTL (1.5 s). The row adds the history checker's
findings (``lost``, ``duplicated``, ``out_of_fence``: all 0 when the
protocol holds) and the kills.

Also the shared runner of the worker scenarios (:func:`run_fresh`).
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

__all__ = ["SCENARIO", "FromFirstUnit", "run_fresh"]

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


def _run(engine: Engine, options: Mapping[str, Any]) -> dict[str, Any]:
    tasks = max(100, round(TASKS * float(options.get("scale", 1.0))))

    async def scenario(url: str, workdir: Path, progress: Progress) -> Any:
        return await kill_drain(
            url,
            tasks=tasks,
            kills=KILLS,
            report_path=workdir / "workers.txt",
            progress=progress,
            bound_seconds=600.0,
        )

    phases, report = run_fresh(engine, "chaos_workers", scenario)
    history = report.history
    return {
        **phases,
        "tasks": tasks,
        "lost": len(history.lost),
        "duplicated": history.duplicate_effects,
        "out_of_fence": len(history.out_of_fence),
        "unexpected": len(history.unexpected),
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
