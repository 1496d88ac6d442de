"""Several OS processes claim from one database while some are SIGKILLed.

Invariants 1, 2 and 7 under real concurrency, on both engines: every task is
completed, its effect (a ledger row written in the same transaction as the
fenced completion) happened exactly once, and a stale completion never
commits. It runs on the kit: the workers are
:func:`trace_testing.workers.run_worker` processes of a
:class:`~trace_testing.faults.WorkerFleet` (real clocks, a short lease), the
effects go to :class:`~trace_testing.history.EffectLedger` and
:func:`~trace_testing.history.check_history` judges them; the parent only
waits on database conditions, each with a deadline.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.factories import make_job, wait_until
from trace_core.model import Fence
from trace_core.storage import schema
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import TaskQueue
from trace_testing import workers
from trace_testing.faults import WorkerFleet
from trace_testing.history import EffectLedger

pytestmark = pytest.mark.anyio

N_TASKS = 2_000
WORKERS = 4
"""Workers running at any time (the killed ones are replaced)."""
KILLED = 2
LEASE_SECONDS = 1.5
DEADLINE_SECONDS = 45.0
"""Bound on the whole drain; far above what it needs (about 10 s on 2 cores)."""


async def status_counts(repo: SqlRepository) -> dict[str, int]:
    t = schema.tasks
    async with repo.read() as tx:
        rows = (
            await tx.connection.execute(sa.select(t.c.status, sa.func.count()).group_by(t.c.status))
        ).all()
    return {str(r[0]): int(r[1]) for r in rows}


async def running_held_by(repo: SqlRepository, worker: str) -> int:
    t = schema.tasks
    async with repo.read() as tx:
        return int(
            (
                await tx.connection.execute(
                    sa.select(sa.func.count()).where(
                        t.c.status == "Running", t.c.worker_id == worker
                    )
                )
            ).scalar_one()
        )


@pytest.mark.slow
async def test_workers_killed_mid_task_lose_nothing_and_double_nothing(
    engine: str, database_url: str, repo: SqlRepository, tmp_path: Path
) -> None:
    tq = TaskQueue(repo)
    job = await make_job(repo, tq.clock.now(), max_attempts=10)
    ledger = EffectLedger(repo)
    await ledger.create()
    created = await tq.create(
        [NewTask(job, dedupe_key=f"k{i}", max_attempts=10) for i in range(N_TASKS)]
    )
    task_ids = {c.task_id for c in created}
    assert len(task_ids) == N_TASKS

    report_path = tmp_path / "worker-reports.txt"
    fleet = WorkerFleet(workers.run_worker, workers.STAT_NAMES, rng=random.Random(7))

    def config(name: str, seed: int) -> workers.WorkerConfig:
        return workers.WorkerConfig(
            url=database_url,
            name=name,
            report_path=str(report_path),
            seed=seed,
            lease_seconds=LEASE_SECONDS,
        )

    started = time.monotonic()
    deadline = started + DEADLINE_SECONDS
    names = [f"w{i}" for i in range(WORKERS)]
    orphaned: dict[str, int] = {}
    try:
        for i, name in enumerate(names):
            fleet.start(config(name, seed=1000 + i))

        async def progress() -> str:
            return f"{await status_counts(repo)}; " + ", ".join(
                f"{n}={[fleet.stat(n, k) for k in workers.STAT_NAMES]}" for n in fleet.stats
            )

        # Kill the first KILLED workers while they hold leases they have not
        # completed (each claims a batch and works through it one by one).
        for victim in names[:KILLED]:
            await wait_until(
                f"{victim} to hold leases after some progress",
                lambda v=victim: fleet.stat(v, "completed") >= 50 and fleet.stat(v, "holding") > 0,
                deadline,
                describe=progress,
            )
            fleet.kill(victim)
            # Its leases are now orphans, until they expire and are reclaimed.
            orphaned[victim] = await running_held_by(repo, victim)
        for i, victim in enumerate(names[:KILLED]):
            fleet.restart(victim, seed=2000 + i)

        async def all_completed() -> bool:
            return (await status_counts(repo)).get("Completed", 0) == N_TASKS

        await wait_until("every task to be Completed", all_completed, deadline, describe=progress)
    finally:
        codes = fleet.shutdown()
    elapsed = time.monotonic() - started

    reports = report_path.read_text() if report_path.exists() else ""
    survivors = {n: c for n, c in codes.items() if n not in fleet.killed}
    assert all(c == 0 for c in survivors.values()), f"worker exit codes {codes}\n{reports}"
    assert fleet.total("violations") == 0, reports
    # Each accepted completion finished a distinct task (a killed worker may
    # have committed one it did not get to count).
    assert fleet.total("completed") <= N_TASKS
    assert "VIOLATION" not in reports and "CRASH" not in reports, reports
    # The kills hit workers holding live, uncompleted leases.
    assert sum(orphaned.values()) >= 1, orphaned

    t = schema.tasks
    async with repo.read() as tx:
        tasks = {
            str(r.id): r
            for r in (
                await tx.connection.execute(
                    sa.select(t.c.id, t.c.status, t.c.attempt, t.c.max_attempts, t.c.lease_token)
                )
            ).all()
        }

    assert set(tasks) == {str(i) for i in task_ids}
    assert {r.status for r in tasks.values()} == {"Completed"}
    assert all(1 <= r.attempt <= r.max_attempts for r in tasks.values())
    # Exactly one effect per task: none missing, none doubled; and the effect
    # that committed is the attempt (and lease) that completed the task.
    history = await ledger.check(
        {task_id: Fence(task_id, r.attempt, r.lease_token) for task_id, r in tasks.items()}
    )
    assert history.ok, str(history)
    assert history.effects == N_TASKS

    retried = sum(1 for r in tasks.values() if r.attempt > 1)
    summary = {
        "engine": engine,
        "seconds": round(elapsed, 1),
        "orphaned_by_kill": orphaned,
        "tasks_retried": retried,
        **{
            k: fleet.total(k)
            for k in workers.STAT_NAMES
            if k not in ("holding", "started", "in_effect")
        },
        "history": history.summary(),
    }
    print(f"\nmultiprocess summary: {summary}")
    # Orphans of the kills can only be finished by a reclaim and a new attempt.
    assert retried >= 1 and fleet.total("reclaimed") >= 1, summary
