"""The outbox relay SIGKILLed in the middle of its batches, on both engines
(issue 20): every row is handled at least once and ends ``Done``, none is
lost; rows delivered again after a kill (at-least-once) are counted.

A real :class:`~trace_core.outbox.OutboxRelay` service loop runs in a process
(:func:`trace_testing.relay_chaos.run_relay`), recording each delivery in a
ledger; the parent kills it while rows are in flight and starts a successor,
which reclaims the dead relay's rows once their lease expires.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from trace_testing.relay_chaos import relay_kill_drain

pytestmark = pytest.mark.anyio

ROWS = 1_000
KILLS = 3


async def test_relay_killed_mid_batch_loses_no_row(
    engine: str, database_url: str, tmp_path: Path
) -> None:
    report = await relay_kill_drain(
        database_url,
        rows=ROWS,
        kills=KILLS,
        report_path=tmp_path / "relay.txt",
        # A delivery takes a moment, so that each kill finds rows in flight.
        relay_options={"handler_seconds": 0.002, "lease_seconds": 1.0},
        bound_seconds=300.0,  # a bound for a hung run, far above the ~10 s it takes
    )
    history = report.history
    print(
        f"\nrelay kill drain on {engine}: {history.summary()}, killed={report.killed}, "
        f"open at each kill={report.open_at_kill}, {report.seconds:.1f} s"
    )
    assert report.worker_reports == "", report.worker_reports
    assert report.survivors_exited_cleanly(), report.exit_codes
    assert len(report.killed) == KILLS
    # Each kill came with rows still open: it cut the relay's work short.
    assert all(n > 0 for n in report.open_at_kill), report.open_at_kill
    # Every row Done, every row delivered at least once; duplicates are allowed.
    assert report.not_done == 0
    assert history.lost == () and history.unexpected == (), str(history)
    assert history.effects == ROWS + history.duplicate_effects
    # A relay may die between a delivery and its count: the ledger is the truth.
    assert report.deliveries <= history.effects
