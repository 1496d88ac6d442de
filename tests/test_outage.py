"""Driver errors never leak, and long-running loops outlive an outage (unit level).

On both engines: a failing statement of the caller's own, inside any scope of
``SqlRepository``, leaves as a core error; the outbox relay and a periodic
service (the reaper) keep running while the repository raises
``DatabaseUnavailable``, log the outage once, back off with jitter through
their injected ``sleep``, and carry on by themselves once it is back. The
outage is injected at the repository's scopes (:class:`FlakyRepository`), in
front of a real database; the real thing (a Postgres cluster stopped and
crash-restarted) is ``tests/test_outage_pg.py``.
"""

from __future__ import annotations

import logging
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.lowlevel
import httpx
import pytest
import sqlalchemy as sa
import uvicorn

from tests.api_fixtures import AUTH, OPERATORS, STREAM, TOKEN, api_platform
from tests.factories import make_job, wait_until
from tests.test_e2e_http import _free_port
from trace_core.api import create_app
from trace_core.authoring.context import OperatorResult
from trace_core.authoring.operators import OperatorRegistry, OperatorSpec
from trace_core.clock import ManualClock
from trace_core.dispatcher.reaper import Reaper, ReaperConfig
from trace_core.dispatcher.service import Dispatcher
from trace_core.errors import DatabaseUnavailable, DuplicateItem, StorageError
from trace_core.outage import OUTAGE_BACKOFF, LoopHealth
from trace_core.outbox import OutboxRelay, RelayConfig, write_outbox
from trace_core.storage import schema
from trace_core.storage.protocol import NewOutboxRow, NewTask
from trace_core.storage.sql import SqlRepository, SqlTransaction
from trace_core.tasks import TaskQueue
from trace_lite.worker_cli import WorkerConfig, run_worker

pytestmark = pytest.mark.anyio

BOUND = 30.0
"""Seconds any condition may take; each takes milliseconds."""


class FlakyRepository:
    """A real repository whose scopes refuse to open while :attr:`down` is set,
    the way an unreachable database refuses connections."""

    def __init__(self, inner: SqlRepository) -> None:
        self.inner = inner
        self.down = False
        self.refused = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _gate(self) -> None:
        if self.down:
            self.refused += 1
            raise DatabaseUnavailable("connect: database unavailable: injected outage")

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[SqlTransaction]:
        self._gate()
        async with self.inner.transaction() as tx:
            yield tx

    @asynccontextmanager
    async def statement(self) -> AsyncIterator[SqlTransaction]:
        self._gate()
        async with self.inner.statement() as tx:
            yield tx

    @asynccontextmanager
    async def autocommit(self) -> AsyncIterator[SqlTransaction]:
        self._gate()
        async with self.inner.autocommit() as tx:
            yield tx

    @asynccontextmanager
    async def read(self) -> AsyncIterator[SqlTransaction]:
        self._gate()
        async with self.inner.read() as tx:
            yield tx


class Pacer:
    """An injected ``sleep``: records each backoff delay and only yields."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)
        await anyio.lowlevel.checkpoint()


def _outage_lines(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.getMessage().startswith(name)
    ]


async def _until(what: str, condition: Any, describe: Any) -> None:
    await wait_until(what, condition, time.monotonic() + BOUND, describe=describe)


# --- driver errors at the scope boundary --------------------------------------


async def test_a_constraint_violation_of_the_callers_own_sql_is_a_core_error(
    repo: SqlRepository, clock: ManualClock
) -> None:
    job = await make_job(repo, clock.now())
    t = schema.tasks
    row = {
        "id": uuid.uuid4(),
        "job_id": job,
        "dedupe_key": "k",
        "status": "Queued",
        "attempt": 1,
        "claim_version": 0,
        "max_attempts": 3,
        "queued_at": clock.now(),
    }
    async with repo.transaction() as tx:
        await tx.connection.execute(sa.insert(t).values(row))
    for scope in (repo.transaction, repo.autocommit):
        with pytest.raises(DuplicateItem, match="constraint violated"):
            async with scope() as tx:
                await tx.connection.execute(sa.insert(t).values(row))


async def test_a_failing_statement_in_a_read_is_a_storage_error_not_sqlalchemys(
    repo: SqlRepository,
) -> None:
    with pytest.raises(StorageError) as caught:
        async with repo.read() as tx:
            await tx.connection.execute(sa.text("SELECT * FROM no_such_table"))
    assert not isinstance(caught.value, sa.exc.SQLAlchemyError)
    assert caught.value.__cause__ is not None


async def test_a_raw_driver_error_in_a_statement_scope_is_translated(
    repo: SqlRepository,
) -> None:
    # What a connection used directly would raise (no SQLAlchemy wrapping).
    with pytest.raises(DatabaseUnavailable, match="statement: database unavailable"):
        async with repo.statement():
            raise sqlite3.OperationalError("database is locked")
    with pytest.raises(DuplicateItem, match="constraint violated"):
        async with repo.transaction():
            raise sqlite3.IntegrityError("UNIQUE constraint failed: tasks.id")
    # The scopes still work afterwards: nothing was left half-open.
    await repo.ping()


# --- the backoff itself ----------------------------------------------------------


async def test_loop_health_logs_a_streak_once_and_its_recovery_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pacer = Pacer()
    health = LoopHealth("probe", sleep=pacer)
    health.running = True
    caplog.set_level(logging.DEBUG)
    for _ in range(5):
        await health.backoff_after(DatabaseUnavailable("connect: database unavailable: x"))
    assert not health.healthy and health.failures == 5
    assert (
        health.snapshot()["last_error"] == "DatabaseUnavailable: connect: database unavailable: x"
    )
    health.succeeded()
    health.succeeded()
    assert health.healthy and health.total_failures == 5
    lines = _outage_lines(caplog, "probe")
    assert len(lines) == 2, lines
    assert "backing off" in lines[0] and "recovered after 5" in lines[1]
    # Full jitter within the growing, capped ceiling.
    for n, delay in enumerate(pacer.delays, start=1):
        ceiling = min(OUTAGE_BACKOFF.cap_seconds, OUTAGE_BACKOFF.base_seconds * 2 ** (n - 1))
        assert 0 <= delay <= ceiling


# --- the loops -------------------------------------------------------------------


async def test_the_relay_outlives_an_outage_and_delivers_afterwards(
    repo: SqlRepository, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    flaky = FlakyRepository(repo)
    delivered: list[Mapping[str, Any]] = []

    async def handle(payload: Mapping[str, Any]) -> None:
        delivered.append(payload)

    pacer = Pacer()
    relay = OutboxRelay(
        flaky,  # type: ignore[arg-type]
        {"note": handle},
        clock=clock,
        config=RelayConfig(poll_min_seconds=0.05, poll_max_seconds=0.1),
        sleep=pacer,
    )
    caplog.set_level(logging.DEBUG)
    async with anyio.create_task_group() as group:
        flaky.down = True  # even with an empty outbox, the first round fails
        await relay.start(group)
        await _until(
            "several failed rounds",
            lambda: relay.health.failures >= 5,
            lambda: relay.health.snapshot(),
        )
        assert relay.health.running
        flaky.down = False
        async with repo.transaction() as tx:
            await write_outbox(tx, [NewOutboxRow("note", {"n": 1})], clock.now())
        await _until(
            "the row delivered", lambda: len(delivered) == 1, lambda: relay.health.snapshot()
        )
        await _until("the recovery", lambda: relay.health.healthy, lambda: relay.health.snapshot())
        await relay.stop()
    assert delivered == [{"n": 1}]
    assert len(pacer.delays) >= 5 and flaky.refused >= 5
    lines = _outage_lines(caplog, "outbox relay")
    assert len(lines) == 2, lines  # the outage once, the recovery once
    assert "DatabaseUnavailable" in lines[0] and "recovered" in lines[1]
    async with repo.read() as tx:
        statuses = (await tx.connection.execute(sa.select(schema.outbox.c.status))).scalars()
        assert list(statuses) == ["Done"]


async def test_the_relay_keeps_finished_rows_whose_completion_failed(
    repo: SqlRepository, clock: ManualClock
) -> None:
    """The database goes away between handling a row and marking it done: the
    row is marked done once it is back, not lost to its lease."""
    flaky = FlakyRepository(repo)
    delivered: list[Mapping[str, Any]] = []

    async def handle(payload: Mapping[str, Any]) -> None:
        flaky.down = True  # the completion that follows fails
        delivered.append(payload)

    relay = OutboxRelay(
        flaky,  # type: ignore[arg-type]
        {"note": handle},
        clock=clock,
        config=RelayConfig(poll_min_seconds=0.05, poll_max_seconds=0.1),
        sleep=Pacer(),
    )
    async with repo.transaction() as tx:
        await write_outbox(tx, [NewOutboxRow("note", {"n": 2})], clock.now())
    async with anyio.create_task_group() as group:
        await relay.start(group)
        await _until(
            "a failed completion",
            lambda: relay.health.failures >= 2,
            lambda: relay.health.snapshot(),
        )
        flaky.down = False
        await _until("the recovery", lambda: relay.health.healthy, lambda: relay.health.snapshot())

        async def done() -> bool:
            async with repo.read() as tx:
                rows = await tx.connection.execute(sa.select(schema.outbox.c.status))
                return list(rows.scalars()) == ["Done"]

        await _until("the row marked done", done, lambda: delivered)
        await relay.stop()
    assert delivered == [{"n": 2}]  # handled once: no lease expired, no second delivery


async def test_a_periodic_service_outlives_an_outage_and_reaps_afterwards(
    repo: SqlRepository, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    tasks = TaskQueue(repo, clock=clock)
    job = await make_job(repo, clock.now())
    [created] = await tasks.create([NewTask(job, dedupe_key="reap-me")])
    claimed = await tasks.claim(created.task_id, "gone-worker", lease_seconds=5)
    assert claimed.lease is not None
    clock.advance(60)  # the lease has expired: the reaper's next good pass retries it

    flaky = FlakyRepository(repo)
    reaper = Reaper(
        flaky,  # type: ignore[arg-type]
        clock=clock,
        config=ReaperConfig(interval_seconds=0.05),
        tasks=TaskQueue(flaky, clock=clock),  # type: ignore[arg-type]
    )
    pacer = Pacer()
    reaper.health.sleep = pacer
    caplog.set_level(logging.DEBUG)

    async def status() -> str:
        async with repo.read() as tx:
            t = schema.tasks
            found = await tx.connection.execute(
                sa.select(t.c.status).where(t.c.id == created.task_id)
            )
            return str(found.scalar_one())

    async with anyio.create_task_group() as group:
        flaky.down = True
        await reaper.start(group)
        await _until(
            "several failed passes",
            lambda: reaper.health.failures >= 5,
            lambda: reaper.health.snapshot(),
        )
        assert await status() == "Running"
        flaky.down = False

        async def reaped() -> bool:
            return await status() != "Running"

        await _until("the expired lease reaped", reaped, status)
        await _until(
            "the recovery", lambda: reaper.health.healthy, lambda: reaper.health.snapshot()
        )
        await reaper.stop()
    assert not reaper.health.running
    assert len(pacer.delays) >= 5
    lines = _outage_lines(caplog, "Reaper")
    assert len(lines) == 2, lines
    assert "backing off" in lines[0] and "recovered" in lines[1]


# --- health endpoints ------------------------------------------------------------


async def test_readiness_shows_a_failing_service_which_restarts_by_itself(
    repo: SqlRepository, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A service failing for another reason than an outage (a bug) does not end:
    it backs off, ``/readyz`` answers 503 naming it, and once its pass succeeds
    again the process is ready again; ``/healthz`` answers throughout."""
    dispatcher = Dispatcher(repo, operators=OPERATORS, clock=clock)
    app = create_app(dispatcher, internal_token=TOKEN, run_dispatcher=True)
    pacer = Pacer()
    dispatcher.reaper.health.sleep = pacer
    passes = dispatcher.reaper.run_once
    broken = {"on": False}

    async def run_once() -> Any:
        if broken["on"]:
            raise RuntimeError("a bug in a pass")
        return await passes()

    dispatcher.reaper.run_once = run_once  # type: ignore[method-assign]
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://t", headers=AUTH) as client,
    ):

        async def ready() -> bool:
            return (await client.get("/readyz")).status_code == 200

        await _until("ready", ready, lambda: dispatcher.health())
        broken["on"] = True
        dispatcher.reaper.wake()
        await _until(
            "the reaper failing",
            lambda: dispatcher.reaper.health.failures >= 2,
            lambda: dispatcher.reaper.health.snapshot(),
        )
        answer = await client.get("/readyz")
        assert answer.status_code == 503 and answer.headers["Retry-After"] == "1"
        body = answer.json()
        assert body["database"] == "ok" and body["status"] == "not_ready"
        reaper = body["services"]["Reaper"]
        assert reaper["running"] and not reaper["healthy"]
        assert reaper["last_error"] == "RuntimeError"  # the type only, never the message
        assert all(s["running"] for s in body["services"].values())
        assert (await client.get("/healthz")).json() == {"status": "alive"}
        broken["on"] = False
        await _until("ready again", ready, lambda: dispatcher.health())
    assert not dispatcher.reaper.health.running
    assert len(_outage_lines(caplog, "Reaper")) == 2  # the failure once, the recovery once


# --- the worker loop of ``trace-lite worker`` ------------------------------------


async def test_the_worker_loop_waits_out_a_missing_server_and_carries_on(
    repo: SqlRepository, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing listens on the API's port at first: every claim fails, the loop
    logs that once and backs off; once the server is up, it claims and runs
    the waiting task by itself (``max_tasks=1`` then ends it)."""
    async with api_platform(repo, clock) as api:
        task_id = await api.trigger("while-down")
        port = _free_port()
        config = WorkerConfig(
            api=f"http://127.0.0.1:{port}",
            streams=(STREAM,),
            worker_id="outage-worker",
            max_tasks=1,
            max_wait_ms=500,
        )
        ran: list[str] = []

        def follow(ctx: Any) -> OperatorResult:
            ran.append(str(ctx.task_id))
            return OperatorResult()

        operators = OperatorRegistry([OperatorSpec("follow", follow, source=True)])
        pacer = Pacer()
        server = uvicorn.Server(
            uvicorn.Config(
                api.app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"
            )
        )
        caplog.set_level(logging.DEBUG)
        codes: list[int] = []

        async def work() -> None:
            codes.append(await run_worker(config, TOKEN, operators, sleep=pacer))

        async with anyio.create_task_group() as group:
            group.start_soon(work)
            await _until("claims failing", lambda: len(pacer.delays) >= 3, lambda: pacer.delays)
            group.start_soon(server.serve)
            await _until("the worker done", lambda: bool(codes), lambda: pacer.delays)
            server.should_exit = True
        assert codes == [0] and ran == [str(task_id)]
        assert (await api.task(task_id))["status"] == "Completed"
    lines = _outage_lines(caplog, "worker outage-worker")
    assert len(lines) == 2, lines  # the outage once, the recovery once
    assert "ControlPlaneUnavailable" in lines[0] and "recovered" in lines[1]


async def test_a_dispatcher_task_group_that_dies_anyway_stops_the_server(
    repo: SqlRepository, clock: ManualClock
) -> None:
    """No service loop lets an error out; should one do it all the same, the
    app's lifespan reports it (``trace-lite serve`` then stops its server and
    exits with the error) instead of serving with no Dispatcher behind it."""
    dispatcher = Dispatcher(repo, operators=OPERATORS, clock=clock)
    failures: list[BaseException] = []
    app = create_app(
        dispatcher, internal_token=TOKEN, run_dispatcher=True, on_dispatcher_failure=failures.append
    )

    async def broken_loop() -> None:
        raise RuntimeError("a loop that lets its error out")

    dispatcher.scaler.run = broken_loop  # type: ignore[method-assign]
    with anyio.fail_after(BOUND), pytest.raises(BaseExceptionGroup) as caught:
        async with app.router.lifespan_context(app):
            await anyio.sleep_forever()  # ended by the failing loop
    assert caught.group_contains(RuntimeError, match="lets its error out")
    assert len(failures) == 1
