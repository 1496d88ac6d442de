"""The kit's fault tools, each on real processes and real databases: SIGKILL
at random and restart, SIGSTOP past a lease and SIGCONT, crash-restart of the
throwaway Postgres, an idle transaction that holds a snapshot."""

from __future__ import annotations

import errno
import random
import signal
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from tests.factories import make_job, wait_until
from trace_core.leasing import LeaseConfig
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import TaskQueue
from trace_testing import workers
from trace_testing.drain import create_tasks
from trace_testing.faults import (
    WorkerFleet,
    crash_restart,
    fill_disk,
    hold_snapshot,
    process_state,
    small_filesystem,
)
from trace_testing.history import EffectLedger, committed_fences
from trace_testing.postgres import PostgresServer
from trace_testing.targets import CounterConfig, count_until_stopped

pytestmark = pytest.mark.anyio

BOUND = 30.0
"""Seconds any awaited condition may take (far above what each needs)."""


def _describe(fleet: WorkerFleet) -> str:
    return ", ".join(
        f"{n}={fleet.stat(n, 'ticks')}/{process_state(fleet.pid(n))}" for n in fleet.procs
    )


async def test_kill_random_then_restart(tmp_path: Path) -> None:
    fleet = WorkerFleet(count_until_stopped, ["ticks"], rng=random.Random(3))
    deadline = time.monotonic() + BOUND
    try:
        names = [fleet.start(CounterConfig(f"t{i}")) for i in range(3)]
        await wait_until(
            "every ticker to tick",
            lambda: all(fleet.stat(n, "ticks") > 0 for n in names),
            deadline,
            describe=lambda: _describe(fleet),
        )
        victim = fleet.kill_random()
        assert victim in names and fleet.killed == [victim]
        assert fleet.procs[victim].exitcode == -signal.SIGKILL
        assert sorted(fleet.alive()) == sorted(set(names) - {victim})
        frozen = fleet.stat(victim, "ticks")
        successor = fleet.restart(victim, seed=9)
        assert successor.startswith(f"{victim}.r") and fleet.configs[successor].seed == 9
        await wait_until(
            "the successor to tick",
            lambda: fleet.stat(successor, "ticks") > 0,
            deadline,
            describe=lambda: _describe(fleet),
        )
        assert fleet.stat(victim, "ticks") == frozen, "a killed worker's counters stay readable"
        with pytest.raises(RuntimeError, match="still running"):
            fleet.restart(successor)
    finally:
        codes = fleet.shutdown()
    assert codes[victim] == -signal.SIGKILL
    assert all(code == 0 for name, code in codes.items() if name != victim), codes


async def test_pause_freezes_a_worker_and_resume_thaws_it() -> None:
    fleet = WorkerFleet(count_until_stopped, ["ticks"])
    deadline = time.monotonic() + BOUND
    try:
        sleeper, witness = (
            fleet.start(CounterConfig("sleeper")),
            fleet.start(CounterConfig("witness")),
        )
        await wait_until(
            "both to tick",
            lambda: fleet.stat(sleeper, "ticks") > 0 and fleet.stat(witness, "ticks") > 0,
            deadline,
            describe=lambda: _describe(fleet),
        )
        with fleet.paused(sleeper):
            await wait_until(
                "the kernel to stop it",
                lambda: process_state(fleet.pid(sleeper)) == "T",
                deadline,
                describe=lambda: _describe(fleet),
            )
            frozen = fleet.stat(sleeper, "ticks")
            target = fleet.stat(witness, "ticks") + 50
            await wait_until(
                "the witness to tick 50 more",
                lambda: fleet.stat(witness, "ticks") >= target,
                deadline,
                describe=lambda: _describe(fleet),
            )
            assert fleet.stat(sleeper, "ticks") == frozen, "a paused worker made progress"
        await wait_until(
            "the thawed worker to tick again",
            lambda: fleet.stat(sleeper, "ticks") > frozen,
            deadline,
            describe=lambda: _describe(fleet),
        )
    finally:
        codes = fleet.shutdown()
    assert codes == {sleeper: 0, witness: 0}


@pytest.mark.slow
async def test_a_worker_paused_past_its_lease_has_its_writes_refused(
    database_url: str, repo: SqlRepository, tmp_path: Path
) -> None:
    queue = TaskQueue(repo, config=LeaseConfig(lease_seconds=1.0))
    job = await make_job(repo, queue.clock.now(), max_attempts=5)
    created = await queue.create(
        [NewTask(job, dedupe_key=f"p{i}", max_attempts=5) for i in range(4)]
    )
    ledger = EffectLedger(repo)
    await ledger.create()
    report = tmp_path / "reports.txt"
    fleet = WorkerFleet(workers.run_worker, workers.STAT_NAMES)

    def config(name: str) -> workers.WorkerConfig:
        # Every effect outlasts nothing by itself (0.3 s of a 1 s lease); the
        # pause is what makes the lease run out under the worker's feet.
        return workers.WorkerConfig(
            url=database_url, name=name, report_path=str(report), seed=1, batch=1,
            lease_seconds=1.0, long_hold_probability=1.0, long_hold_seconds=0.3,
        )  # fmt: skip

    deadline = time.monotonic() + BOUND
    describe = lambda: str(fleet.totals())  # noqa: E731
    try:
        sleeper = fleet.start(config("sleeper"))
        await wait_until(
            "the sleeper to be inside an effect",
            lambda: fleet.stat(sleeper, "in_effect") == 1,
            deadline,
            describe=describe,
        )
        with fleet.paused(sleeper):
            held = fleet.stat(sleeper, "holding")
            assert held == 1
            fleet.start(config("successor"))

            async def all_completed() -> bool:
                ids = [c.task_id for c in created]
                return len(await committed_fences(queue.leases, ids)) == len(ids)

            await wait_until(
                "the successor to finish every task", all_completed, deadline, describe=describe
            )
        await wait_until(
            "the thawed sleeper's completion to be refused",
            lambda: fleet.stat(sleeper, "stale") + fleet.stat(sleeper, "heartbeat_stale") >= 1,
            deadline,
            describe=describe,
        )
    finally:
        codes = fleet.shutdown()
    assert set(codes.values()) == {0}, (codes, report.read_text() if report.exists() else "")
    assert fleet.total("reclaimed") >= 1
    history = await ledger.check(await committed_fences(queue.leases, [c.task_id for c in created]))
    assert history.ok, str(history)


@pytest.mark.parametrize("engine", ["postgres"])
async def test_crash_restart_cuts_sessions_and_keeps_committed_data(
    engine: str, postgres_server: PostgresServer, database_url: str, repo: SqlRepository
) -> None:
    job = await make_job(repo, TaskQueue(repo).clock.now())
    before = psycopg.connect(database_url, autocommit=True)
    # The test cluster commits with synchronous_commit off: a crash may take
    # the last commits with it. A checkpoint makes this one durable.
    before.execute("CHECKPOINT")
    try:
        downtime = crash_restart(postgres_server)
        assert 0 < downtime < 60
        with pytest.raises(psycopg.OperationalError):
            before.execute("SELECT 1")
    finally:
        before.close()
    with psycopg.connect(database_url) as after:
        row = after.execute("SELECT count(*) FROM jobs WHERE id = %s", (job,)).fetchone()
    assert row == (1,), "a commit before the crash survives crash recovery"


def test_crash_restart_refuses_a_server_it_does_not_own(postgres_server: PostgresServer) -> None:
    # The run's server reached as a user's own one (--trace-postgres-url).
    external = PostgresServer(external_url=postgres_server.url("postgres"))
    assert external.cluster is None
    with pytest.raises(RuntimeError, match="user's own server"):
        crash_restart(external)


async def test_a_held_snapshot_keeps_its_view_while_others_commit(
    engine: str, database_url: str, repo: SqlRepository
) -> None:
    queue = TaskQueue(repo)
    job = await make_job(repo, queue.clock.now())
    await queue.create([NewTask(job, dedupe_key="before")])
    with hold_snapshot(database_url) as held:
        assert held.engine == engine and held.first_read == 1
        await queue.create([NewTask(job, dedupe_key="after")])
        seen = held.connection.execute("SELECT count(*) FROM tasks").fetchone()[0]
        assert seen == 1, "the held transaction sees its snapshot, not the later commit"
        if engine == "postgres":
            isolation = held.connection.execute("SHOW transaction_isolation").fetchone()
            assert isolation == ("repeatable read",)
            with psycopg.connect(database_url) as probe:
                state, xmin = probe.execute(
                    "SELECT state, backend_xmin IS NOT NULL FROM pg_stat_activity WHERE pid = %s",
                    (held.backend_pid,),
                ).fetchone() or (None, None)
            assert (state, xmin) == ("idle in transaction", True)
    async with repo.read() as tx:
        assert await tx.connection.scalar(sa.text("SELECT count(*) FROM tasks")) == 2


def test_a_filled_small_filesystem_refuses_writes_until_space_is_freed() -> None:
    with small_filesystem(1024 * 1024) as fs:
        filler = fill_disk(fs)
        assert filler.stat().st_size > 512 * 1024
        with pytest.raises(OSError) as refused:
            (fs / "more").write_bytes(b"x" * 8192)
        assert refused.value.errno == errno.ENOSPC
        filler.unlink()
        (fs / "more").write_bytes(b"x" * 8192)
        assert (fs / "more").stat().st_size == 8192
    assert not fs.exists(), "the mount point is removed afterwards"


CLAIMANTS = sa.table("kit_claimants", sa.column("task_id", sa.Text()))


async def record_claimant(tx: Any, lease: Any) -> None:
    """An embedder's handler, run by the kit's worker processes."""
    await tx.connection.execute(sa.insert(CLAIMANTS).values(task_id=str(lease.item_id)))


async def test_worker_processes_run_an_embedders_handler_with_the_completion(
    database_url: str, repo: SqlRepository, tmp_path: Path
) -> None:
    ids = await create_tasks(repo, 30)
    ledger = EffectLedger(repo)
    await ledger.create()
    async with repo.transaction() as tx:
        await tx.connection.execute(
            sa.text("CREATE TABLE kit_claimants (task_id TEXT PRIMARY KEY)")
        )
    fleet = WorkerFleet(workers.run_worker, workers.STAT_NAMES)
    report = tmp_path / "reports.txt"
    for i in range(2):
        fleet.start(
            workers.WorkerConfig(
                url=database_url,
                name=f"w{i}",
                report_path=str(report),
                seed=i,
                handler=f"{__name__}:record_claimant",
            )
        )
    try:
        await wait_until(
            "the workers to complete every task",
            lambda: fleet.total("completed") == len(ids),
            time.monotonic() + BOUND,
            describe=lambda: f"{fleet.totals()} {report.read_text() if report.exists() else ''}",
        )
    finally:
        codes = fleet.shutdown()
    assert set(codes.values()) == {0}, codes
    async with repo.read() as tx:
        claimants = (await tx.connection.execute(sa.select(CLAIMANTS.c.task_id))).scalars().all()
    assert sorted(claimants) == sorted(str(i) for i in ids)
    assert (await ledger.check_tasks(ids)).ok


def test_a_handler_that_does_not_exist_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="module:function"):
        workers.load_handler("no_colon")
    with pytest.raises(ValueError, match="has no function 'nothing'"):
        workers.load_handler(f"{__name__}:nothing")
