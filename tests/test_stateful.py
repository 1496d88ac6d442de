"""Property-based test of the task lease protocol against a Python model.

A hypothesis ``RuleBasedStateMachine`` drives claims (by id and in batches),
heartbeats, fenced completions and failures (one by one and batched), clock
advances on a :class:`ManualClock`, the reaper (``reclaim_expired``), the
retry scheduler (``requeue_due``) and cancellations. Several simulated
workers keep every lease they were ever granted and keep writing with it,
so most writes late in an example are stale. Each rule predicts the outcome
from the model; after each step the database must equal the model and the
invariants of ARCHITECTURE.md hold:

1. at most one live lease per task; a claim of a leased task is refused
   (``AlreadyRunning``);
2. a write with a stale attempt / lease token / claim_version raises
   :class:`StaleClaim` and changes nothing (every row compared before/after);
8. a transition outside the lifecycle raises :class:`InvalidTransition` and
   changes nothing;

plus: the status is always in the lifecycle, ``attempt`` never exceeds
``max_attempts``, a terminal status never changes, and the contract's late
reply: a completion for the current attempt after the timeout mark is
accepted as long as no newer attempt was claimed, and refused as stale once
one was.

One event loop (a blocking portal) serves every step; each example gets a
fresh database (a copy of the migrated SQLite template, or a Postgres
database created from the migrated template) and drops it afterwards.
"""

from __future__ import annotations

import functools
import itertools
import shutil
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from random import Random
from typing import Any, TypeVar

import anyio.from_thread
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

from tests.factories import make_job
from trace_core.clock import ManualClock
from trace_core.errors import InvalidTransition, StaleClaim
from trace_core.leasing import LeaseConfig
from trace_core.model import Fence, Lease, NotClaimedReason
from trace_core.retry import Backoff, RetryClass, RetryPolicy
from trace_core.states import TASK_LIFECYCLE
from trace_core.storage import schema
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import TaskQueue

T = TypeVar("T")

N_TASKS = 3
WORKERS = ("w0", "w1", "w2")
LEASE_SECONDS = 10.0
BACKOFF = Backoff(base_seconds=1.0, factor=2.0, cap_seconds=4.0, jitter=0.0)
"""Deterministic: retry ``n`` waits ``min(4, 2**(n-1))`` seconds."""
TERMINAL = TASK_LIFECYCLE.terminal
COMPLETE_SOURCES = TASK_LIFECYCLE.sources_of("Completed")
"""Running, and the late-reply edges from Failed and Queued."""

SETTINGS = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


# --- environment: one event loop, a fresh database per example ----------------


@dataclass
class Env:
    """What every example of one test shares: the portal and a database factory."""

    engine: str
    portal: anyio.from_thread.BlockingPortal
    new_database: Callable[[], tuple[str, Callable[[], None]]]
    stats: Counter[str] = field(default_factory=Counter)

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        return self.portal.call(functools.partial(fn, *args, **kwargs))


@pytest.fixture(scope="module")
def portal() -> Iterator[anyio.from_thread.BlockingPortal]:
    with anyio.from_thread.start_blocking_portal("asyncio") as p:
        yield p


@pytest.fixture
def env(
    engine: str,
    portal: anyio.from_thread.BlockingPortal,
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
) -> Env:
    counter = itertools.count()
    if engine == "sqlite":
        template: Path = request.getfixturevalue("sqlite_template")
        directory = tmp_path_factory.mktemp("stateful")

        def new_sqlite() -> tuple[str, Callable[[], None]]:
            target = directory / f"example{next(counter)}.db"
            shutil.copyfile(template, target)

            def drop() -> None:
                for suffix in ("", "-wal", "-shm"):
                    Path(f"{target}{suffix}").unlink(missing_ok=True)

            return f"sqlite:///{target}", drop

        return Env(engine, portal, new_sqlite)

    server = request.getfixturevalue("postgres_server")

    def new_postgres() -> tuple[str, Callable[[], None]]:
        url: str = server.fresh_database()

        def drop() -> None:
            import psycopg
            from psycopg import sql

            name = url.rpartition("/")[2]
            with psycopg.connect(server.url("postgres"), autocommit=True) as conn:
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )

        return url, drop

    return Env(engine, portal, new_postgres)


# --- the model -----------------------------------------------------------------


@dataclass
class ModelTask:
    """What the database row of one task must look like."""

    id: uuid.UUID
    max_attempts: int
    status: str = "Queued"
    attempt: int = 1
    claim_version: int = 0
    token: uuid.UUID | None = None
    worker: str | None = None
    expires_at: datetime | None = None
    retry_at: datetime | None = None
    """Set while Failed and waiting for a retry; ``None`` once dead-lettered."""

    def is_current(self, lease: Lease, *, with_claim_version: bool) -> bool:
        """Whether a fence built from ``lease`` still names this task's claim."""
        return (
            lease.lease_token == self.token
            and lease.attempt == self.attempt
            and (not with_claim_version or lease.claim_version == self.claim_version)
        )

    def refusal(self) -> NotClaimedReason:
        """Why a claim by id is refused (the task is not Queued)."""
        if self.status == "Running":
            return NotClaimedReason.ALREADY_RUNNING
        if self.status == "Completed":
            return NotClaimedReason.COMPLETED
        if self.status == "Canceled":
            return NotClaimedReason.CANCELED
        assert self.status == "Failed"
        return NotClaimedReason.NOT_READY if self.retry_at else NotClaimedReason.DEAD_LETTERED


async def _open_repo(url: str) -> SqlRepository:
    return SqlRepository(url)


async def _rows(repo: SqlRepository) -> dict[uuid.UUID, Any]:
    async with repo.read() as tx:
        result = await tx.connection.execute(sa.select(schema.tasks).order_by(schema.tasks.c.id))
        return {row.id: row for row in result.all()}


async def _snapshot(repo: SqlRepository) -> tuple[Any, ...]:
    """Everything a refused write must leave alone: every task row, the outbox."""
    async with repo.read() as tx:
        conn = tx.connection
        tasks = (await conn.execute(sa.select(schema.tasks).order_by(schema.tasks.c.id))).all()
        outbox = (await conn.execute(sa.select(sa.func.count()).select_from(schema.outbox))).one()
    return (tuple(tuple(r) for r in tasks), tuple(outbox))


class LeaseMachine(RuleBasedStateMachine):
    """Tasks, workers holding (possibly stale) leases, a reaper and a clock."""

    leases = Bundle("leases")

    def __init__(self, env: Env) -> None:
        super().__init__()
        self.env = env
        self.url, self._drop = env.new_database()
        self.clock = ManualClock()
        self.repo = env.call(_open_repo, self.url)
        self.queue = TaskQueue(
            self.repo,
            clock=self.clock,
            config=LeaseConfig(lease_seconds=LEASE_SECONDS),
            retry=RetryPolicy(normal=BACKOFF),
            rng=Random(0),
        )
        self.tasks: dict[uuid.UUID, ModelTask] = {}
        self.order: list[uuid.UUID] = []
        self.granted: list[Lease] = []
        self.terminal: dict[uuid.UUID, str] = {}

    def teardown(self) -> None:
        try:
            self.env.call(self.repo.close)
        finally:
            self._drop()

    # --- helpers -----------------------------------------------------------

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        return self.env.call(fn, *args, **kwargs)

    def snapshot(self) -> tuple[Any, ...]:
        return self.call(_snapshot, self.repo)

    def now(self) -> datetime:
        return self.clock.now()

    def _set_status(self, m: ModelTask, status: str) -> None:
        assert m.id not in self.terminal, f"terminal task {m.id} moved to {status}"
        m.status = status
        if status in TERMINAL:
            self.terminal[m.id] = status

    def _granted(self, m: ModelTask, lease: Lease, worker: str) -> None:
        """Check a fresh lease against the model, then record the claim."""
        assert m.status == "Queued", m
        attempt = m.attempt if m.claim_version == 0 else m.attempt + 1
        assert lease.item_id == m.id
        assert lease.attempt == attempt
        assert lease.attempt <= m.max_attempts
        assert lease.claim_version == m.claim_version + 1
        assert lease.worker_id == worker
        assert lease.max_attempts == m.max_attempts
        assert lease.expires_at == self.now() + timedelta(seconds=LEASE_SECONDS)
        assert all(lease.lease_token != g.lease_token for g in self.granted)
        self._set_status(m, "Running")
        m.attempt = attempt
        m.claim_version = lease.claim_version
        m.token = lease.lease_token
        m.worker = worker
        m.expires_at = lease.expires_at
        self.granted.append(lease)
        self.env.stats["claims"] += 1

    def _fence(self, lease: Lease, with_claim_version: bool) -> Fence:
        # HTTP callers present only attempt + lease token.
        if with_claim_version:
            return lease.fence
        return Fence(lease.item_id, lease.attempt, lease.lease_token)

    def _refused(
        self, expected: type[Exception] | None, write: Callable[[], T]
    ) -> tuple[bool, T | None]:
        """Run ``write``; if ``expected`` is an error, it must raise it and change nothing."""
        before = self.snapshot()
        try:
            result = write()
        except (StaleClaim, InvalidTransition) as exc:
            assert expected is not None and isinstance(exc, expected), (expected, exc)
            assert self.snapshot() == before, "a refused write changed the database"
            self.env.stats[f"refused {type(exc).__name__}"] += 1
            return False, None
        assert expected is None, f"expected {expected.__name__}, the write was accepted"
        return True, result

    # --- rules -------------------------------------------------------------

    @initialize(max_attempts=st.lists(st.integers(1, 3), min_size=N_TASKS, max_size=N_TASKS))
    def create_tasks(self, max_attempts: list[int]) -> None:
        job = self.call(make_job, self.repo, self.now())
        created = self.call(
            self.queue.create,
            [NewTask(job, dedupe_key=f"t{i}", max_attempts=n) for i, n in enumerate(max_attempts)],
        )
        assert all(c.created for c in created)
        for c, n in zip(created, max_attempts, strict=True):
            self.tasks[c.task_id] = ModelTask(c.task_id, n)
            self.order.append(c.task_id)

    @rule(target=leases, worker=st.sampled_from(WORKERS), index=st.integers(0, N_TASKS - 1))
    def claim_by_id(self, worker: str, index: int) -> Any:
        m = self.tasks[self.order[index]]
        before = self.snapshot()
        outcome = self.call(self.queue.claim, m.id, worker)
        if m.status == "Queued":
            assert outcome.claimed and outcome.lease is not None, outcome
            self._granted(m, outcome.lease, worker)
            return multiple(outcome.lease)
        assert not outcome.claimed and outcome.reason == m.refusal(), (outcome, m)
        assert self.snapshot() == before, "a refused claim changed the database"
        self.env.stats[f"claim refused {outcome.reason.value}"] += 1
        return multiple()

    @rule(target=leases, worker=st.sampled_from(WORKERS), limit=st.integers(1, N_TASKS + 1))
    def claim_batch(self, worker: str, limit: int) -> Any:
        queued = {i for i, m in self.tasks.items() if m.status == "Queued"}
        got = self.call(self.queue.claim_batch, worker, limit)
        ids = [lease.item_id for lease in got]
        assert len(ids) == len(set(ids)) == min(limit, len(queued)), (ids, queued)
        assert set(ids) <= queued
        for lease in got:
            self._granted(self.tasks[lease.item_id], lease, worker)
        return multiple(*got)

    @rule(lease=leases, with_cv=st.booleans())
    def heartbeat(self, lease: Lease, with_cv: bool) -> None:
        m = self.tasks[lease.item_id]
        live = m.is_current(lease, with_claim_version=with_cv) and m.status == "Running"
        ok, expires = self._refused(
            None if live else StaleClaim,
            lambda: self.call(self.queue.heartbeat, self._fence(lease, with_cv)),
        )
        if ok:
            assert expires == self.now() + timedelta(seconds=LEASE_SECONDS)
            m.expires_at = expires

    @rule(lease=leases, with_cv=st.booleans())
    def complete(self, lease: Lease, with_cv: bool) -> None:
        m = self.tasks[lease.item_id]
        expected: type[Exception] | None = None
        if not m.is_current(lease, with_claim_version=with_cv):
            expected = StaleClaim
        elif m.status not in COMPLETE_SOURCES:
            expected = InvalidTransition
        late = m.status != "Running"
        ok, _ = self._refused(
            expected, lambda: self.call(self.queue.complete, self._fence(lease, with_cv))
        )
        if ok:
            # A late reply (after the timeout mark or the worker's own failure)
            # is accepted only here: no newer attempt was claimed.
            self.env.stats["late reply accepted" if late else "completed"] += 1
            self._set_status(m, "Completed")
            m.expires_at = None
        elif expected is StaleClaim and lease.attempt < m.attempt:
            self.env.stats["late reply refused (newer attempt)"] += 1

    @rule(leases=st.lists(leases, min_size=1, max_size=3))
    def complete_many(self, leases: list[Lease]) -> None:
        # The batch is fenced by (id, lease token, attempt) and the source status.
        expected = {
            lease.item_id
            for lease in leases
            if self.tasks[lease.item_id].is_current(lease, with_claim_version=False)
            and self.tasks[lease.item_id].status in COMPLETE_SOURCES
        }
        before = self.snapshot()
        done = self.call(self.queue.complete_many, [lease.fence for lease in leases])
        assert done == expected
        if not done:
            assert self.snapshot() == before
        for item_id in done:
            m = self.tasks[item_id]
            self._set_status(m, "Completed")
            m.expires_at = None
        self.env.stats["complete_many accepted"] += len(done)

    @rule(lease=leases, with_cv=st.booleans(), fatal=st.booleans())
    def fail(self, lease: Lease, with_cv: bool, fatal: bool) -> None:
        m = self.tasks[lease.item_id]
        expected: type[Exception] | None = None
        if not m.is_current(lease, with_claim_version=with_cv):
            expected = StaleClaim
        elif not TASK_LIFECYCLE.allows(m.status, "Failed"):
            expected = InvalidTransition
        ok, outcome = self._refused(
            expected,
            lambda: self.call(
                self.queue.fail,
                self._fence(lease, with_cv),
                "boom",
                retry_class=RetryClass.FATAL if fatal else RetryClass.RETRYABLE,
            ),
        )
        if ok:
            assert outcome is not None
            retrying = not fatal and m.attempt < m.max_attempts
            assert (outcome.status, outcome.retrying) == ("Failed", retrying)
            self._to_failed(m, retrying)

    def _to_failed(self, m: ModelTask, retrying: bool) -> None:
        self._set_status(m, "Failed")
        m.expires_at = None
        m.retry_at = self.now() + BACKOFF.delay(m.attempt) if retrying else None
        self.env.stats["failed, retrying" if retrying else "dead-lettered"] += 1

    @rule(seconds=st.sampled_from([1.0, 3.0, 9.0, LEASE_SECONDS + 1]))
    def advance_clock(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule()
    def reclaim_expired(self) -> None:
        now = self.now()
        expired = [
            m
            for m in self.tasks.values()
            if m.status == "Running" and m.expires_at is not None and m.expires_at < now
        ]
        report = self.call(self.queue.reclaim_expired)
        retried = {m.id for m in expired if m.attempt < m.max_attempts}
        assert set(report.retried) == retried
        assert set(report.dead_lettered) == {m.id for m in expired} - retried
        for m in expired:
            self._to_failed(m, m.id in retried)
        self.env.stats["reclaimed"] += len(expired)

    @rule()
    def expire_and_reclaim(self) -> None:
        """The timeout mark for every current lease (a shortcut of the two above)."""
        self.advance_clock(LEASE_SECONDS + 1)
        self.reclaim_expired()

    @rule()
    def requeue_due(self) -> None:
        now = self.now()
        due = {
            m.id
            for m in self.tasks.values()
            if m.status == "Failed" and m.retry_at is not None and m.retry_at <= now
        }
        moved = self.call(self.queue.requeue_due)
        assert set(moved) == due and len(moved) == len(due)
        for item_id in due:
            m = self.tasks[item_id]
            self._set_status(m, "Queued")
            m.retry_at = None
        self.env.stats["requeued"] += len(due)

    @rule(indexes=st.sets(st.integers(0, N_TASKS - 1), min_size=1, max_size=2))
    def cancel(self, indexes: set[int]) -> None:
        targets = [self.tasks[self.order[i]] for i in sorted(indexes)]
        sources = TASK_LIFECYCLE.sources_of("Canceled")
        expected = {m.id for m in targets if m.status in sources}
        canceled = self.call(self.queue.cancel, [m.id for m in targets])
        assert canceled == expected
        for m in targets:
            if m.id in canceled:
                self._set_status(m, "Canceled")
                m.claim_version += 1  # fences out the holder
                m.expires_at = None
        self.env.stats["canceled"] += len(canceled)

    # --- invariants --------------------------------------------------------

    @invariant()
    def database_matches_model(self) -> None:
        if not self.tasks:
            return
        rows = self.call(_rows, self.repo)
        assert set(rows) == set(self.tasks)
        for item_id, m in self.tasks.items():
            row = rows[item_id]
            assert row.status in TASK_LIFECYCLE.statuses
            assert 1 <= row.attempt <= row.max_attempts == m.max_attempts
            assert (row.status, row.attempt, row.claim_version, row.lease_token) == (
                m.status,
                m.attempt,
                m.claim_version,
                m.token,
            ), (row, m)
            if row.status == "Running":
                assert (row.lease_expires_at, row.worker_id) == (m.expires_at, m.worker)
            else:
                assert row.lease_expires_at is None
            if row.status == "Failed":
                assert row.next_retry_at == m.retry_at
            if row.status == "Queued":
                assert row.next_retry_at is None
            if item_id in self.terminal:
                assert row.status == self.terminal[item_id]

    @invariant()
    def at_most_one_live_lease_per_task(self) -> None:
        live = Counter(
            lease.item_id
            for lease in self.granted
            if self.tasks[lease.item_id].is_current(lease, with_claim_version=True)
            and self.tasks[lease.item_id].status == "Running"
        )
        assert all(n == 1 for n in live.values()), live
        running = {i for i, m in self.tasks.items() if m.status == "Running"}
        assert set(live) == running


def test_lease_protocol_state_machine(env: Env) -> None:
    run_state_machine_as_test(lambda: LeaseMachine(env), settings=SETTINGS)
    print(f"\nstateful ({env.engine}): {dict(sorted(env.stats.items()))}")
    # The run reached the interesting corners, not only the happy path.
    for key in ("refused StaleClaim", "refused InvalidTransition", "late reply accepted"):
        assert env.stats[key] > 0, (key, env.stats)
