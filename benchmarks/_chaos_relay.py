"""Chaos scenario ``relay-sigkill``: the outbox relay process SIGKILLed in the
middle of its batches while it handles 5,000 rows (``--scale`` multiplies
the count).

One process runs the real :class:`~trace_core.outbox.OutboxRelay` service
loop (:func:`trace_testing.relay_chaos.run_relay`), each delivery taking
2 ms and recorded in a ledger; three times, at evenly spaced shares of the
deliveries, it is SIGKILLed and a successor started, which reclaims the dead
relay's rows once their 1 s lease expires
(:func:`trace_testing.relay_chaos.relay_kill_drain`). Units are deliveries.
The row adds ``lost`` (rows never delivered), ``duplicated`` (deliveries
repeated after a kill, which at-least-once delivery allows), the history
checker's other findings, and ``not_done`` (rows not marked ``Done``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from benchmarks._chaos import ChaosScenario
from benchmarks._chaos_workers import history_columns, run_drain, scaled
from benchmarks._common import Engine
from trace_testing.relay_chaos import relay_kill_drain

__all__ = ["SCENARIO"]

ROWS = 5_000
KILLS = 3


def _run(engine: Engine, options: Mapping[str, Any]) -> dict[str, Any]:
    rows = scaled(ROWS, options)
    phases, report = run_drain(
        engine,
        "chaos_relay",
        relay_kill_drain,
        "relay.txt",
        rows=rows,
        kills=KILLS,
        relay_options={"handler_seconds": 0.002, "lease_seconds": 1.0},
        bound_seconds=600.0,
    )
    return {
        **phases,
        "rows": rows,
        **history_columns(report.history),
        "not_done": report.not_done,
        "kills": len(report.killed),
        "drain_s": round(report.seconds, 2),
    }


SCENARIO = ChaosScenario(
    name="relay-sigkill",
    summary="the outbox relay process SIGKILLed mid-batch: every row at least once",
    engines=("sqlite", "postgres"),
    run=_run,
)
