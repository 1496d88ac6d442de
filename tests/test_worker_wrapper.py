"""The worker wrapper on the in-process client, on both engines: wake-up ->
claim -> run -> emit -> complete, refusals, cancellation, stale leases,
outages, secrets; plus the retrying client on its own.

The helpers here (a deployed DAG, an injected heartbeat sleep, a flaky
client) are shared with ``test_worker_http.py`` and ``test_udf_isolation.py``.
"""

from __future__ import annotations

import math
import random
import threading
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import anyio
import anyio.to_thread
import pytest
import sqlalchemy as sa

import trace_core.worker
from tests.factories import claims_locked_first
from trace_core.authoring.context import OperatorError, OperatorResult, TaskContext
from trace_core.authoring.events import AcceptResult, DatasetEvent
from trace_core.authoring.operators import OperatorRegistry, OperatorSpec
from trace_core.clock import ManualClock
from trace_core.dag import DeployResult, parse_dag
from trace_core.dispatcher.control import TaskControl
from trace_core.dispatcher.inprocess import InProcessWakeupQueue
from trace_core.dispatcher.inprocess_client import InProcessClient
from trace_core.dispatcher.service import Dispatcher
from trace_core.errors import InvalidInput, StaleClaim
from trace_core.model import ClaimOutcome, Fence
from trace_core.retry import Backoff
from trace_core.storage import schema
from trace_core.storage.sql import SqlRepository
from trace_core.worker import (
    ClaimResult,
    ControlPlaneClient,
    ControlPlaneRejected,
    ControlPlaneUnavailable,
    HeartbeatResult,
    RetryingClient,
    WorkerWrapper,
)

pytestmark = pytest.mark.anyio

EXPIRE = 3600.0  # past any lease of the test DAG's jobs
BACKOFF = 3600.0  # past any retry backoff
WAIT = 20.0  # bound on every wait for a condition

DAG = """
dag: worker
jobs:
  - name: follow
    activation: source
    runtime: ecs_udf
    operator: follow
    source: { kind: manual }
    heartbeat_timeout_seconds: 60
    config: { n: 2, secrets: [API_KEY] }
    outputs: [ { dataset: blocks } ]
  - name: double
    activation: reactive
    runtime: ecs_platform
    operator: double
    execution_strategy: PerPartition
    inputs: [ { from: { dataset: blocks }, where: "n > 1" } ]
    outputs: [ { dataset: doubled } ]
"""


def _deployed_only(ctx: Any) -> None:
    raise AssertionError("the tests' workers run these operators, not the Dispatcher")


DEPLOYED = OperatorRegistry(
    [OperatorSpec("follow", _deployed_only, source=True), OperatorSpec("double", _deployed_only)]
)


@dataclass
class Platform:
    """A Dispatcher with a DAG deployed (nothing runs its tasks but the test's workers)."""

    dispatcher: Dispatcher
    deployed: DeployResult
    clock: ManualClock
    wakeups: InProcessWakeupQueue

    @property
    def control(self) -> TaskControl:
        return self.dispatcher.control

    def partition(self, start: int, end: int, dataset: str = "blocks") -> DatasetEvent:
        version = self.deployed.datasets[dataset]
        return DatasetEvent(
            version.dataset_uuid,
            version.dataset_version,
            partition_key=f"{start}-{end}",
            start=start,
            end=end,
        )

    async def trigger(self, key: str = "run-1") -> uuid.UUID:
        run = await self.dispatcher.manual.create_task("worker/follow", key)
        assert run.task_id is not None
        return run.task_id

    async def task(self, task_id: uuid.UUID) -> dict[str, Any]:
        t = schema.tasks
        async with self.dispatcher.repo.read() as tx:
            rows = await tx.connection.execute(sa.select(t).where(t.c.id == task_id))
            return dict(rows.mappings().one())

    async def tasks_of(self, job: str) -> list[dict[str, Any]]:
        t = schema.tasks
        async with self.dispatcher.repo.read() as tx:
            rows = await tx.connection.execute(
                sa.select(t).where(t.c.job_id == self.deployed.jobs[job]).order_by(t.c.queued_at)
            )
            return [dict(r) for r in rows.mappings()]

    async def events_of(self, task_id: uuid.UUID) -> list[tuple[str, int]]:
        """``(partition_key, producer_attempt)`` of every event the task produced."""
        e = schema.events
        async with self.dispatcher.repo.read() as tx:
            rows = await tx.connection.execute(
                sa.select(e.c.partition_key, e.c.producer_attempt)
                .where(e.c.producer_task_id == task_id)
                .order_by(e.c.partition_key)
            )
            return [(str(k), int(a)) for k, a in rows.all()]

    async def reclaim(self, task_id: uuid.UUID, worker: str = "worker-2") -> ClaimOutcome:
        """Expire the running attempt's lease, retry the task and claim attempt 2."""
        self.clock.advance(EXPIRE)
        await self.dispatcher.reaper.run_once()
        self.clock.advance(BACKOFF)
        await self.dispatcher.retries.run_once()
        outcome = await self.dispatcher.tasks.claim(task_id, worker)
        assert outcome.lease is not None and outcome.lease.attempt == 2, outcome
        return outcome


async def deploy_platform(repo: SqlRepository, clock: ManualClock, dag: str = DAG) -> Platform:
    wakeups = InProcessWakeupQueue()
    dispatcher = Dispatcher(repo, operators=DEPLOYED, clock=clock, wakeups=wakeups)
    deployed = await dispatcher.deploy(parse_dag(dag, operators=DEPLOYED.names()))
    return Platform(dispatcher, deployed, clock, wakeups)


@pytest.fixture
async def platform(repo: SqlRepository, clock: ManualClock) -> Platform:
    return await deploy_platform(repo, clock)


class Ticker:
    """The wrapper's injected sleep: records each delay asked for and returns
    only when the test calls :meth:`tick` (one tick, one heartbeat)."""

    def __init__(self) -> None:
        self.delays: list[float] = []
        self._send, self._receive = anyio.create_memory_object_stream[None](math.inf)
        self._slept = anyio.Event()

    async def sleep(self, seconds: float) -> None:
        self.delays.append(seconds)
        self._slept.set()
        self._slept = anyio.Event()
        await self._receive.receive()

    def tick(self) -> None:
        self._send.send_nowait(None)

    async def wait_for_sleeps(self, count: int) -> None:
        """Until the wrapper has gone to sleep ``count`` times (a heartbeat is
        done when the next sleep begins)."""
        with anyio.fail_after(WAIT):
            while len(self.delays) < count:
                await self._slept.wait()

    def close(self) -> None:
        self._send.close()
        self._receive.close()


@pytest.fixture
def ticker() -> Any:
    ticks = Ticker()
    yield ticks
    ticks.close()


class FlakyClient:
    """A client that fails the first ``failures[method]`` calls of a method as
    unavailable (an outage), then passes every call to ``inner``."""

    def __init__(self, inner: ControlPlaneClient, failures: Mapping[str, int]) -> None:
        self.inner = inner
        self.failures = dict(failures)
        self.calls: dict[str, int] = {}

    def _maybe_fail(self, method: str) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1
        if self.failures.get(method, 0) > 0:
            self.failures[method] -= 1
            raise ControlPlaneUnavailable(f"{method}: outage")

    async def claim(self, task_id: uuid.UUID, worker_id: str) -> ClaimResult:
        self._maybe_fail("claim")
        return await self.inner.claim(task_id, worker_id)

    async def fetch(self, task_id: uuid.UUID) -> dict[str, Any]:
        self._maybe_fail("fetch")
        return await self.inner.fetch(task_id)

    async def heartbeat(self, fence: Fence, capability_token: str | None = None) -> HeartbeatResult:
        self._maybe_fail("heartbeat")
        return await self.inner.heartbeat(fence, capability_token)

    async def emit(
        self, task_id: uuid.UUID, attempt: int, events: Sequence[DatasetEvent]
    ) -> AcceptResult:
        self._maybe_fail("emit")
        return await self.inner.emit(task_id, attempt, events)

    async def complete(
        self,
        fence: Fence,
        events: Sequence[DatasetEvent],
        outputs: Sequence[Mapping[str, Any]] | None,
    ) -> None:
        self._maybe_fail("complete")
        await self.inner.complete(fence, events, outputs)

    async def fail(self, fence: Fence, error: str, retryable: bool) -> None:
        self._maybe_fail("fail")
        await self.inner.fail(fence, error, retryable)

    async def report_canceled(self, task_id: uuid.UUID, attempt: int) -> None:
        self._maybe_fail("report_canceled")
        await self.inner.report_canceled(task_id, attempt)


class FakeTime:
    """An injected sleep and monotonic clock: sleeping only moves the clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def monotonic(self) -> float:
        return self.now


def retrying(inner: ControlPlaneClient, time: FakeTime, **kwargs: Any) -> RetryingClient:
    """A retrying client on fake time, with deterministic (jitter-free) backoff."""
    kwargs.setdefault("backoff", Backoff(base_seconds=0.5, factor=2.0, cap_seconds=4.0, jitter=0))
    return RetryingClient(inner, sleep=time.sleep, monotonic=time.monotonic, **kwargs)


async def no_heartbeat(seconds: float) -> None:
    """An injected sleep for tests that never want a heartbeat."""
    await anyio.sleep_forever()


def registry(
    follow: Callable[..., Any], double: Callable[..., Any] | None = None
) -> OperatorRegistry:
    return OperatorRegistry(
        [
            OperatorSpec("follow", follow, source=True),
            OperatorSpec("double", double or _deployed_only),
        ]
    )


def relay_partition(ctx: TaskContext) -> OperatorResult:
    """A synchronous operator (run in a thread): its input partition, on its output."""
    unit, out = ctx.inputs[0], ctx.outputs[0]
    event = DatasetEvent(
        uuid.UUID(out["dataset_uuid"]),
        uuid.UUID(out["dataset_version"]),
        partition_key=unit["partition_key"],
        start=unit["start"],
        end=unit["end"],
    )
    return OperatorResult(events=[event], outputs=[{"output_index": 0, "where": unit.get("where")}])


def wrapper_for(
    platform: Platform,
    follow: Callable[..., Any],
    double: Callable[..., Any] | None = None,
    *,
    client: ControlPlaneClient | None = None,
    **kwargs: Any,
) -> WorkerWrapper:
    """A wrapper on ``platform`` (in-process client unless given), with the
    job's declared secret, the platform's clock and no heartbeats by default."""
    kwargs.setdefault("secrets", {"API_KEY": "k-123"})
    kwargs.setdefault("sleep", no_heartbeat)
    kwargs.setdefault("worker_id", "worker-1")
    return WorkerWrapper(
        client or InProcessClient(platform.control),
        registry(follow, double),
        clock=platform.clock,
        **kwargs,
    )


async def wait_for(event: anyio.Event) -> None:
    with anyio.fail_after(WAIT):
        await event.wait()


# --- the happy path ------------------------------------------------------------


async def test_wakeup_runs_the_operator_emits_and_completes_then_downstream_runs(
    platform: Platform,
) -> None:
    seen: dict[str, Any] = {}

    async def follow(ctx: TaskContext) -> OperatorResult:
        seen.update(config=ctx.config, secrets=dict(ctx.secrets), directive=await ctx.directive())
        await ctx.emit([platform.partition(0, 9)])  # mid-task
        return OperatorResult(events=[platform.partition(10, 19)], outputs=[{"row_count": 20}])

    wrapper = wrapper_for(
        platform, follow, relay_partition, secrets={"API_KEY": "k-123", "OTHER": "not declared"}
    )
    task_id = await platform.trigger()
    assert await wrapper.handle_wakeup(task_id) == "completed"

    row = await platform.task(task_id)
    assert row["status"] == "Completed" and row["outputs"] == [{"row_count": 20}]
    assert await platform.events_of(task_id) == [("0-9", 1), ("10-19", 1)]
    assert seen == {
        "config": {"n": 2, "secrets": ["API_KEY"]},
        "secrets": {"API_KEY": "k-123"},  # declared only
        "directive": "run",
    }

    # The events are routed: one downstream task per partition, woken on its queue.
    await platform.dispatcher.run_once()
    downstream = await platform.tasks_of("double")
    assert sorted(t["partitions"][0] for t in downstream) == ["0-9", "10-19"]
    wakeups = await platform.wakeups.receive("trace-ecs-platform")
    assert set(wakeups) == {t["id"] for t in downstream}
    for wakeup in wakeups:  # the worker's receive loop
        assert await wrapper.handle_wakeup(wakeup) == "completed"
    done = await platform.tasks_of("double")
    assert {t["status"] for t in done} == {"Completed"}
    assert {t["outputs"][0]["where"] for t in done} == {"n > 1"}  # the input's filter


async def test_the_dispatchers_in_process_runner_is_the_wrapper(platform: Platform) -> None:
    runner = platform.dispatcher.runner
    assert isinstance(runner.wrapper, WorkerWrapper)
    assert isinstance(runner.wrapper.client, RetryingClient)
    assert isinstance(runner.wrapper.client.inner, InProcessClient)


# --- refusals and cancellation -------------------------------------------------


async def test_not_claimed_is_skipped_without_running_the_operator(platform: Platform) -> None:
    calls: list[str] = []
    wrapper = wrapper_for(platform, lambda ctx: calls.append("ran"))
    task_id = await platform.trigger()
    assert (await platform.dispatcher.tasks.claim(task_id, "someone-else")).lease is not None
    assert await wrapper.handle_wakeup(task_id) == "AlreadyRunning"
    assert await wrapper.handle_wakeup(uuid.uuid4()) == "NotFound"
    await platform.dispatcher.tasks.cancel([task_id])
    assert await wrapper.handle_wakeup(task_id) == "Canceled"
    assert calls == []


async def test_a_task_canceled_after_the_claim_is_reported_not_run(platform: Platform) -> None:
    tasks = platform.dispatcher.tasks

    async def claim_then_cancel(task_id: uuid.UUID, worker_id: str, **_: Any) -> ClaimOutcome:
        """A rollback that lands between the claim and the payload read."""
        outcome = await tasks.claim(task_id, worker_id)
        await tasks.cancel([task_id])
        return outcome

    racing = TaskControl(
        platform.dispatcher.repo, clock=platform.clock, tasks=tasks, claim=claim_then_cancel
    )
    calls: list[str] = []
    wrapper = wrapper_for(platform, lambda ctx: calls.append("ran"), client=InProcessClient(racing))
    task_id = await platform.trigger()
    assert await wrapper.handle_wakeup(task_id) == "canceled"
    assert calls == []
    assert (await platform.task(task_id))["status"] == "Canceled"
    assert await platform.events_of(task_id) == []


# --- stale leases ----------------------------------------------------------------


async def test_a_reclaim_seen_by_the_heartbeat_cancels_the_operator_and_writes_nothing(
    platform: Platform, ticker: Ticker
) -> None:
    started, release = anyio.Event(), anyio.Event()
    cancelled: list[bool] = []

    async def follow(ctx: TaskContext) -> OperatorResult:
        await ctx.emit([platform.partition(0, 9)])  # accepted: attempt 1 was current
        started.set()
        try:
            await release.wait()
        except anyio.get_cancelled_exc_class():
            cancelled.append(True)
            raise
        await ctx.emit([platform.partition(10, 19)])
        return OperatorResult(events=[platform.partition(20, 29)])

    wrapper = wrapper_for(platform, follow, sleep=ticker.sleep)
    task_id = await platform.trigger()
    outcome: list[str] = []
    async with anyio.create_task_group() as group:

        async def run() -> None:
            outcome.append(await wrapper.handle_wakeup(task_id))

        group.start_soon(run)
        await wait_for(started)
        second = await platform.reclaim(task_id)  # attempt 2 belongs to worker-2
        ticker.tick()  # the next heartbeat is refused as stale
    assert outcome == ["stale"] and cancelled == [True]
    row = await platform.task(task_id)
    assert second.lease is not None
    assert (row["status"], row["attempt"], row["lease_token"]) == (
        "Running",
        2,
        second.lease.lease_token,
    )
    assert await platform.events_of(task_id) == [("0-9", 1)]  # nothing after the reclaim


async def test_a_cancel_seen_by_an_emit_aborts_and_writes_nothing(platform: Platform) -> None:
    started, release = anyio.Event(), anyio.Event()
    after_emit: list[str] = []

    async def follow(ctx: TaskContext) -> OperatorResult:
        started.set()
        await release.wait()
        try:
            await ctx.emit([platform.partition(0, 9)])
        except StaleClaim:
            after_emit.append("stale")
            raise
        return OperatorResult()

    wrapper = wrapper_for(platform, follow)
    task_id = await platform.trigger()
    outcome: list[str] = []
    async with anyio.create_task_group() as group:

        async def run() -> None:
            outcome.append(await wrapper.handle_wakeup(task_id))

        group.start_soon(run)
        await wait_for(started)
        await platform.dispatcher.tasks.cancel([task_id])
        release.set()
    assert outcome == ["stale"] and after_emit == ["stale"]
    assert (await platform.task(task_id))["status"] == "Canceled"
    assert await platform.events_of(task_id) == []


async def test_an_abandoned_thread_cannot_write_after_its_lease_is_lost(
    platform: Platform, ticker: Ticker
) -> None:
    started, release, finished = threading.Event(), threading.Event(), threading.Event()
    late: list[str] = []

    def follow(ctx: TaskContext) -> OperatorResult:
        started.set()
        release.wait(WAIT)
        try:
            ctx.emit_blocking([platform.partition(0, 9)])
        except StaleClaim as exc:
            late.append(type(exc).__name__)
        finished.set()
        return OperatorResult(events=[platform.partition(10, 19)])

    wrapper = wrapper_for(platform, follow, sleep=ticker.sleep)
    task_id = await platform.trigger()
    outcome: list[str] = []
    async with anyio.create_task_group() as group:

        async def run() -> None:
            outcome.append(await wrapper.handle_wakeup(task_id))

        group.start_soon(run)
        assert await anyio.to_thread.run_sync(started.wait, WAIT)
        await platform.reclaim(task_id)
        ticker.tick()
    assert outcome == ["stale"]  # returned while the thread still runs
    release.set()
    assert await anyio.to_thread.run_sync(finished.wait, WAIT)
    assert late == ["StaleClaim"]  # refused locally: nothing reached the Dispatcher
    assert await platform.events_of(task_id) == []
    assert (await platform.task(task_id))["attempt"] == 2


# --- heartbeats ------------------------------------------------------------------


async def test_heartbeats_every_third_of_the_lease_and_extend_it(
    platform: Platform, ticker: Ticker
) -> None:
    started, release = anyio.Event(), anyio.Event()

    async def follow(ctx: TaskContext) -> None:
        started.set()
        await release.wait()

    wrapper = wrapper_for(platform, follow, sleep=ticker.sleep)
    task_id = await platform.trigger()
    outcome: list[str] = []
    async with anyio.create_task_group() as group:

        async def run() -> None:
            outcome.append(await wrapper.handle_wakeup(task_id))

        group.start_soon(run)
        await wait_for(started)
        first = (await platform.task(task_id))["lease_expires_at"]
        platform.clock.advance(15)
        for _ in range(2):
            ticker.tick()
        await ticker.wait_for_sleeps(3)  # the third sleep: two beats are done
        extended = (await platform.task(task_id))["lease_expires_at"]
        release.set()
    assert outcome == ["completed"]
    assert ticker.delays[:3] == [pytest.approx(20.0)] * 3  # 60 s lease / 3
    assert extended > first


# --- failures --------------------------------------------------------------------


async def test_operator_errors_fail_the_attempt_with_a_retry_or_terminally(
    platform: Platform,
) -> None:
    async def crash(ctx: TaskContext) -> None:
        raise RuntimeError("operator bug \x00 here")

    async def refuse(ctx: TaskContext) -> None:
        raise OperatorError("bad input, do not retry", retryable=False)

    first = await platform.trigger("a")
    crashing = wrapper_for(platform, crash)
    assert await crashing.handle_wakeup(first) == "failed"
    row = await platform.task(first)
    assert row["status"] == "Failed" and row["next_retry_at"] is not None
    assert row["error_message"] == "RuntimeError: operator bug \\x00 here"

    second = await platform.trigger("b")
    refusing = wrapper_for(platform, refuse)
    assert await refusing.handle_wakeup(second) == "failed"
    row = await platform.task(second)
    assert row["status"] == "Failed" and row["next_retry_at"] is None  # dead-lettered
    assert row["error_message"] == "bad input, do not retry"


async def test_a_missing_secret_or_operator_fails_before_running(platform: Platform) -> None:
    calls: list[str] = []
    first = await platform.trigger("a")
    no_secret = wrapper_for(platform, lambda ctx: calls.append("ran"), secrets=None)
    assert await no_secret.handle_wakeup(first) == "failed"
    row = await platform.task(first)
    assert "API_KEY" in row["error_message"] and row["next_retry_at"] is None

    second = await platform.trigger("b")
    no_operator = WorkerWrapper(
        InProcessClient(platform.control), OperatorRegistry(), worker_id="w", sleep=no_heartbeat
    )
    assert await no_operator.handle_wakeup(second) == "failed"
    row = await platform.task(second)
    assert "unknown operator 'follow'" in row["error_message"] and row["next_retry_at"] is not None
    assert calls == []


async def test_an_operator_over_its_time_limit_fails_retryably(platform: Platform) -> None:
    async def forever(ctx: TaskContext) -> None:
        await anyio.sleep_forever()

    wrapper = wrapper_for(platform, forever, timeout_seconds=0.05)
    task_id = await platform.trigger()
    assert await wrapper.handle_wakeup(task_id) == "failed"
    row = await platform.task(task_id)
    assert row["error_message"] == "timed out after 0.05s" and row["next_retry_at"] is not None


async def test_invalid_final_events_fail_the_attempt_for_good(platform: Platform) -> None:
    async def wrong_dataset(ctx: TaskContext) -> OperatorResult:
        return OperatorResult(events=[platform.partition(0, 9, dataset="doubled")])

    wrapper = wrapper_for(platform, wrong_dataset)
    task_id = await platform.trigger()
    assert await wrapper.handle_wakeup(task_id) == "failed"
    row = await platform.task(task_id)
    assert row["error_message"].startswith("invalid result: events[0].dataset_uuid")
    assert row["next_retry_at"] is None and await platform.events_of(task_id) == []


# --- outages ---------------------------------------------------------------------


async def test_the_wrapper_rides_out_an_outage_and_picks_up_where_it_was(
    platform: Platform, ticker: Ticker
) -> None:
    started, release = anyio.Event(), anyio.Event()

    async def follow(ctx: TaskContext) -> OperatorResult:
        await ctx.emit([platform.partition(0, 9)])
        started.set()
        await release.wait()
        return OperatorResult(events=[platform.partition(10, 19)])

    flaky = FlakyClient(
        InProcessClient(platform.control), {"claim": 2, "emit": 3, "heartbeat": 2, "complete": 4}
    )
    time = FakeTime()
    wrapper = wrapper_for(platform, follow, client=retrying(flaky, time), sleep=ticker.sleep)
    task_id = await platform.trigger()
    outcome: list[str] = []
    async with anyio.create_task_group() as group:

        async def run() -> None:
            outcome.append(await wrapper.handle_wakeup(task_id))

        group.start_soon(run)
        await wait_for(started)
        ticker.tick()  # a heartbeat through the outage
        await ticker.wait_for_sleeps(2)
        release.set()
    assert outcome == ["completed"]
    assert flaky.calls == {"claim": 3, "emit": 4, "heartbeat": 3, "complete": 5}
    # exponential: 0.5, 1, 2, then capped at 4; each call starts its own schedule
    assert time.slept == [0.5, 1.0, 0.5, 1.0, 2.0, 0.5, 1.0, 0.5, 1.0, 2.0, 4.0]
    assert (await platform.task(task_id))["status"] == "Completed"
    assert await platform.events_of(task_id) == [("0-9", 1), ("10-19", 1)]


async def test_an_unavailable_database_is_a_retryable_outage(
    platform: Platform, monkeypatch: pytest.MonkeyPatch
) -> None:
    claims_locked_first(monkeypatch, platform.control, 2)
    time = FakeTime()
    client = retrying(InProcessClient(platform.control), time)
    task_id = await platform.trigger()
    claimed = await client.claim(task_id, "w")
    assert claimed.claimed and claimed.attempt == 1 and time.slept == [0.5, 1.0]


async def test_a_completion_repeated_after_a_lost_answer_is_a_duplicate(
    platform: Platform,
) -> None:
    client = InProcessClient(platform.control)
    task_id = await platform.trigger()
    claim = await client.claim(task_id, "w")
    assert claim.lease_token is not None
    done = [platform.partition(0, 9)]
    await client.complete(Fence(task_id, 1, claim.lease_token), done, None)
    await client.complete(Fence(task_id, 1, claim.lease_token), done, None)  # no error, no change
    with pytest.raises(StaleClaim):
        await client.complete(Fence(task_id, 1, uuid.uuid4()), done, None)
    with pytest.raises(StaleClaim):
        await client.heartbeat(Fence(uuid.uuid4(), 1, claim.lease_token))  # no such task
    with pytest.raises(ControlPlaneRejected, match="not_canceled"):
        await client.report_canceled(task_id, 1)
    assert await platform.events_of(task_id) == [("0-9", 1)]


async def test_an_in_process_claim_fences_every_write_with_its_claim_version(
    platform: Platform,
) -> None:
    client = InProcessClient(platform.control)
    task_id = await platform.trigger()
    claim = await client.claim(task_id, "w")
    assert claim.claim_version is not None and claim.fence.claim_version == claim.claim_version
    older = replace(claim.fence, claim_version=claim.claim_version - 1)
    with pytest.raises(StaleClaim):
        await client.heartbeat(older)
    with pytest.raises(StaleClaim):
        await client.complete(older, [platform.partition(0, 9)], None)
    with pytest.raises(StaleClaim):
        await client.fail(older, "boom", retryable=True)
    assert await platform.events_of(task_id) == []
    await client.complete(claim.fence, [platform.partition(0, 9)], None)
    assert await platform.events_of(task_id) == [("0-9", 1)]


class _Refusing:
    """An inner client whose every call fails with ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.calls = 0

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        async def call(*args: Any) -> Any:
            self.calls += 1
            raise self.error

        return call


@pytest.mark.parametrize(
    "error",
    [
        StaleClaim("tasks", 1, "superseded"),
        ControlPlaneRejected(401, "unauthorized", "token"),
        InvalidInput("events[0].cursor", "must be >= 0"),
    ],
    ids=["stale", "4xx", "invalid"],
)
async def test_the_retrying_client_never_retries_an_answer(error: Exception) -> None:
    inner = _Refusing(error)
    time = FakeTime()
    client = retrying(inner, time)  # type: ignore[arg-type]
    with pytest.raises(type(error)):
        await client.heartbeat(Fence(uuid.uuid4(), 1, uuid.uuid4()))
    assert inner.calls == 1 and time.slept == []


async def test_the_retrying_client_gives_up_after_max_elapsed_and_honours_retry_after() -> None:
    inner = _Refusing(ControlPlaneUnavailable("down", retry_after=3.0))
    time = FakeTime()
    client = retrying(inner, time, max_elapsed_seconds=10.0)  # type: ignore[arg-type]
    with pytest.raises(ControlPlaneUnavailable):
        await client.claim(uuid.uuid4(), "w")
    assert time.slept == [3.0, 3.0, 3.0]  # Retry-After beats 0.5/1/2; a 4th passes 10 s
    assert inner.calls == 4


def test_backoff_has_full_jitter_by_default() -> None:
    jittered = RetryingClient(_Refusing(ValueError()), rng=random.Random(7))  # type: ignore[arg-type]
    delays = [jittered.backoff.delay(n, random.Random(n)).total_seconds() for n in range(1, 8)]
    assert all(0 <= d <= min(30.0, 0.5 * 2 ** (n - 1)) for n, d in enumerate(delays, 1))
    assert len(set(delays)) == len(delays)
    assert replace(jittered.backoff, jitter=0).delay(7).total_seconds() == 30.0


# --- the public surface ------------------------------------------------------------


def test_the_worker_package_exports_what_we_mean() -> None:
    assert set(trace_core.worker.__all__) == {
        "ABANDONED",
        "CANCELED",
        "COMPLETED",
        "DEFAULT_BACKOFF",
        "FAILED",
        "STALE",
        "Attempt",
        "AttemptSettings",
        "ClaimResult",
        "ControlPlaneClient",
        "ControlPlaneRejected",
        "ControlPlaneUnavailable",
        "CredentialSource",
        "HeartbeatResult",
        "HttpControlPlaneClient",
        "HttpCredentialSource",
        "HttpOperatorState",
        "OutageRetry",
        "RetryingClient",
        "UdfConfig",
        "UdfOperator",
        "WorkerWrapper",
        "child_environment",
        "run_udf",
    }
    for name in trace_core.worker.__all__:
        assert getattr(trace_core.worker, name) is not None
