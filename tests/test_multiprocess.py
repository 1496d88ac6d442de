"""Several OS processes claim from one database while some are SIGKILLed.

Invariants 1, 2 and 7 under real concurrency, on both engines: every task is
completed, its effect (a ledger row written in the same transaction as the
fenced completion) happened exactly once, and a stale completion never
commits. The workers (``tests/mp_worker.py``) run with real clocks and a
short lease; the parent only waits on database conditions, each with a
deadline.
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tests import mp_worker
from tests.factories import make_job, wait_until
from trace_core.storage import schema
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import TaskQueue

pytestmark = pytest.mark.anyio

N_TASKS = 2_000
WORKERS = 4
"""Workers running at any time (the killed ones are replaced)."""
KILLED = 2
LEASE_SECONDS = 1.5
DEADLINE_SECONDS = 45.0
"""Bound on the whole drain; far above what it needs (about 10 s on 2 cores)."""


class Fleet:
    """The worker processes of one test, and their shared counters."""

    def __init__(self, url: str, report_path: Path) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        self.url = url
        self.report_path = report_path
        self.stop = self.ctx.Event()
        self.procs: dict[str, Any] = {}
        self.stats: dict[str, Any] = {}
        self.killed: set[str] = set()

    def start(self, name: str, seed: int) -> None:
        stats = self.ctx.RawArray("q", len(mp_worker.STAT_NAMES))
        config = mp_worker.WorkerConfig(
            url=self.url,
            name=name,
            report_path=str(self.report_path),
            seed=seed,
            lease_seconds=LEASE_SECONDS,
        )
        proc = self.ctx.Process(
            target=mp_worker.run_worker, args=(config, stats, self.stop), name=name
        )
        proc.start()
        self.procs[name] = proc
        self.stats[name] = stats

    def stat(self, name: str, key: str) -> int:
        return int(self.stats[name][mp_worker.STAT_NAMES.index(key)])

    def total(self, key: str) -> int:
        return sum(self.stat(name, key) for name in self.stats)

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        proc.kill()  # SIGKILL: no cleanup, no rollback from the worker's side
        proc.join(10)
        self.killed.add(name)

    def shutdown(self) -> dict[str, int | None]:
        self.stop.set()
        codes: dict[str, int | None] = {}
        for name, proc in self.procs.items():
            proc.join(20)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            codes[name] = proc.exitcode
            proc.close()
        return codes


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
    async with repo.transaction() as tx:
        await tx.connection.execute(sa.text(mp_worker.LEDGER_DDL))
    created = await tq.create(
        [NewTask(job, dedupe_key=f"k{i}", max_attempts=10) for i in range(N_TASKS)]
    )
    task_ids = {c.task_id for c in created}
    assert len(task_ids) == N_TASKS

    fleet = Fleet(database_url, tmp_path / "worker-reports.txt")
    started = time.monotonic()
    deadline = started + DEADLINE_SECONDS
    names = [f"w{i}" for i in range(WORKERS)]
    orphaned: dict[str, int] = {}
    try:
        for i, name in enumerate(names):
            fleet.start(name, seed=1000 + i)

        async def progress() -> str:
            return f"{await status_counts(repo)}; " + ", ".join(
                f"{n}={[fleet.stat(n, k) for k in mp_worker.STAT_NAMES]}" for n in fleet.stats
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
        for i in range(KILLED):
            fleet.start(f"r{i}", seed=2000 + i)

        async def all_completed() -> bool:
            return (await status_counts(repo)).get("Completed", 0) == N_TASKS

        await wait_until("every task to be Completed", all_completed, deadline, describe=progress)
    finally:
        codes = fleet.shutdown()
    elapsed = time.monotonic() - started

    reports = fleet.report_path.read_text() if fleet.report_path.exists() else ""
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
        conn = tx.connection
        tasks = {
            str(r.id): r
            for r in (
                await conn.execute(
                    sa.select(t.c.id, t.c.status, t.c.attempt, t.c.max_attempts, t.c.worker_id)
                )
            ).all()
        }
        ledger = (
            await conn.execute(
                sa.select(
                    mp_worker.LEDGER.c.task_id,
                    mp_worker.LEDGER.c.attempt,
                    mp_worker.LEDGER.c.worker,
                )
            )
        ).all()

    assert set(tasks) == {str(i) for i in task_ids}
    assert {r.status for r in tasks.values()} == {"Completed"}
    assert all(1 <= r.attempt <= r.max_attempts for r in tasks.values())
    # Exactly one effect per task: none missing, none doubled.
    assert len(ledger) == N_TASKS
    assert {row.task_id for row in ledger} == set(tasks)
    # The effect that committed is the attempt (and holder) that completed.
    for row in ledger:
        task = tasks[row.task_id]
        assert (row.attempt, row.worker) == (task.attempt, task.worker_id), row

    retried = sum(1 for r in tasks.values() if r.attempt > 1)
    summary = {
        "engine": engine,
        "seconds": round(elapsed, 1),
        "orphaned_by_kill": orphaned,
        "tasks_retried": retried,
        **{k: fleet.total(k) for k in mp_worker.STAT_NAMES if k not in ("holding", "started")},
    }
    print(f"\nmultiprocess summary: {summary}")
    # Orphans of the kills can only be finished by a reclaim and a new attempt.
    assert retried >= 1 and fleet.total("reclaimed") >= 1, summary
