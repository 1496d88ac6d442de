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

The directed tests at the end pin the rarer corners on every run, and one
shows a trace_core bug the machine found (a fence with ``attempt=0``).
"""

from __future__ import annotations

import dataclasses
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
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
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
from trace_testing.postgres import PostgresServer

T = TypeVar("T")

N_TASKS = 5
WORKERS = ("w0", "w1", "w2")
LEASE_SECONDS = 10.0
BACKOFF = Backoff(base_seconds=1.0, factor=2.0, cap_seconds=4.0, jitter=0.0)
"""Deterministic: retry ``n`` waits ``min(4, 2**(n-1))`` seconds."""
TERMINAL = TASK_LIFECYCLE.terminal
"""Completed and Canceled. A dead-lettered task (Failed without a retry time)
is not terminal in the lifecycle table: when the reaper dead-lettered it (the
timeout mark), it still accepts the late reply of its last attempt (Failed ->
Completed). Cancellation only takes unfinished tasks, so it leaves a
dead-lettered one (and its error) alone."""
COMPLETE_SOURCES = TASK_LIFECYCLE.sources_of("Completed")
"""Running, and the late-reply edges from Failed and Queued (only with the
timeout mark: an attempt that ended by its own failure report is over)."""

FENCE_SHAPES = st.sampled_from(
    [
        *["lease"] * 5,
        "no claim_version",
        "attempt+1",
        "attempt-1",
        "claim_version+1",
        "claim_version-1",
        "other token",
    ]
)
"""How a worker's write is fenced; mostly its lease as granted."""

SETTINGS = settings(
    max_examples=30,
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
    """An empty database for one example: its URL and how to give it back."""
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
) -> Iterator[Env]:
    if engine == "sqlite":
        template: Path = request.getfixturevalue("sqlite_template")
        directory = tmp_path_factory.mktemp("stateful")
        counter = itertools.count()

        def new_sqlite() -> tuple[str, Callable[[], None]]:
            target = directory / f"example{next(counter)}.db"
            shutil.copyfile(template, target)

            def drop() -> None:
                for suffix in ("", "-wal", "-shm"):
                    Path(f"{target}{suffix}").unlink(missing_ok=True)

            return f"sqlite:///{target}", drop

        yield Env(engine, portal, new_sqlite)
        return

    server: PostgresServer = request.getfixturevalue("postgres_server")

    def borrow() -> tuple[str, Callable[[], None]]:
        url = server.acquire()
        return url, functools.partial(server.release, url)

    yield Env(engine, portal, borrow)


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
    """The lease expiry while Running; kept as the timeout mark when the
    reaper failed the attempt (until the next claim), else ``None``."""
    retry_at: datetime | None = None
    """Set while Failed and waiting for a retry; ``None`` once dead-lettered."""

    def is_current(self, fence: Fence | Lease) -> bool:
        """Whether ``fence`` still names this task's claim (``claim_version``
        only when presented)."""
        return (
            fence.lease_token == self.token
            and fence.attempt == self.attempt
            and (fence.claim_version is None or fence.claim_version == self.claim_version)
        )

    def may_finish(self) -> bool:
        """Whether the current attempt may still complete: it runs, or the
        reaper marked it timed out and no newer attempt started."""
        return self.status == "Running" or (
            self.status in COMPLETE_SOURCES and self.expires_at is not None
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


@dataclass(frozen=True)
class Snapshot:
    """Everything a refused write must leave alone: every task row, the outbox size."""

    tasks: dict[uuid.UUID, Any]
    outbox_rows: int


async def _snapshot(repo: SqlRepository) -> Snapshot:
    async with repo.read() as tx:
        conn = tx.connection
        tasks = (await conn.execute(sa.select(schema.tasks))).all()
        outbox = (await conn.execute(sa.select(sa.func.count()).select_from(schema.outbox))).one()
    return Snapshot({row.id: row for row in tasks}, int(outbox[0]))


class LeaseMachine(RuleBasedStateMachine):
    """Tasks, workers holding (possibly stale) leases, a reaper and a clock."""

    def __init__(self, env: Env) -> None:
        super().__init__()
        self.env = env
        self.url, self._release = env.new_database()
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
        self._snapshot: Snapshot | None = None

    def teardown(self) -> None:
        try:
            self.env.call(self.repo.close)
        finally:
            self._release()

    # --- helpers -----------------------------------------------------------

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """Run a repository operation (it may write: the snapshot is dropped)."""
        self._snapshot = None
        return self.env.call(fn, *args, **kwargs)

    def snapshot(self) -> Snapshot:
        """The database now; read once per state (operations drop it)."""
        if self._snapshot is None:
            self._snapshot = self.env.call(_snapshot, self.repo)
        return self._snapshot

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

    @staticmethod
    def _fence(lease: Lease, shape: str) -> Fence:
        """The fence a worker presents: its lease's, without ``claim_version``
        (HTTP callers present only attempt + lease token), or forged in one
        column so that each fence column is shown to be checked on its own."""
        fence = lease.fence
        if shape == "no claim_version":
            return dataclasses.replace(fence, claim_version=None)
        if shape == "attempt+1":
            return dataclasses.replace(fence, attempt=fence.attempt + 1)
        if shape == "attempt-1":
            return dataclasses.replace(fence, attempt=fence.attempt - 1)
        if shape == "claim_version+1":
            return dataclasses.replace(fence, claim_version=lease.claim_version + 1)
        if shape == "claim_version-1":
            return dataclasses.replace(fence, claim_version=lease.claim_version - 1)
        if shape == "other token":
            return dataclasses.replace(fence, lease_token=uuid.uuid4())
        assert shape == "lease"
        return fence

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

    @initialize(max_attempts=st.lists(st.integers(1, 4), min_size=N_TASKS, max_size=N_TASKS))
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

    def _held(self, data: st.DataObject, shape: str = "lease") -> Lease:
        """A lease some worker still holds (newest first: more of them are current).

        A forged fence is built from the task's current lease when it has one:
        forging a stale lease would prove nothing about the forged column.
        """
        lease = data.draw(st.sampled_from(self.granted[::-1]), label="held lease")
        if shape != "lease":
            m = self.tasks[lease.item_id]
            current = [g for g in self.granted if g.item_id == m.id and m.is_current(g)]
            if current:
                return current[0]
        return lease

    @rule(worker=st.sampled_from(WORKERS), index=st.integers(0, N_TASKS - 1))
    def claim_by_id(self, worker: str, index: int) -> None:
        m = self.tasks[self.order[index]]
        before = self.snapshot()
        outcome = self.call(self.queue.claim, m.id, worker)
        if m.status == "Queued":
            assert outcome.claimed and outcome.lease is not None, outcome
            self._granted(m, outcome.lease, worker)
            return
        assert not outcome.claimed and outcome.reason == m.refusal(), (outcome, m)
        assert self.snapshot() == before, "a refused claim changed the database"
        self.env.stats[f"claim refused {outcome.reason.value}"] += 1

    @rule(worker=st.sampled_from(WORKERS), limit=st.integers(1, N_TASKS + 1))
    def claim_batch(self, worker: str, limit: int) -> None:
        queued = {i for i, m in self.tasks.items() if m.status == "Queued"}
        got = self.call(self.queue.claim_batch, worker, limit)
        ids = [lease.item_id for lease in got]
        assert len(ids) == len(set(ids)) == min(limit, len(queued)), (ids, queued)
        assert set(ids) <= queued
        for lease in got:
            self._granted(self.tasks[lease.item_id], lease, worker)

    @precondition(lambda self: bool(self.granted))
    @rule(data=st.data(), shape=FENCE_SHAPES)
    def heartbeat(self, data: st.DataObject, shape: str) -> None:
        lease = self._held(data, shape)
        m = self.tasks[lease.item_id]
        fence = self._fence(lease, shape)
        live = m.is_current(fence) and m.status == "Running"
        ok, expires = self._refused(
            None if live else StaleClaim, lambda: self.call(self.queue.heartbeat, fence)
        )
        if ok:
            assert expires == self.now() + timedelta(seconds=LEASE_SECONDS)
            m.expires_at = expires

    @precondition(lambda self: bool(self.granted))
    @rule(data=st.data(), shape=FENCE_SHAPES)
    def complete(self, data: st.DataObject, shape: str) -> None:
        self._complete(self._held(data, shape), shape)

    def _complete(self, lease: Lease, shape: str) -> None:
        m = self.tasks[lease.item_id]
        fence = self._fence(lease, shape)
        expected: type[Exception] | None = None
        if not m.is_current(fence):
            expected = StaleClaim
        elif m.status not in COMPLETE_SOURCES:
            expected = InvalidTransition
        elif not m.may_finish():
            expected = StaleClaim  # ended by its own failure report: over
        late = m.status != "Running"
        ok, _ = self._refused(expected, lambda: self.call(self.queue.complete, fence))
        if ok:
            # A late reply (after the timeout mark) is accepted only here: no
            # newer attempt was claimed.
            self.env.stats["late reply accepted" if late else "completed"] += 1
            self._set_status(m, "Completed")
            m.expires_at = None
            m.retry_at = None  # the late reply supersedes a scheduled retry
        elif shape == "lease" and expected is StaleClaim and lease.attempt < m.attempt:
            self.env.stats["late reply refused (newer attempt)"] += 1

    @precondition(lambda self: bool(self.granted))
    @rule(data=st.data(), shapes=st.lists(FENCE_SHAPES, min_size=1, max_size=3))
    def complete_many(self, data: st.DataObject, shapes: list[str]) -> None:
        fences = [self._fence(self._held(data, shape), shape) for shape in shapes]
        # The batch is fenced like a single write: (id, attempt, lease token,
        # claim_version when presented) and the source status with its mark.
        expected = {
            fence.item_id
            for fence in fences
            if self.tasks[fence.item_id].is_current(fence)
            and self.tasks[fence.item_id].may_finish()
        }
        before = self.snapshot()
        done = self.call(self.queue.complete_many, fences)
        assert done == expected
        if not done:
            assert self.snapshot() == before
        for item_id in done:
            m = self.tasks[item_id]
            late = m.status != "Running"
            self.env.stats["late reply accepted" if late else "completed"] += 1
            self._set_status(m, "Completed")
            m.expires_at = None

    @precondition(lambda self: bool(self.granted))
    @rule(data=st.data(), shape=FENCE_SHAPES, fatal=st.booleans())
    def fail(self, data: st.DataObject, shape: str, fatal: bool) -> None:
        lease = self._held(data, shape)
        m = self.tasks[lease.item_id]
        fence = self._fence(lease, shape)
        expected: type[Exception] | None = None
        if not m.is_current(fence):
            expected = StaleClaim
        elif not TASK_LIFECYCLE.allows(m.status, "Failed"):
            expected = InvalidTransition
        ok, outcome = self._refused(
            expected,
            lambda: self.call(
                self.queue.fail,
                fence,
                "boom",
                retry_class=RetryClass.FATAL if fatal else RetryClass.RETRYABLE,
            ),
        )
        if ok:
            assert outcome is not None
            retrying = not fatal and m.attempt < m.max_attempts
            assert (outcome.status, outcome.retrying) == ("Failed", retrying)
            self._to_failed(m, retrying)

    def _to_failed(self, m: ModelTask, retrying: bool, *, timed_out: bool = False) -> None:
        self._set_status(m, "Failed")
        if not timed_out:
            m.expires_at = None  # the holder's own report ends the attempt
        m.retry_at = self.now() + BACKOFF.delay(m.attempt) if retrying else None
        self.env.stats["failed, retrying" if retrying else "dead-lettered"] += 1

    @rule(seconds=st.sampled_from([1.0, 3.0, 9.0, LEASE_SECONDS + 1]))
    def advance_clock(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule(wait_out_lease=st.booleans())
    def reclaim_expired(self, wait_out_lease: bool) -> None:
        """The reaper; first waiting out every current lease, or not."""
        if wait_out_lease:
            self.clock.advance(LEASE_SECONDS + 1)
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
            self._to_failed(m, m.id in retried, timed_out=True)
        self.env.stats["reclaimed"] += len(expired)

    @rule(wait_out_backoff=st.booleans())
    def requeue_due(self, wait_out_backoff: bool) -> None:
        """The retry scheduler; first waiting out the longest backoff, or not."""
        if wait_out_backoff:
            self.clock.advance(BACKOFF.cap_seconds)
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

    def _running(self) -> list[uuid.UUID]:
        return [i for i in self.order if self.tasks[i].status == "Running"]

    @precondition(lambda self: bool(self._running()))
    @rule(
        data=st.data(),
        then=st.sampled_from(["reply", "requeue, reply", "requeue, claim, reply"]),
        worker=st.sampled_from(WORKERS),
    )
    def late_reply(self, data: st.DataObject, then: str, worker: str) -> None:
        """A holder overruns its lease and the reaper marks the timeout; the
        retry may go back to Queued and may be claimed again; then the holder's
        reply arrives: accepted unless a newer attempt was claimed."""
        item_id = data.draw(st.sampled_from(self._running()), label="overrunning task")
        m = self.tasks[item_id]
        (lease,) = [g for g in self.granted if m.is_current(g)]
        self.reclaim_expired(wait_out_lease=True)
        if "requeue" in then:
            self.requeue_due(wait_out_backoff=True)
        if "claim" in then:
            self.claim_by_id(worker, self.order.index(item_id))
        self._complete(lease, shape="lease")

    @rule(index=st.integers(0, N_TASKS - 1))
    def cancel(self, index: int) -> None:
        """Administrative cancellation (unfenced); fences the holder out."""
        m = self.tasks[self.order[index]]
        unfinished = m.status in TASK_LIFECYCLE.sources_of("Canceled") and not (
            m.status == "Failed" and m.retry_at is None
        )
        expected = {m.id} if unfinished else set()
        canceled = self.call(self.queue.cancel, [m.id])
        assert canceled == expected
        if canceled:
            self._set_status(m, "Canceled")
            m.claim_version += 1  # fences out the holder
            m.expires_at = None
        self.env.stats["canceled"] += len(canceled)

    # --- invariants --------------------------------------------------------

    @invariant()
    def database_matches_model(self) -> None:
        if not self.tasks:
            return
        rows = self.snapshot().tasks
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
            assert row.lease_expires_at == m.expires_at, (row, m)
            if row.status == "Running":
                assert row.worker_id == m.worker
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
            if self.tasks[lease.item_id].is_current(lease)
            and self.tasks[lease.item_id].status == "Running"
        )
        assert all(n == 1 for n in live.values()), live
        running = {i for i, m in self.tasks.items() if m.status == "Running"}
        assert set(live) == running


def test_lease_protocol_state_machine(env: Env) -> None:
    run_state_machine_as_test(lambda: LeaseMachine(env), settings=SETTINGS)
    print(f"\nstateful ({env.engine}): {dict(sorted(env.stats.items()))}")
    # The run reached the interesting corners, not only the happy path.
    # (Only the corners every run reaches by a wide margin; the rarer ones have
    # the directed tests below.)
    for key in ("refused StaleClaim", "refused InvalidTransition", "late reply accepted"):
        assert env.stats[key] > 0, (key, env.stats)


# --- directed tests: the rarer corners, every run -------------------------------


async def _task_row(repo: SqlRepository, task_id: uuid.UUID) -> Any:
    async with repo.read() as tx:
        query = sa.select(schema.tasks).where(schema.tasks.c.id == task_id)
        return (await tx.connection.execute(query)).one()


async def _queue_with_tasks(
    repo: SqlRepository, clock: ManualClock, n: int, *, max_attempts: int = 3
) -> tuple[TaskQueue, list[uuid.UUID]]:
    queue = TaskQueue(
        repo,
        clock=clock,
        config=LeaseConfig(lease_seconds=LEASE_SECONDS),
        retry=RetryPolicy(normal=BACKOFF),
    )
    job = await make_job(repo, clock.now())
    created = await queue.create(
        [NewTask(job, dedupe_key=f"d{i}", max_attempts=max_attempts) for i in range(n)]
    )
    return queue, [c.task_id for c in created]


@pytest.mark.anyio
async def test_late_reply_is_accepted_until_a_newer_attempt_is_claimed(
    repo: SqlRepository, clock: ManualClock
) -> None:
    """interface-contracts.md: a late reply for the current attempt is accepted
    after the timeout mark while no newer attempt has started."""
    queue, (after_timeout, after_requeue, after_reclaim) = await _queue_with_tasks(repo, clock, 3)
    leases = {lease.item_id: lease for lease in await queue.claim_batch("w1", 3)}
    clock.advance(LEASE_SECONDS + 1)
    assert set((await queue.reclaim_expired()).retried) == set(leases)
    assert (await _task_row(repo, after_timeout)).status == "Failed"

    # Marked timed out, retry pending: the reply is accepted.
    await queue.complete(leases[after_timeout].fence)
    assert (await _task_row(repo, after_timeout)).status == "Completed"

    # Back to Queued, nobody claimed it yet: still accepted.
    clock.advance(BACKOFF.cap_seconds)
    assert set(await queue.requeue_due()) == {after_requeue, after_reclaim}
    await queue.complete(leases[after_requeue].fence)
    assert (await _task_row(repo, after_requeue)).status == "Completed"

    # A newer attempt was claimed: the late reply is stale and changes nothing.
    newer = await queue.claim(after_reclaim, "w2")
    assert newer.lease is not None and newer.lease.attempt == 2
    before = await _task_row(repo, after_reclaim)
    for fence in (
        leases[after_reclaim].fence,
        Fence(after_reclaim, 1, leases[after_reclaim].lease_token),  # HTTP shape
    ):
        with pytest.raises(StaleClaim):
            await queue.complete(fence)
        assert await _task_row(repo, after_reclaim) == before
    await queue.complete(newer.lease.fence)
    assert (await _task_row(repo, after_reclaim)).status == "Completed"


@pytest.mark.anyio
async def test_a_leased_task_is_not_claimed_again(repo: SqlRepository, clock: ManualClock) -> None:
    """Invariant 1, including after the lease ran out but before the reaper ran."""
    queue, (task_id,) = await _queue_with_tasks(repo, clock, 1)
    first = await queue.claim(task_id, "w1")
    assert first.lease is not None
    for _ in range(2):
        second = await queue.claim(task_id, "w2")
        assert (second.lease, second.reason) == (None, NotClaimedReason.ALREADY_RUNNING)
        assert await queue.claim_batch("w2", 5) == []
        clock.advance(LEASE_SECONDS + 1)  # expired, not yet reclaimed
    await queue.heartbeat(first.lease.fence)  # the holder is still the holder


@pytest.mark.anyio
async def test_fail_with_attempt_zero_is_refused_as_stale(
    repo: SqlRepository, clock: ManualClock
) -> None:
    """Found by the state machine: a fence with ``attempt=0`` (never current,
    attempts are 1-based) is refused as stale like any other (invariant 2),
    not with an error from computing its retry backoff."""
    queue, (task_id,) = await _queue_with_tasks(repo, clock, 1)
    lease = (await queue.claim_batch("w1", 1))[0]
    before = await _task_row(repo, task_id)
    forged = Fence(task_id, 0, lease.lease_token, lease.claim_version)
    with pytest.raises(StaleClaim):
        await queue.fail(forged, "boom")
    assert await _task_row(repo, task_id) == before
