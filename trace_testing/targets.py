"""The smallest :class:`~trace_testing.faults.WorkerFleet` target: a process
that only counts. For testing a harness, a signal or a supervisor without a
database; it imports nothing beyond the standard library, so it starts fast."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["CounterConfig", "count_until_stopped"]


@dataclass(frozen=True)
class CounterConfig:
    """A counting worker's name (and a seed, unused, as every config may carry)."""

    name: str
    seed: int = 0


def count_until_stopped(config: CounterConfig, stats: Any, stop: Any) -> None:
    """Add one to ``stats[0]`` every 5 ms until ``stop`` is set."""
    while not stop.wait(0.005):
        stats[0] += 1
