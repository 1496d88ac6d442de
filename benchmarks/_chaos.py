"""The frame of ``benchmarks.chaos``: what a fault scenario is and how its phases are measured.

A scenario runs a workload, injects one fault, and records when each unit of
work finished (:class:`Timeline`). The runner turns the timeline into the
figures every scenario reports the same way: throughput before, during and
after the fault, and the time to recover. A scenario adds its own checks
(``lost``, ``duplicated``, …) to the row it returns.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from benchmarks._common import Engine

__all__ = ["RECOVERED_SHARE", "ChaosScenario", "Timeline"]

RECOVERED_SHARE = 0.5
"""A fault is recovered from once a one-second window after its end completes
at least this share of the rate before it: the first sign that the system
carries on at speed, not merely that one unit got through."""

_WINDOW_S = 1.0


@dataclass
class Timeline:
    """Completion times of a workload and the fault's start and end, on one monotonic clock.

    Call :meth:`done` as each unit of work finishes (from any thread: appending
    to a list is atomic in CPython), :meth:`fault_started` and
    :meth:`fault_ended` around the fault, :meth:`finished` when the workload is.
    """

    clock: Callable[[], float] = time.monotonic
    start: float = field(default=0.0)
    fault_start: float | None = None
    fault_end: float | None = None
    end: float | None = None
    completions: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.start = self.clock()

    def done(self, units: int = 1) -> None:
        """``units`` of work finished now."""
        now = self.clock()
        self.completions.extend([now] * units)

    def fault_started(self) -> None:
        """The fault begins now."""
        self.fault_start = self.clock()

    def fault_ended(self) -> None:
        """The fault is over now (the process restarted, the transaction closed …)."""
        self.fault_end = self.clock()

    def finished(self) -> None:
        """The workload is over now."""
        self.end = self.clock()

    def _rate(self, lo: float, hi: float, times: list[float]) -> float | None:
        if hi - lo <= 0:
            return None
        count = bisect.bisect_left(times, hi) - bisect.bisect_left(times, lo)
        return count / (hi - lo)

    def phases(self) -> dict[str, float | None]:
        """Units per second before, during and after the fault, and the time to recover.

        ``recover_s`` counts from the fault's end to the start of the first
        one-second window that reaches :data:`RECOVERED_SHARE` of the rate
        before the fault (``None`` if none did before the workload ended).
        """
        if self.fault_start is None or self.fault_end is None:
            raise ValueError("the fault's start and end were not recorded")
        end = self.end if self.end is not None else self.clock()
        times = sorted(self.completions)
        before = self._rate(self.start, self.fault_start, times)
        during = self._rate(self.fault_start, self.fault_end, times)
        after = self._rate(self.fault_end, end, times)
        recover: float | None = None
        if before:
            # Windows start at each completion after the fault's end, so the
            # first qualifying window is found to the completion, not to a grid.
            for at in times[bisect.bisect_left(times, self.fault_end) :]:
                if at + _WINDOW_S > end:
                    break
                rate = self._rate(at, at + _WINDOW_S, times)
                if rate is not None and rate >= RECOVERED_SHARE * before:
                    recover = at - self.fault_end
                    break
        return {
            "before_per_s": _round(before),
            "during_per_s": _round(during),
            "after_per_s": _round(after),
            "fault_s": round(self.fault_end - self.fault_start, 3),
            "recover_s": _round(recover),
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


@dataclass(frozen=True)
class ChaosScenario:
    """One fault of ``benchmarks.chaos``.

    ``run(engine, options)`` performs one run on a fresh database (or data
    directory) and returns its row: :meth:`Timeline.phases` merged with the
    scenario's own checks, which must include ``lost`` (units of work that
    never took effect) so that every row says whether the fault lost anything.
    ``options`` holds the runner's command-line options (``scale`` multiplies
    the scenario's default workload).
    """

    name: str
    summary: str
    engines: tuple[Engine, ...]
    run: Callable[[Engine, Mapping[str, Any]], dict[str, Any]]
