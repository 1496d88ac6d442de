"""Chaos scenario ``relay-sigkill``: the outbox relay process SIGKILLed in the
middle of its batches while it handles 5,000 rows (``--scale`` multiplies
the count).

One process runs the real :class:`~trace_core.outbox.OutboxRelay` service
loop (:func:`trace_testing.relay_chaos.run_relay`), each delivery taking
2 ms and recorded in a ledger; three times, at evenly spaced shares of the
deliveries, it is SIGKILLed and a successor started, which reclaims the dead
relay's rows once their 1 s lease expires
(:func:`trace_testing.relay_chaos.relay_kill_drain`). Units are deliveries.
The row adds ``lost`` (rows never delivered), ``not_done`` (rows not marked
``Done``) and ``duplicated`` (deliveries repeated after a kill, which
at-least-once delivery allows).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks._chaos import ChaosScenario
from benchmarks._chaos_workers import run_fresh
from benchmarks._common import Engine
from trace_testing.chaos_workers import Progress
from trace_testing.relay_chaos import relay_kill_drain

__all__ = ["SCENARIO"]

ROWS = 5_000
KILLS = 3


def _run(engine: Engine, options: Mapping[str, Any]) -> dict[str, Any]:
    rows = max(100, round(ROWS * float(options.get("scale", 1.0))))

    async def scenario(url: str, workdir: Path, progress: Progress) -> Any:
        return await relay_kill_drain(
            url,
            rows=rows,
            kills=KILLS,
            report_path=workdir / "relay.txt",
            progress=progress,
            relay_options={"handler_seconds": 0.002, "lease_seconds": 1.0},
            bound_seconds=600.0,
        )

    phases, report = run_fresh(engine, "chaos_relay", scenario)
    history = report.history
    return {
        **phases,
        "rows": rows,
        "lost": len(history.lost),
        "not_done": report.not_done,
        "duplicated": history.duplicate_effects,
        "out_of_fence": len(history.out_of_fence),
        "kills": len(report.killed),
        "drain_s": round(report.seconds, 2),
    }


SCENARIO = ChaosScenario(
    name="relay-sigkill",
    summary="the outbox relay process SIGKILLed mid-batch: every row at least once",
    engines=("sqlite", "postgres"),
    run=_run,
)
