"""Postgres faults under a running system: crash-restarts and an idle snapshot.

Postgres only: neither fault exists on SQLite (an embedded database has no
server to crash, and a reader there holds no vacuum horizon).

- **Crash-restart twice during a drain.** ``trace-lite serve`` (the HTTP API,
  the Dispatcher's loops, the outbox relay and the in-process runner),
  ``trace-lite worker`` processes over HTTP and kit worker processes
  (:func:`~trace_testing.outage_workers.run_worker_through_outages`, each
  effect recorded with its fenced completion) all run on a cluster of the
  test's own while it is crash-restarted twice. No process dies, every loop
  carries on by itself, nothing is lost: every task completed, every outbox
  row handled, the history checker clean. The time to recover after each
  crash is measured and reported (``record_property``), never asserted.
- **An idle snapshot during a drain.** :func:`~trace_testing.faults.hold_snapshot`
  holds the xmin horizon back (``pg_stat_activity.backend_xmin``) while
  workers drain every task, with nothing lost. Its cost in throughput and
  claim latency is ``python -m benchmarks.chaos --scenario pg-idle-snapshot``'s
  to measure.

Every wait is bounded and waits on a condition, never a fixed sleep.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import anyio
import httpx
import psycopg
import pytest
import sqlalchemy as sa

from tests.test_e2e_http import AUTH, _spawn, _until, worker_args
from tests.test_e2e_http import processes as e2e_processes  # noqa: F401 (a fixture)
from tests.test_outage_pg import (
    OPERATORS_REF,
    Processes,
    _database,
    _mark_of,
    _serve,
    _tasks,
    _trigger,
)
from tests.test_outage_pg import spawned as spawned
from trace_core.storage.migrate import upgrade
from trace_core.storage.sql import SqlRepository
from trace_lite.pgcluster import PostgresCluster
from trace_testing.drain import create_tasks, drain_tasks
from trace_testing.faults import WorkerFleet, hold_snapshot
from trace_testing.history import EffectLedger
from trace_testing.outage_workers import run_worker_through_outages
from trace_testing.workers import STAT_NAMES, WorkerConfig

KIT_TASKS = 240
"""Tasks the kit workers drain; the crashes come at a third and two thirds."""


@pytest.fixture
def durable_cluster() -> Iterator[PostgresCluster]:
    """A cluster of this test alone with ``synchronous_commit`` on (the default).

    The suite's shared cluster commits asynchronously: WAL buffers sit in
    shared memory, and a crash may lose commits already acknowledged, which
    would read as lost work here. ``fsync`` alone is off, for speed: a crash
    here kills the server's processes, not the machine, and WAL written with
    ``write()`` at each commit is in the OS page cache, which survives a
    process crash; recovery reads it back from there. ``full_page_writes``
    stays on (torn pages need an OS crash too, but it costs little).
    """
    with PostgresCluster(max_connections=100, settings={"fsync": "off"}) as server:
        yield server


def _count(url: str, query: str, *args: object) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute(query, args).fetchone()
    assert row is not None
    return int(row[0])


def _kit_completed(url: str) -> int:
    """Tasks of the kit workers' job completed so far."""
    return _count(
        url,
        "SELECT count(*) FROM tasks t JOIN jobs j ON j.id = t.job_id"
        " WHERE j.name = 'kit' AND t.status = 'Completed'",
    )


def _kit_beyond(url: str, count: int) -> bool | None:
    """True once more than ``count`` kit tasks completed (for :func:`_until`)."""
    return _kit_completed(url) > count or None


def _state(url: str) -> str:
    """Tasks, outbox rows and events by status (for a failure's message)."""
    with psycopg.connect(url) as conn:
        tasks = conn.execute(
            "SELECT j.name, t.status, count(*) FROM tasks t JOIN jobs j ON j.id = t.job_id"
            " GROUP BY 1, 2 ORDER BY 1, 2"
        ).fetchall()
        outbox = conn.execute(
            "SELECT kind, status, count(*) FROM outbox GROUP BY 1, 2 ORDER BY 1, 2"
        ).fetchall()
        events = conn.execute(
            "SELECT route_status, origin, count(*), max(deliveries) FROM events GROUP BY 1, 2"
        ).fetchall()
    return f"tasks {tasks}, outbox {outbox}, events {events}"


def _healthy(api: httpx.Client) -> dict[str, dict[str, object]] | None:
    """``/readyz``'s services once every loop runs and is healthy."""
    try:
        response = api.get("/readyz")
    except httpx.TransportError:
        return None
    if response.status_code != 200:
        return None
    services: dict[str, dict[str, object]] = response.json()["services"]
    return services if all(s["running"] and s["healthy"] for s in services.values()) else None


def test_two_crash_restarts_during_a_drain_lose_nothing_and_every_loop_recovers(
    durable_cluster: PostgresCluster,
    tmp_path: Path,
    spawned: Processes,
    record_property: pytest.RecordProperty,
) -> None:
    cluster = durable_cluster
    markers = tmp_path / "markers"
    markers.mkdir()
    url = _database(cluster, markers, mark_timeout=5)

    # The kit workers claim any queued task: a database of their own on the
    # same server (crashed with it), or they would take serve's tasks too.
    cluster.create_database("kit")
    kit_url = cluster.url("kit")
    upgrade(kit_url)

    async def prepare() -> list[uuid.UUID]:
        repo = SqlRepository(kit_url)
        try:
            await EffectLedger(repo).create()
            return await create_tasks(repo, KIT_TASKS, job_name="kit", max_attempts=20)
        finally:
            await repo.close()

    kit_tasks = anyio.run(prepare)
    base = _serve(url, tmp_path, spawned)
    for name in ("w-a", "w-b"):
        spawned.append(_spawn(worker_args(base, name, OPERATORS_REF), tmp_path / f"{name}.log"))
    report = tmp_path / "kit-workers.log"
    fleet = WorkerFleet(run_worker_through_outages, STAT_NAMES)
    for i in range(2):
        # Effects of up to 50 ms pace the drain (about 3 s on an idle machine):
        # at the default 4 ms a quiet machine finished it between reaching a
        # third and the crash.
        fleet.start(
            WorkerConfig(
                kit_url,
                f"kit-{i}",
                str(report),
                seed=i,
                long_hold_probability=0,
                max_effect_seconds=0.05,
            )
        )
    ticks: list[uuid.UUID] = []
    recoveries: list[dict[str, float]] = []
    try:
        with httpx.Client(base_url=base, headers=AUTH, timeout=30) as api:
            for round_ in range(3):
                # Work in flight when the database crashes: kit tasks claimed
                # and completing, ticks woken, running in-process and routing.
                ticks.extend(_trigger(api, f"r{round_}-{i}") for i in range(5))
                if round_ == 2:
                    break
                threshold = KIT_TASKS * (round_ + 1) // 3
                _until(f"{threshold} kit tasks completed", partial(_kit_beyond, kit_url, threshold))
                assert _kit_completed(kit_url) < KIT_TASKS, "the drain ended before the crash"
                # crash_restart's two halves, to read the workers' counters while
                # the server is down: what moves after that came after the restart.
                started = time.monotonic()
                cluster.halt("immediate")
                completed = fleet.total("completed")
                cluster.resume()
                back = time.monotonic()
                _until(
                    "a kit completion after the restart",
                    lambda: fleet.total("completed") > completed or None,  # noqa: B023 (waited on here)
                )
                first_completion_s = time.monotonic() - back
                _until("every loop of serve healthy again", lambda: _healthy(api))
                recoveries.append(
                    {
                        "down_s": round(back - started, 3),
                        "first_completion_s": round(first_completion_s, 3),
                        "ready_s": round(time.monotonic() - back, 3),
                    }
                )

            def all_done() -> bool | None:
                tasks = _tasks(url)
                marks = [t for t in tasks.values() if t[0] == "mark"]
                finished = all(status == "Completed" for _, status, _ in tasks.values())
                return (finished and len(marks) == len(ticks)) or None

            try:
                _until("every task completed after two crash-restarts", all_done)
                _until("every kit task completed", partial(_kit_beyond, kit_url, KIT_TASKS - 1))
                # And new work is still woken, routed and completed afterwards.
                ticks.extend(_trigger(api, f"after-{i}") for i in range(3))
                _until("the tasks triggered after the restarts", all_done)
            except AssertionError as exc:
                raise AssertionError(f"{exc}; {_state(url)}; {api.get('/readyz').text}") from None
            services = _healthy(api)
            assert services is not None
    finally:
        codes = fleet.shutdown()
    record_property("recoveries", recoveries)
    print("recoveries", recoveries)

    # No process died of it: serve and the HTTP workers still run, the kit
    # workers ran until asked to stop, and each met the outages.
    for process, _ in spawned:
        assert process.poll() is None, f"process {process.args} died"
    assert set(codes.values()) == {0}, codes
    kit_log = report.read_text()
    assert "CRASH" not in kit_log and "VIOLATION" not in kit_log, kit_log
    assert all(f"OUTAGE kit-{i}" in kit_log for i in range(2)), kit_log

    # Nothing lost: every task completed, once (the ledger), every outbox row
    # handled, one routed task per tick, every mark ran.
    tasks = _tasks(url)
    assert {status for _, status, _ in tasks.values()} == {"Completed"}
    assert sum(job == "tick" for job, _, _ in tasks.values()) == len(ticks) == 18
    marks = {task_id for task_id, (job, _, _) in tasks.items() if job == "mark"}
    assert len(marks) == len(ticks)
    assert all(_mark_of(url, tick) in marks for tick in ticks)
    ran = {p.name.split("-", 1)[1].rsplit("-", 1)[0] for p in markers.glob("done-*")}
    assert {str(m) for m in marks} <= ran
    assert _count(url, "SELECT count(*) FROM outbox WHERE status <> 'Done'") == 0
    assert _count(url, "SELECT count(*) FROM outbox WHERE kind = 'route_event'") >= len(ticks)

    async def history() -> str | None:
        repo = SqlRepository(kit_url)
        try:
            checked = await EffectLedger(repo).check_tasks(kit_tasks)
            return None if checked.ok else str(checked)
        finally:
            await repo.close()

    assert anyio.run(history) is None

    # Every loop carried on by itself: serve's loops are running and healthy
    # (above); those that met the outage logged it once and its end once.
    log = (tmp_path / "serve.log").read_text()
    assert "unhandled error" not in log and "Traceback" not in log, log
    streaks = log.count("wake-up listener: OperationalError")
    # (One streak, when the second crash came before it had reconnected.)
    assert 1 <= streaks <= 2 and log.count("wake-up listener: recovered") == streaks, log
    met = [name for name, s in services.items() if s["total_failures"]]
    assert met, services
    assert all(f"{name}: recovered" in log for name in met), (met, log)
    for name in ("w-a", "w-b"):
        worker_log = (tmp_path / f"{name}.log").read_text()
        assert "Traceback" not in worker_log, worker_log


_HORIZON = sa.text(
    "SELECT backend_xmin::text::bigint,"
    " (SELECT min(backend_xmin::text::bigint) FROM pg_stat_activity"
    "   WHERE backend_xmin IS NOT NULL AND datname = current_database()),"
    " (SELECT min(xmin::text::bigint) FROM tasks WHERE status = 'Completed')"
    " FROM pg_stat_activity WHERE pid = :pid"
)
"""The held session's xmin, the oldest xmin of the database's sessions, and
the transaction of the oldest completion (xids of a fresh cluster: no wraparound)."""


@pytest.mark.anyio
async def test_an_idle_snapshot_holds_the_xmin_horizon_while_the_drain_loses_nothing(
    engine: str, database_url: str, repo: SqlRepository
) -> None:
    if engine != "postgres":
        pytest.skip("an idle snapshot holds no vacuum horizon on SQLite (no server, no vacuum)")
    ledger = EffectLedger(repo)
    await ledger.create()
    tasks = await create_tasks(repo, 200)

    async def record(tx: object, lease: object) -> None:
        await EffectLedger.record(tx, lease.fence, lease.worker_id)  # type: ignore[attr-defined]

    with hold_snapshot(database_url) as held:
        assert held.first_read >= 200
        result = await drain_tasks(database_url, record, workers=3)
        # The held session's snapshot is older than every completion the
        # drain committed: vacuum may remove no row version they replaced.
        async with repo.read() as tx:
            row = (await tx.connection.execute(_HORIZON, {"pid": held.backend_pid})).one()
        held_xmin, horizon, oldest_completion = row
        assert held_xmin is not None, "the idle transaction holds no snapshot"
        assert horizon == held_xmin
        assert held_xmin < oldest_completion
    assert result.completed == 200 and result.stale == 0
    report = await ledger.check_tasks(tasks)
    assert report.ok, str(report)
