"""Backpressure: the pure pause propagation (hypothesis), then the monitor on both engines."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import anyio
import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.factories import JobDef, build_dag, queue_tasks, run_on_separate_repos, stable_id
from trace_core.clock import ManualClock
from trace_core.dag import deploy, live_jobs, parse_dag
from trace_core.dispatcher.backpressure import BackpressureMonitor
from trace_core.dispatcher.backpressure_plan import (
    PAUSE_PREFIX,
    BackpressureConfig,
    JobGraph,
    JobNode,
    Level,
    QueueMeasurement,
    Thresholds,
    evaluate_pressure,
    plan_backpressure,
)
from trace_core.dispatcher.job_states import read_pause
from trace_core.dispatcher.journal import read_journal
from trace_core.errors import ConfigurationError
from trace_core.storage import schema
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import TaskQueue

# --- the pure propagation ---------------------------------------------------------

CONFIG = BackpressureConfig()


def _node(name: str, inputs: Sequence[str] = (), *, tier: str = "normal", **th: Any) -> JobNode:
    return JobNode(
        job_id=stable_id("node", name),
        dag_name="d",
        job_name=name,
        priority_tier=tier,
        input_datasets=tuple(inputs),
        output_datasets=(name,),
        thresholds=Thresholds(**th) if th else None,
    )


def test_a_tripped_queue_pauses_every_producer_upstream() -> None:
    src, mid = _node("src"), _node("mid", ["src"])
    side = _node("side")  # not upstream of agg
    agg = _node("agg", ["mid"], max_queue_depth=1000)
    plan = plan_backpressure([src, mid, side, agg], {agg.job_id: QueueMeasurement(1200)}, CONFIG)
    assert set(plan.pauses) == {src.job_id, mid.job_id}
    assert plan.pauses[mid.job_id].reason == (PAUSE_PREFIX + "queue depth 1200 > 1000 at job d/agg")


def test_depth_at_the_threshold_does_not_trip_normal_producers() -> None:
    src, agg = _node("src"), _node("agg", ["src"], max_queue_depth=10)
    assert plan_backpressure([src, agg], {agg.job_id: QueueMeasurement(10)}, CONFIG).pauses == {}


def test_hysteresis_keeps_a_paused_producer_until_below_the_resume_fraction() -> None:
    src, agg = _node("src"), _node("agg", ["src"], max_queue_depth=10)
    jobs = [src, agg]

    def paused(depth: int, now: set[uuid.UUID]) -> set[uuid.UUID]:
        return set(
            plan_backpressure(
                jobs, {agg.job_id: QueueMeasurement(depth)}, CONFIG, paused=now
            ).pauses
        )

    assert paused(11, set()) == {src.job_id}
    assert paused(9, {src.job_id}) == {src.job_id}  # 9 >= 8: held
    assert paused(8, {src.job_id}) == {src.job_id}
    assert paused(7, {src.job_id}) == set()  # below 80% of 10: resumes
    assert paused(9, set()) == set()  # and 9 does not pause it again


def test_age_trips_and_clears_without_depth_hysteresis() -> None:
    src, agg = _node("src"), _node("agg", ["src"], max_queue_age_seconds=60.0)
    jobs = [src, agg]
    tripped = plan_backpressure(jobs, {agg.job_id: QueueMeasurement(1, 61.0)}, CONFIG)
    assert tripped.pauses[src.job_id].reason == PAUSE_PREFIX + "queue age 61s > 60s at job d/agg"
    held = plan_backpressure(
        jobs, {agg.job_id: QueueMeasurement(1, 60.0)}, CONFIG, paused={src.job_id}
    )
    assert set(held.pauses) == {src.job_id}
    cleared = plan_backpressure(
        jobs, {agg.job_id: QueueMeasurement(1, 59.0)}, CONFIG, paused={src.job_id}
    )
    assert cleared.pauses == {}


def test_bulk_producers_are_shed_first() -> None:
    bulk = _node("backfill", tier="bulk")
    normal = _node("live")
    agg = _node("agg", ["backfill", "live"], max_queue_depth=10)
    jobs = [bulk, normal, agg]

    def paused(depth: int) -> set[uuid.UUID]:
        return set(plan_backpressure(jobs, {agg.job_id: QueueMeasurement(depth)}, CONFIG).pauses)

    assert paused(4) == set()
    assert paused(5) == {bulk.job_id}  # reaches 50% of 10
    assert paused(11) == {bulk.job_id, normal.job_id}
    reason = plan_backpressure(jobs, {agg.job_id: QueueMeasurement(5)}, CONFIG).pauses[bulk.job_id]
    assert (
        reason.reason == PAUSE_PREFIX + "queue depth 5 >= 5 (bulk shed at 50% of 10) at job d/agg"
    )


def test_a_producer_of_two_tripped_jobs_names_both() -> None:
    src = _node("src")
    a = _node("a", ["src"], max_queue_depth=10)
    b = _node("b", ["src"], max_queue_depth=10)
    plan = plan_backpressure(
        [src, a, b], {a.job_id: QueueMeasurement(11), b.job_id: QueueMeasurement(20)}, CONFIG
    )
    assert plan.pauses[src.job_id].reason == (
        PAUSE_PREFIX + "queue depth 11 > 10 at job d/a; queue depth 20 > 10 at job d/b"
    )
    only_b = plan_backpressure(
        [src, a, b],
        {a.job_id: QueueMeasurement(0), b.job_id: QueueMeasurement(20)},
        CONFIG,
        paused={src.job_id},
    )
    assert only_b.pauses[src.job_id].cause_labels == {"d/b"}


def test_cycles_terminate_and_a_job_never_pauses_itself() -> None:
    a = JobNode(stable_id("a"), "d", "a", input_datasets=("b",), output_datasets=("a",))
    b = JobNode(
        stable_id("b"),
        "d",
        "b",
        input_datasets=("a",),
        output_datasets=("b",),
        thresholds=Thresholds(max_queue_depth=1),
    )
    plan = plan_backpressure([a, b], {b.job_id: QueueMeasurement(5)}, CONFIG)
    assert set(plan.pauses) == {a.job_id}


def test_config_and_thresholds_are_validated() -> None:
    for bad in (
        {"resume_fraction": 0},
        {"resume_fraction": 1.5},
        {"bulk_shed_fraction": 0},
        {"bulk_handicap_seconds": -1},
        {"interval_seconds": 0},
    ):
        with pytest.raises(ConfigurationError):
            BackpressureConfig(**bad)
    for doc in ({"max_queue_depth": 0}, {"max_queue_depth": "9"}, {"max_queue_age_seconds": -1}):
        with pytest.raises(ConfigurationError):
            Thresholds.from_json(doc)
    with pytest.raises(ConfigurationError):
        Thresholds.from_json([1])
    assert Thresholds.from_json(None) is None
    assert Thresholds.from_json({}) is None
    assert Thresholds.from_json({"max_queue_depth": 5}) == Thresholds(5, None)


def test_handicap_by_tier() -> None:
    config = BackpressureConfig(bulk_handicap_seconds=120)
    assert config.handicap_seconds("bulk") == 120
    assert config.handicap_seconds("normal") == 0
    with pytest.raises(ConfigurationError):
        config.handicap_seconds("urgent")


# hypothesis: random DAGs (edges only from earlier to later jobs), thresholds,
# measurements and currently paused sets.


@st.composite
def scenarios(
    draw: st.DrawFn,
) -> tuple[list[JobNode], dict[uuid.UUID, QueueMeasurement], set[uuid.UUID], BackpressureConfig]:
    n = draw(st.integers(min_value=2, max_value=8))
    jobs: list[JobNode] = []
    for i in range(n):
        inputs = (
            draw(st.sets(st.integers(min_value=0, max_value=i - 1), max_size=3)) if i else set()
        )
        depth = draw(st.integers(min_value=1, max_value=20) | st.none())
        age = draw(st.none() | st.integers(min_value=1, max_value=100))
        if i and depth is None and age is None and draw(st.integers(0, 3)):
            depth = draw(st.integers(min_value=1, max_value=20))
        jobs.append(
            JobNode(
                job_id=stable_id("hyp", str(i)),
                dag_name="h",
                job_name=f"j{i}",
                priority_tier=draw(st.sampled_from(["normal", "bulk"])),
                input_datasets=tuple(f"d{k}" for k in sorted(inputs)),
                output_datasets=(f"d{i}",),
                thresholds=Thresholds(depth, None if age is None else float(age))
                if depth or age
                else None,
            )
        )
    # Measurements cluster around the thresholds, where the levels change.
    fractions = st.sampled_from([0.0, 0.2, 0.4, 0.45, 0.5, 0.6, 0.8, 0.9, 1.0, 1.1, 2.0])
    measurements = {}
    for j in jobs:
        if j.thresholds is None or not draw(st.integers(0, 3)):
            continue
        depth_of = j.thresholds.max_queue_depth or draw(st.integers(min_value=0, max_value=30))
        age_of = j.thresholds.max_queue_age_seconds or draw(st.integers(min_value=0, max_value=150))
        measurements[j.job_id] = QueueMeasurement(
            round(depth_of * draw(fractions)), float(round(age_of * draw(fractions)))
        )
    paused = {j.job_id for j in jobs if draw(st.booleans())}
    config = BackpressureConfig(
        resume_fraction=draw(st.sampled_from([0.5, 0.8, 1.0])),
        bulk_shed_fraction=draw(st.sampled_from([0.25, 0.5, 1.0])),
    )
    return jobs, measurements, paused, config


def _descendants(jobs: Sequence[JobNode]) -> dict[uuid.UUID, set[uuid.UUID]]:
    """Every job downstream of each job, by a plain fixpoint (independent of JobGraph)."""
    readers = {
        j.job_id: {k.job_id for k in jobs if set(k.input_datasets) & set(j.output_datasets)}
        for j in jobs
    }
    down = {j: set(r) for j, r in readers.items()}
    changed = True
    while changed:
        changed = False
        for j in down:
            more = set().union(*(down[k] for k in down[j])) - down[j]
            if more:
                down[j] |= more
                changed = True
    return {j: d - {j} for j, d in down.items()}


def _oracle(
    job: JobNode, m: QueueMeasurement, config: BackpressureConfig
) -> tuple[Level | None, Level | None]:
    """(trip, hold) levels, straight from the definitions."""
    th = job.thresholds
    if th is None:
        return None, None
    d, a = th.max_queue_depth, th.max_queue_age_seconds
    s, r = config.bulk_shed_fraction, config.resume_fraction

    def hit(depth_at: float | None, age_at: float | None, strict: bool) -> bool:
        if strict:
            return (depth_at is not None and m.depth > depth_at) or (
                age_at is not None and m.age_seconds > age_at
            )
        return (depth_at is not None and m.depth >= depth_at) or (
            age_at is not None and m.age_seconds >= age_at
        )

    def scaled(x: float | None, f: float) -> float | None:
        return None if x is None else x * f

    trip = (
        Level.NORMAL
        if hit(d, a, True)
        else Level.BULK
        if hit(scaled(d, s), scaled(a, s), False)
        else None
    )
    hold = (
        Level.NORMAL
        if hit(scaled(d, r), a, False)
        else Level.BULK
        if hit(scaled(d, r * s), scaled(a, s), False)
        else None
    )
    return trip, hold


def _sheds(level: Level | None, tier: str) -> bool:
    return level is Level.NORMAL or (level is Level.BULK and tier == "bulk")


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_pauses_are_exactly_the_producers_of_pressured_queues(
    scenario: tuple[
        list[JobNode], dict[uuid.UUID, QueueMeasurement], set[uuid.UUID], BackpressureConfig
    ],
) -> None:
    jobs, measurements, paused_now, config = scenario
    plan = plan_backpressure(jobs, measurements, config, paused=paused_now)
    down = _descendants(jobs)
    levels = {
        j.job_id: _oracle(j, measurements.get(j.job_id, QueueMeasurement()), config) for j in jobs
    }
    for job in jobs:
        trip, hold = levels[job.job_id]
        pressure = plan.pressures.get(job.job_id)
        got = (pressure.trip, pressure.hold) if pressure else (None, None)
        assert got == (trip, hold)
        if trip is Level.NORMAL:
            assert hold is Level.NORMAL  # a trip always holds
        if trip is not None:
            assert hold is not None
    for job in jobs:
        tripping = {d for d in down[job.job_id] if _sheds(levels[d][0], job.priority_tier)}
        holding = {d for d in down[job.job_id] if _sheds(levels[d][1], job.priority_tier)}
        expected = bool(tripping) or (job.job_id in paused_now and bool(holding))
        # A paused job always has a pressured job downstream, and a job with
        # none is never paused; a tripped queue downstream always pauses it.
        assert (job.job_id in plan.pauses) == expected
        if job.job_id in plan.pauses:
            causes = {c.job_id for c in plan.pauses[job.job_id].causes}
            assert causes == (holding | tripping if job.job_id in paused_now else tripping)
            assert plan.pauses[job.job_id].reason.startswith(PAUSE_PREFIX)


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_hysteresis_only_keeps_pauses_and_is_a_fixed_point(
    scenario: tuple[
        list[JobNode], dict[uuid.UUID, QueueMeasurement], set[uuid.UUID], BackpressureConfig
    ],
) -> None:
    jobs, measurements, paused_now, config = scenario
    fresh = set(plan_backpressure(jobs, measurements, config).pauses)
    with_memory = set(plan_backpressure(jobs, measurements, config, paused=paused_now).pauses)
    # Being paused never pauses anyone new: it only keeps pauses.
    assert fresh <= with_memory <= fresh | paused_now
    # Applying a round's decision and measuring again changes nothing.
    assert set(plan_backpressure(jobs, measurements, config, paused=fresh).pauses) == fresh


def test_evaluate_pressure_of_an_empty_queue_is_none() -> None:
    job = _node("agg", max_queue_depth=1, max_queue_age_seconds=1.0)
    assert evaluate_pressure(job, QueueMeasurement(), CONFIG) is None
    assert JobGraph([job]).upstream(stable_id("nope")) == []


# --- the monitor on both engines ------------------------------------------------

CHAIN = [
    JobDef("src", outputs=("raw",)),
    JobDef("mid", inputs=("raw",), outputs=("clean",)),
    JobDef("agg", inputs=("clean",), outputs=("totals",), backpressure={"max_queue_depth": 10}),
]


async def journal_of(repo: SqlRepository, job_id: uuid.UUID) -> list[tuple[str, str]]:
    async with repo.read() as tx:
        entries = await read_journal(tx, job_id)
    return [(e["kind"], e["message"]) for e in reversed(entries)]


async def job_state(repo: SqlRepository, job_id: uuid.UUID) -> tuple[bool, str | None]:
    async with repo.read() as tx:
        return await read_pause(tx, job_id)


@pytest.mark.anyio
async def test_monitor_pauses_resumes_and_journals_transitions_once(
    repo: SqlRepository, clock: ManualClock
) -> None:
    ids = await build_dag(repo, clock.now(), CHAIN)
    tq = TaskQueue(repo, clock=clock)
    monitor = BackpressureMonitor(repo, clock=clock)
    tasks = await queue_tasks(tq, ids["agg"], 12)

    report = await monitor.run_once()
    assert sorted(report.paused, key=str) == sorted([ids["src"], ids["mid"]], key=str)
    assert report.measurements[ids["agg"]].depth == 12
    reason = PAUSE_PREFIX + "queue depth 12 > 10 at job dex/agg"
    assert await monitor.paused_jobs() == {ids["src"]: reason, ids["mid"]: reason}
    assert await job_state(repo, ids["agg"]) == (False, None)

    await monitor.run_once()  # no transition: no new journal entries
    await tq.cancel(tasks[:3])  # depth 9: held (>= 8)
    assert (await monitor.run_once()).resumed == []
    assert await job_state(repo, ids["mid"]) == (True, reason)

    await tq.cancel(tasks[3:5])  # depth 7: resumes
    report = await monitor.run_once()
    assert set(report.resumed) == {ids["src"], ids["mid"]}
    assert await monitor.paused_jobs() == {}
    await monitor.run_once()
    assert await journal_of(repo, ids["mid"]) == [
        ("paused", reason),
        ("resumed", "backpressure cleared; was queue depth 12 > 10 at job dex/agg"),
    ]


@pytest.mark.anyio
async def test_monitor_trips_on_age_from_the_injected_clock(
    repo: SqlRepository, clock: ManualClock
) -> None:
    jobs = [
        JobDef("src", outputs=("raw",)),
        JobDef("agg", inputs=("raw",), backpressure={"max_queue_age_seconds": 60}),
    ]
    ids = await build_dag(repo, clock.now(), jobs)
    tq = TaskQueue(repo, clock=clock)
    monitor = BackpressureMonitor(repo, clock=clock)
    [task] = await queue_tasks(tq, ids["agg"], 1)
    clock.advance(30)
    assert (await monitor.run_once()).paused == []
    clock.advance(31)
    report = await monitor.run_once()
    assert report.paused == [ids["src"]]
    assert report.measurements[ids["agg"]].age_seconds == 61
    assert (await monitor.paused_jobs())[ids["src"]] == (
        PAUSE_PREFIX + "queue age 61s > 60s at job dex/agg"
    )
    assert (await tq.claim(task, "w1")).claimed  # the queue is empty now
    assert (await monitor.run_once()).resumed == [ids["src"]]


@pytest.mark.anyio
async def test_a_producer_paused_by_two_jobs_waits_for_both(
    repo: SqlRepository, clock: ManualClock
) -> None:
    jobs = [
        JobDef("src", outputs=("raw",)),
        JobDef("a", inputs=("raw",), backpressure={"max_queue_depth": 2}),
        JobDef("b", inputs=("raw",), backpressure={"max_queue_depth": 2}),
    ]
    ids = await build_dag(repo, clock.now(), jobs)
    tq = TaskQueue(repo, clock=clock)
    monitor = BackpressureMonitor(repo, clock=clock)
    a_tasks = await queue_tasks(tq, ids["a"], 3)
    b_tasks = await queue_tasks(tq, ids["b"], 4)
    assert (await monitor.run_once()).paused == [ids["src"]]
    assert (await monitor.paused_jobs())[ids["src"]] == (
        PAUSE_PREFIX + "queue depth 3 > 2 at job dex/a; queue depth 4 > 2 at job dex/b"
    )
    await tq.cancel(a_tasks)
    report = await monitor.run_once()
    assert report.resumed == [] and report.paused == []
    assert (await monitor.paused_jobs())[ids["src"]] == (
        PAUSE_PREFIX + "queue depth 4 > 2 at job dex/b"
    )
    await tq.cancel(b_tasks)
    assert (await monitor.run_once()).resumed == [ids["src"]]
    assert [kind for kind, _ in await journal_of(repo, ids["src"])] == ["paused", "resumed"]


@pytest.mark.anyio
async def test_bulk_tier_is_shed_first(repo: SqlRepository, clock: ManualClock) -> None:
    jobs = [
        JobDef("backfill", outputs=("hist",), tier="bulk"),
        JobDef("live", outputs=("head",)),
        JobDef("agg", inputs=("hist", "head"), backpressure={"max_queue_depth": 10}),
    ]
    ids = await build_dag(repo, clock.now(), jobs)
    tq = TaskQueue(repo, clock=clock)
    monitor = BackpressureMonitor(repo, clock=clock)
    await queue_tasks(tq, ids["agg"], 6)
    assert (await monitor.run_once()).paused == [ids["backfill"]]
    await queue_tasks(tq, ids["agg"], 5)
    assert (await monitor.run_once()).paused == [ids["live"]]
    assert set(await monitor.paused_jobs()) == {ids["backfill"], ids["live"]}


@pytest.mark.anyio
async def test_a_pause_set_by_hand_is_left_alone(repo: SqlRepository, clock: ManualClock) -> None:
    ids = await build_dag(repo, clock.now(), CHAIN)
    async with repo.transaction() as tx:
        await tx.connection.execute(
            sa.insert(schema.job_states).values(
                job_id=ids["mid"],
                paused=True,
                pause_reason="maintenance",
                paused_at=clock.now(),
                updated_at=clock.now(),
            )
        )
    tq = TaskQueue(repo, clock=clock)
    monitor = BackpressureMonitor(repo, clock=clock)
    tasks = await queue_tasks(tq, ids["agg"], 11)
    assert (await monitor.run_once()).paused == [ids["src"]]
    assert await job_state(repo, ids["mid"]) == (True, "maintenance")
    await tq.cancel(tasks)
    assert (await monitor.run_once()).resumed == [ids["src"]]
    assert await monitor.paused_jobs() == {ids["mid"]: "maintenance"}


@pytest.mark.anyio
async def test_two_monitors_journal_each_transition_once(
    database_url: str, repo: SqlRepository, clock: ManualClock
) -> None:
    ids = await build_dag(repo, clock.now(), CHAIN)
    await queue_tasks(TaskQueue(repo, clock=clock), ids["agg"], 11)

    async def monitor(r: SqlRepository, _: int) -> None:
        await BackpressureMonitor(r, clock=clock).run_once()

    await run_on_separate_repos(database_url, 4, monitor)
    assert [k for k, _ in await journal_of(repo, ids["src"])] == ["paused"]
    assert [k for k, _ in await journal_of(repo, ids["mid"])] == ["paused"]


@pytest.mark.anyio
async def test_bulk_handicap_orders_claims(repo: SqlRepository, clock: ManualClock) -> None:
    jobs = [JobDef("backfill", outputs=("hist",), tier="bulk"), JobDef("live", outputs=("head",))]
    ids = await build_dag(repo, clock.now(), jobs)
    monitor = BackpressureMonitor(repo, clock=clock)
    tq = TaskQueue(repo, clock=clock)

    async def create(job: str, tier: str) -> uuid.UUID:
        [made] = await tq.create(
            [NewTask(ids[job], handicap_seconds=monitor.handicap_seconds(tier))]
        )
        return made.task_id

    bulk = await create("backfill", "bulk")
    clock.advance(200)
    normal = await create("live", "normal")
    clock.advance(200)
    later = await create("live", "normal")
    order = []
    for _ in range(3):
        [lease] = await tq.claim_batch("w1", 1)
        order.append(lease.item_id)
    # Bulk yields to normal work created up to 300 s later, then ages in.
    assert order == [normal, bulk, later]


@pytest.mark.anyio
async def test_monitor_service_starts_and_stops(repo: SqlRepository, clock: ManualClock) -> None:
    monitor = BackpressureMonitor(repo, clock=clock, config=BackpressureConfig(interval_seconds=60))
    async with anyio.create_task_group() as tg:
        await monitor.start(tg)
        await monitor.stop()
    await BackpressureMonitor(repo, clock=clock).stop()  # never started: returns at once


PIPE = """\
dag: pipe
jobs:
  - name: backfill
    activation: source
    runtime: dispatcher
    operator: block_follower
    source: { kind: always_on }
    outputs: [{ dataset: hist, kind: parquet }]
    backpressure: { priority_tier: bulk }
  - name: follow
    activation: source
    runtime: dispatcher
    operator: block_follower
    source: { kind: always_on }
    outputs: [{ dataset: head, kind: parquet }]
  - name: aggregate
    activation: reactive
    runtime: dispatcher
    operator: range_aggregator
    execution_strategy: PerUpdate
    inputs:
      - from: { dataset: hist }
      - from: { dataset: head }
    outputs: [{ dataset: totals, kind: parquet }]
    backpressure: { max_queue_depth: 4, max_queue_age: 1m }
"""


@pytest.mark.anyio
async def test_a_deployed_dag_gets_backpressure(repo: SqlRepository, clock: ManualClock) -> None:
    await deploy(repo, parse_dag(PIPE), clock=clock)
    async with repo.read() as tx:
        ids = {job.job_name: job.job_id for job in await live_jobs(tx)}
    tq = TaskQueue(repo, clock=clock)
    monitor = BackpressureMonitor(repo, clock=clock)
    await queue_tasks(tq, ids["aggregate"], 2)
    assert (await monitor.run_once()).paused == [ids["backfill"]]  # bulk: shed at 2 of 4
    clock.advance(61)
    assert (await monitor.run_once()).paused == [ids["follow"]]  # age 61s > 1m
    assert (await monitor.paused_jobs())[ids["follow"]] == (
        PAUSE_PREFIX + "queue age 61s > 60s at job pipe/aggregate"
    )
