"""Chaos benchmark: throughput before, during and after each fault, and the time to recover.

    python -m benchmarks.chaos --runs 3                     # every scenario, its engines
    python -m benchmarks.chaos --scenario NAME --engine postgres --runs 3
    python -m benchmarks.chaos --list

Each scenario (in a module ``benchmarks/_chaos_<name>.py`` listed in
``_SCENARIOS``) runs a workload on a fresh database, injects its fault and
reports units of work per second before, during and after it, the fault's
length and ``recover_s`` (see :mod:`benchmarks._chaos`), with its own checks:
every row says how many units were ``lost``. One JSON object per run, then a
summary of medians per scenario and engine.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks._chaos import ChaosScenario
from benchmarks._common import configure_logging, emit, load_average, log, summarize

__all__ = ["main", "scenarios"]

_SCENARIOS: tuple[str, ...] = (
    "_chaos_workers",
    "_chaos_workers_pause",
    "_chaos_relay",
    "_chaos_postgres",
    "_chaos_lite",
)
"""Modules (``benchmarks._chaos_<name>``) of the scenarios, in run order: each
exports ``SCENARIO``, or ``SCENARIOS`` when it holds several."""

_KEYS = ("before_per_s", "during_per_s", "after_per_s", "fault_s", "recover_s", "lost")


def scenarios() -> dict[str, ChaosScenario]:
    """Every scenario by name."""
    found: dict[str, ChaosScenario] = {}
    for name in _SCENARIOS:
        module = importlib.import_module(f"benchmarks.{name}")
        listed: tuple[ChaosScenario, ...] = getattr(module, "SCENARIOS", None) or (module.SCENARIO,)
        for scenario in listed:
            found[scenario.name] = scenario
    return found


def main(argv: Sequence[str] | None = None) -> int:
    """Run the scenarios; one JSON object per run, then a summary per scenario and engine."""
    known = scenarios()
    p = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__)
    p.add_argument("--scenario", action="append", choices=sorted(known), help="repeatable")
    p.add_argument("--engine", choices=("sqlite", "postgres"), help="default: each scenario's")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--scale", type=float, default=1.0, help="multiplies each workload")
    p.add_argument("--list", action="store_true", help="print the scenarios and exit")
    args = p.parse_args(argv)
    if args.list:
        for scenario in known.values():
            print(f"{scenario.name:24} {'/'.join(scenario.engines):16} {scenario.summary}")
        return 0
    if args.runs < 1:
        p.error("--runs must be >= 1")
    if args.scale <= 0:
        p.error("--scale must be > 0")
    configure_logging(False)
    options: dict[str, Any] = {"scale": args.scale}
    for name in args.scenario or list(known):
        scenario = known[name]
        engines = [args.engine] if args.engine else list(scenario.engines)
        for engine in engines:
            if engine not in scenario.engines:
                log.info("%s: skipped on %s (the fault does not exist there)", name, engine)
                continue
            rows: list[dict[str, Any]] = []
            for run in range(args.runs):
                load = load_average()
                log.info("%s on %s: run %d", name, engine, run)
                got = scenario.run(engine, options)
                row = {"bench": "chaos", "scenario": name, "engine": engine, "run": run, **got}
                emit({**row, "load_avg_1m": load})
                rows.append(row)
            emit(
                {
                    "bench": "chaos",
                    "scenario": name,
                    "engine": engine,
                    "summary": True,
                    "runs": args.runs,
                    "total_lost": sum(int(r.get("lost", 0)) for r in rows),
                    **summarize(rows, _KEYS),
                }
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
