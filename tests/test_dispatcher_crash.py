"""A crash between a commit and its side effect loses nothing, on both engines.

Each test runs a real OS process (``tests/crash_dispatcher.py``) that commits
and then SIGKILLs itself at the exact point before the side effect of that
commit happens; the parent then plays the restarted Dispatcher:

(a) events accepted, no routing ran: a fresh process routes them, and every
    expected task exists exactly once and is woken;
(b) the router committed the tasks of a ``route_event`` row, the row was not
    marked done: its lease expires, a new relay routes it again, and no
    task, ``task_inputs`` row or wake-up is created twice;
(c) tasks committed (directly, or by routing) and the wake-up was never
    delivered: the new relay delivers a wake-up for every created task.

Time: the child runs on a ``ManualClock`` fixed at the parent's "now", so a
lease it took expires exactly when the parent advances its own clock past
``RelayConfig.lease_seconds``. Nothing sleeps: the parent waits for the
child's exit with ``Popen.wait(timeout=...)``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import sqlalchemy as sa

from trace_core.authoring.events import DatasetEvent
from trace_core.clock import ManualClock
from trace_core.dag import DeployResult, deploy, parse_dag
from trace_core.dispatcher.events import ROUTE_EVENT, EventGateway, Producer
from trace_core.dispatcher.routing import EventRouter
from trace_core.outbox import OutboxRelay, RelayConfig
from trace_core.storage import schema
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import ENQUEUE_TASK, WAKEUP_CHUNK, TaskQueue

pytestmark = pytest.mark.anyio

SCRIPT = Path(__file__).with_name("crash_dispatcher.py")
CHILD_TIMEOUT = 120.0
"""Bound on one child's life; it needs a second or two."""
KILLED = -signal.SIGKILL
"""``Popen.returncode`` of a child that reached its crash point."""
DEPENDENTS = ("a", "b")
RETRY_STEP = 3600.0
"""Clock step past any outbox retry backoff (the default cap is 300 s)."""

DAG = """
dag: crash
jobs:
  - name: follow
    activation: source
    runtime: dispatcher
    operator: block_follower
    source: { kind: always_on }
    outputs: [ { dataset: blocks, kind: parquet } ]
    update_strategy: replace
  - name: a
    activation: reactive
    runtime: ecs_platform
    operator: range_aggregator
    execution_strategy: PerPartition
    inputs: [ { from: { dataset: blocks } } ]
    outputs: [ { dataset: a_out, kind: parquet } ]
    update_strategy: replace
  - name: b
    activation: reactive
    runtime: ecs_platform
    operator: range_aggregator
    execution_strategy: PerUpdate
    inputs: [ { from: { dataset: blocks } } ]
    outputs: [ { dataset: b_out, kind: parquet } ]
    update_strategy: replace
"""


def ranges(count: int, *, first: int = 0) -> list[tuple[int, int]]:
    """``count`` consecutive 100-block partitions starting at partition ``first``."""
    return [(i * 100, i * 100 + 99) for i in range(first, first + count)]


class World:
    """A deployed DAG whose source run is claimed, with a settled outbox."""

    def __init__(
        self, repo: SqlRepository, url: str, clock: ManualClock, deployed: DeployResult
    ) -> None:
        self.repo = repo
        self.url = url
        self.clock = clock
        self.deployed = deployed
        self.tasks = TaskQueue(repo, clock=clock)
        self.router = EventRouter(repo, clock=clock, tasks=self.tasks)
        self.producer: Producer | None = None
        self.setup_rows: set[int] = set()
        """Outbox rows of the setup (the source run's wake-up), all Done."""

    async def start(self) -> None:
        job = self.deployed.jobs["follow"]
        (run,) = await self.tasks.create([NewTask(job, dedupe_key=f"source-run:{job}")])
        outcome = await self.tasks.claim(run.task_id, "source-worker")
        assert outcome.lease is not None
        self.producer = Producer(run.task_id, outcome.lease.attempt)
        # Deliver the source run's own wake-up now: a child's relay must find
        # only the rows its test is about.
        woken = await self.drain_now()
        assert woken == [run.task_id]
        self.setup_rows = {r.id for r in await self.outbox()}

    def events(self, partitions: list[tuple[int, int]]) -> list[DatasetEvent]:
        p = self.deployed.datasets["blocks"]
        return [
            DatasetEvent(
                p.dataset_uuid, p.dataset_version, partition_key=f"{s}-{e}", start=s, end=e
            )
            for s, e in partitions
        ]

    async def accept(self, partitions: list[tuple[int, int]]) -> None:
        await EventGateway(self.repo, clock=self.clock).accept(
            self.events(partitions), producer=self.producer
        )

    def relay(self, woken: list[uuid.UUID]) -> OutboxRelay:
        """A new relay (a restarted Dispatcher's) that records every wake-up it delivers."""

        async def record(payload: Mapping[str, Any]) -> None:
            woken.extend(uuid.UUID(str(t)) for t in payload["task_ids"])

        return OutboxRelay(
            self.repo,
            {ROUTE_EVENT: self.router.handle, ENQUEUE_TASK: record},
            clock=self.clock,
            worker_id="restarted",
        )

    async def drain_now(self, woken: list[uuid.UUID] | None = None) -> list[uuid.UUID]:
        """Handle every row claimable now, without moving the clock; the tasks woken."""
        woken = [] if woken is None else woken
        relay = self.relay(woken)
        while await relay.run_once():
            pass
        return woken

    async def drain(self, woken: list[uuid.UUID]) -> None:
        """Handle rows until none is Pending or Processing, moving the clock past
        leases and retry backoffs whenever nothing is claimable."""
        relay = self.relay(woken)
        for _ in range(20):
            if await relay.run_once():
                continue
            if not await self.unfinished_outbox():
                return
            self.clock.advance(RETRY_STEP)
        pytest.fail(f"outbox not drained: {await self.outbox()}")

    def run_child(self, mode: str, tmp_path: Path, **config: Any) -> tuple[int, str]:
        """Run ``crash_dispatcher.py`` in ``mode`` to its end; (exit status, stderr)."""
        doc = {"url": self.url, "mode": mode, "now": self.clock.now().isoformat(), **config}
        if self.producer is not None:
            doc["producer_task_id"] = str(self.producer.task_id)
            doc["producer_attempt"] = self.producer.attempt
        p = self.deployed.datasets["blocks"]
        doc["dataset_uuid"], doc["dataset_version"] = str(p.dataset_uuid), str(p.dataset_version)
        log = tmp_path / f"{mode}-{uuid.uuid4().hex[:6]}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, str(SCRIPT), json.dumps(doc)],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
            try:
                code = proc.wait(timeout=CHILD_TIMEOUT)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        return code, log.read_text(encoding="utf-8", errors="replace")

    async def kill_child(self, mode: str, tmp_path: Path, **config: Any) -> None:
        """Run a child that must die by SIGKILL at its crash point."""
        code, output = await anyio.to_thread.run_sync(
            lambda: self.run_child(mode, tmp_path, **config)
        )
        assert code == KILLED, f"{mode}: exit status {code}, expected SIGKILL\n{output}"
        assert "crash point reached" in output, output

    # --- what the database holds ---------------------------------------------------

    async def dependent_tasks(self) -> list[Any]:
        t = schema.tasks
        jobs = [self.deployed.jobs[name] for name in DEPENDENTS]
        async with self.repo.read() as tx:
            rows = await tx.connection.execute(
                sa.select(t.c.id, t.c.job_id, t.c.dedupe_key, t.c.status).where(
                    t.c.job_id.in_(jobs)
                )
            )
            return list(rows)

    async def outbox(self, kind: str | None = None) -> list[Any]:
        o = schema.outbox
        stmt = sa.select(o.c.id, o.c.kind, o.c.status, o.c.attempts, o.c.payload).order_by(o.c.id)
        if kind is not None:
            stmt = stmt.where(o.c.kind == kind)
        async with self.repo.read() as tx:
            return list(await tx.connection.execute(stmt))

    async def wakeups(self) -> list[Any]:
        """The ``enqueue_task`` rows written after the setup."""
        return [r for r in await self.outbox(ENQUEUE_TASK) if r.id not in self.setup_rows]

    async def unfinished_outbox(self) -> list[Any]:
        return [r for r in await self.outbox() if r.status in ("Pending", "Processing")]

    async def events_by_status(self) -> Counter[str]:
        e = schema.events
        async with self.repo.read() as tx:
            rows = await tx.connection.execute(sa.select(e.c.route_status))
            return Counter(str(r[0]) for r in rows)

    async def task_inputs_count(self) -> int:
        ti = schema.task_inputs
        async with self.repo.read() as tx:
            count = await tx.connection.execute(sa.select(sa.func.count()).select_from(ti))
            return int(count.scalar_one())

    async def assert_routed_once(self, partitions: list[tuple[int, int]]) -> list[Any]:
        """Exactly one task per partition and dependent, each with its input rows."""
        tasks = await self.dependent_tasks()
        p = self.deployed.datasets["blocks"]
        expected = {
            (self.deployed.jobs[name], f"partition:{p.dataset_uuid}:{p.dataset_version}:{s}-{e}")
            for name in DEPENDENTS
            for s, e in partitions
        }
        keys = Counter((r.job_id, r.dedupe_key) for r in tasks)
        assert set(keys) == expected
        assert max(keys.values()) == 1, [k for k, n in keys.items() if n > 1][:5]
        assert await self.task_inputs_count() == len(expected)
        assert await self.events_by_status() == Counter({"routed": len(partitions)})
        e = schema.events
        async with self.repo.read() as tx:
            made = await tx.connection.execute(
                sa.select(e.c.tasks_created, sa.func.count()).group_by(e.c.tasks_created)
            )
            # Each event counted its tasks once, not once per routing pass.
            assert {int(r[0]): int(r[1]) for r in made} == {len(DEPENDENTS): len(partitions)}
        return tasks


@pytest.fixture
async def world(repo: SqlRepository, database_url: str, clock: ManualClock) -> World:
    deployed = await deploy(repo, parse_dag(DAG, file="crash.yaml"), clock=clock)
    w = World(repo, database_url, clock, deployed)
    await w.start()
    return w


async def test_accepted_events_survive_a_kill_before_routing(world: World, tmp_path: Path) -> None:
    """(a) Accept commits, the process dies: a fresh process routes every event."""
    partitions = ranges(600)
    # 600 distinct events and 100 redeliveries in one request: two route_event rows.
    sent = partitions + partitions[::6]
    await world.kill_child("accept_then_die", tmp_path, partitions=sent)

    assert await world.events_by_status() == Counter({"pending": len(partitions)})
    routes = await world.outbox(ROUTE_EVENT)
    assert [r.status for r in routes] == ["Pending", "Pending"]
    assert sum(len(r.payload["event_ids"]) for r in routes) == len(partitions)
    assert await world.dependent_tasks() == []

    woken_path = tmp_path / "woken.txt"
    code, output = await anyio.to_thread.run_sync(
        lambda: world.run_child("drain", tmp_path, woken_path=str(woken_path))
    )
    assert code == 0, output

    tasks = await world.assert_routed_once(partitions)
    assert await world.unfinished_outbox() == []
    woken = Counter(uuid.UUID(line) for line in woken_path.read_text().split())
    assert set(woken) == {r.id for r in tasks}


async def test_route_replayed_after_a_kill_creates_no_duplicates(
    world: World, tmp_path: Path
) -> None:
    """(b) The router commits, the relay dies before marking the row done."""
    first, second = ranges(300), ranges(200, first=300)
    await world.accept(first)
    await world.accept(second)
    routes = await world.outbox(ROUTE_EVENT)
    assert len(routes) == 2
    await world.kill_child("route_then_die", tmp_path)

    # The child routed the first row (oldest first) and died holding its lease.
    rows = {r.id: r for r in await world.outbox(ROUTE_EVENT)}
    in_flight = rows[routes[0].id]
    assert (in_flight.status, in_flight.attempts) == ("Processing", 1)
    assert rows[routes[1].id].status == "Pending"
    assert len(await world.dependent_tasks()) == len(first) * len(DEPENDENTS)
    assert {r.status for r in await world.wakeups()} == {"Pending"}

    # Restarted before the lease expires: the leased row is left alone, the rest is handled.
    woken: list[uuid.UUID] = []
    await world.drain_now(woken)
    rows = {r.id: r for r in await world.outbox(ROUTE_EVENT)}
    assert rows[routes[0].id].status == "Processing"
    assert rows[routes[1].id].status == "Done"

    # Past the lease: reclaimed, routed again (a no-op), marked done.
    world.clock.advance(RelayConfig().lease_seconds + 1)
    await world.drain(woken)
    rows = {r.id: r for r in await world.outbox(ROUTE_EVENT)}
    assert rows[routes[0].id].status == "Done"
    assert rows[routes[0].id].attempts == 2  # the child's claim, then the replay

    tasks = await world.assert_routed_once(first + second)
    # One wake-up per created task across all enqueue_task rows: the replay wrote none.
    wakeups = await world.wakeups()
    listed = Counter(uuid.UUID(t) for r in wakeups for t in r.payload["task_ids"])
    assert listed == Counter({r.id: 1 for r in tasks})
    per_routing = -(-len(first) * len(DEPENDENTS) // WAKEUP_CHUNK)
    per_routing += -(-len(second) * len(DEPENDENTS) // WAKEUP_CHUNK)
    assert len(wakeups) == per_routing
    assert set(woken) == {r.id for r in tasks}


@pytest.mark.parametrize("point", ["after_commit", "in_delivery"])
async def test_every_created_task_is_woken_after_a_kill(
    world: World, tmp_path: Path, point: str
) -> None:
    """(c) Tasks commit with their wake-up rows, the process dies before delivering."""
    if point == "after_commit":
        # TaskQueue.create commits tasks + wake-up rows; the child dies before any relay runs.
        count = WAKEUP_CHUNK + 100  # two wake-up rows
        await world.kill_child(
            "create_then_die", tmp_path, job_id=str(world.deployed.jobs["a"]), tasks=count
        )
        tasks = await world.dependent_tasks()
        assert len(tasks) == count
        wakeups = await world.wakeups()
        assert [r.status for r in wakeups] == ["Pending", "Pending"]
        assert {uuid.UUID(t) for r in wakeups for t in r.payload["task_ids"]} == {
            r.id for r in tasks
        }
    else:
        # The child's relay routes (tasks + wake-up rows commit), then claims the
        # wake-up rows and dies inside the handler, before delivering any.
        partitions = ranges(400)
        await world.accept(partitions)
        await world.kill_child("wake_then_die", tmp_path)
        tasks = await world.assert_routed_once(partitions)
    leased = {
        uuid.UUID(t)
        for r in await world.wakeups()
        if r.status == "Processing"
        for t in r.payload["task_ids"]
    }
    assert bool(leased) == (point == "in_delivery"), leased

    woken: list[uuid.UUID] = []
    await world.drain_now(woken)
    # Before the lease expires a claimed wake-up is the dead holder's: not redone yet.
    assert not leased & set(woken)
    world.clock.advance(RelayConfig().lease_seconds + 1)
    await world.drain(woken)

    assert await world.unfinished_outbox() == []
    created = {r.id for r in tasks}
    missing = created - set(woken)
    assert not missing, f"{len(missing)} of {len(created)} tasks never woken"
    assert all(r.status == "Queued" for r in await world.dependent_tasks())
