"""Chaos with worker processes, on both engines (issue 20): workers SIGKILLed
at random during 10,000 tasks, and a worker paused past its lease and resumed.

Both run on the kit (:mod:`trace_testing.chaos_workers`): real processes,
real signals, a real lease TTL, and waits on database conditions only, each
with a deadline. The benchmark (``python -m benchmarks.chaos``) runs the same
scenarios and reports their throughput before, during and after the fault.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from trace_testing.chaos_workers import kill_drain, pause_past_lease

pytestmark = pytest.mark.anyio

KILL_TASKS = 10_000
KILLS = 4


@pytest.mark.slow
async def test_random_sigkills_during_a_drain_lose_and_double_nothing(
    engine: str, database_url: str, tmp_path: Path
) -> None:
    report = await kill_drain(
        database_url,
        tasks=KILL_TASKS,
        kills=KILLS,
        report_path=tmp_path / "workers.txt",
        bound_seconds=300.0,  # a bound for a hung run, far above what it takes
    )
    summary = {
        "engine": engine,
        "seconds": round(report.seconds, 1),
        "killed": report.killed,
        "orphaned": report.orphaned,
        "retried": report.retried,
        "history": report.history.summary(),
        **report.stats,
    }
    print(f"\nkill drain: {summary}")
    assert report.worker_reports == "", report.worker_reports
    assert report.survivors_exited_cleanly(), report.exit_codes
    assert len(report.killed) == KILLS
    # Every task completed exactly once in the database: one effect each,
    # recorded by the attempt that completed it.
    history = report.history
    assert history.expected == KILL_TASKS
    assert history.lost == () and history.out_of_fence == () and history.unexpected == ()
    assert history.duplicate_effects == 0, str(history)
    assert history.effects == KILL_TASKS
    assert report.stats["violations"] == 0
    # The kills hit workers holding uncompleted leases, which came back by a
    # reclaim and a new attempt.
    assert sum(report.orphaned) >= 1, report.orphaned
    assert report.retried >= 1 and report.stats["reclaimed"] >= 1, summary


async def test_a_worker_paused_past_its_lease_writes_nothing_after_it_resumes(
    engine: str, database_url: str, tmp_path: Path
) -> None:
    held = 4
    report = await pause_past_lease(
        database_url,
        tasks=200,
        held=held,
        report_path=tmp_path / "workers.txt",
        lease_seconds=2.0,
        bound_seconds=300.0,
    )
    lines = [line for line in report.worker_reports.splitlines() if not line.startswith("HELD ")]
    assert lines == [], report.worker_reports
    assert all(code == 0 for code in report.exit_codes.values()), report.exit_codes
    probe = report.probe
    assert len(report.held) == held
    # Its heartbeats kept the leases alive until the pause: the pause alone
    # let them run out.
    assert probe["heartbeats"] >= held, probe
    # Everything it wrote after it resumed was refused.
    assert probe["heartbeat_accepted"] == 0 and probe["heartbeat_refused"] >= held, probe
    assert probe["complete_accepted"] == 0 and probe["complete_refused"] == held, probe
    assert probe["fail_accepted"] == 0 and probe["fail_refused"] == held, probe
    assert report.stale_effects == 0
    # Its tasks were finished by another worker, under a later attempt, once.
    assert set(report.finished_by) == set(report.held)
    assert all(report.finished_by[t] > a for t, a in report.held.items()), report
    history = report.history
    assert history.ok, str(history)
    assert history.effects == report.tasks
