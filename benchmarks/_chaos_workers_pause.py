"""Chaos scenario ``worker-pause``: a worker SIGSTOPped past its lease and
SIGCONTed, during a drain of 2,000 tasks (``--scale`` multiplies the count).

Two :func:`~trace_testing.workers.run_worker` processes drain the backlog
while a probe (:mod:`trace_testing.probe`) holds four tasks and heartbeats
them; once a third of the backlog is done it is frozen, until the others
have reclaimed and completed its tasks (a 2 s lease), then thawed to try a
heartbeat, the effect with its completion, and a failure under each stale
lease (:func:`trace_testing.chaos_workers.pause_past_lease`). The fault is
the pause. The row adds the history checker's findings and the paused
worker's writes: ``stale_writes_accepted`` must be 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from benchmarks._chaos import ChaosScenario
from benchmarks._chaos_workers import history_columns, run_drain, scaled
from benchmarks._common import Engine
from trace_testing.chaos_workers import pause_past_lease

__all__ = ["SCENARIO"]

TASKS = 2_000
HELD = 4


def _run(engine: Engine, options: Mapping[str, Any]) -> dict[str, Any]:
    tasks = scaled(TASKS, options)
    phases, report = run_drain(
        engine,
        "chaos_pause",
        pause_past_lease,
        "workers.txt",
        tasks=tasks,
        held=HELD,
        bound_seconds=300.0,
    )
    probe = report.probe
    kinds = ("heartbeat", "complete", "fail")
    return {
        **phases,
        "tasks": tasks,
        **history_columns(report.history),
        "kills": 0,
        "held": len(report.held),
        "redone_by_others": len(report.finished_by),
        "stale_writes_refused": sum(probe[f"{k}_refused"] for k in kinds),
        "stale_writes_accepted": sum(probe[f"{k}_accepted"] for k in kinds),
        "stale_effects": report.stale_effects,
        "paused_s": round(report.paused_seconds, 2),
    }


SCENARIO = ChaosScenario(
    name="worker-pause",
    summary="a worker SIGSTOPped past its lease, then resumed: its writes refused",
    engines=("sqlite", "postgres"),
    run=_run,
)
