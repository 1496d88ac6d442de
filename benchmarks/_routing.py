"""Routing benchmark: accept partition events, route them to reactive dependents.

One run, on a fresh database: deploy a DAG with one source job producing the
partitioned dataset ``blocks`` and N reactive ``PerPartition`` jobs reading it,
create and claim the source's run task (the producer of the events), build
the events (distinct ``{start}-{end}`` partitions of ``block_span`` blocks, plus
resampled duplicates, shuffled with a fixed seed), then time two phases
through the public API:

- accept: ``EventGateway.accept`` in requests of ``batch`` events, from the
  source's attempt (each request is one transaction that stores the new
  events, advances coverage and writes ``route_event`` outbox rows);
- route: ``OutboxRelay`` with the router's ``route_event`` handler (and a
  no-op ``enqueue_task`` handler when wake-up rows are drained too).

By default the phases run one after the other: every request, then
``run_once`` until nothing is claimable. ``overlap`` runs them as a running
Dispatcher does: the relay's service loop routes while the requests come in
(woken by their commits), and after the last request ``run_once`` drains what
is left; ``route_seconds`` is then that tail. Either way ``seconds`` runs from
the first request to the last task written.

The result is checked against the tasks table: exactly one task per distinct
partition and dependent. Each run is followed by its floor
(:mod:`benchmarks._routing_floor`, on SQLite
:mod:`benchmarks._routing_floor_sqlite`) on another fresh database: the bare writes
of the same task rows, whose time bounds ``events_per_s`` from above. On
both engines a second floor follows, on another fresh database: the bare writes
of every row the specification requires (events, outcomes, tasks,
``task_inputs``, outbox rows), the true floor of routing.
"""

from __future__ import annotations

import cProfile
import functools
import random
import re
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import sqlalchemy as sa
from sqlalchemy import event as sa_event

from benchmarks._common import (
    Databases,
    load_average,
    log,
    median,
    percentile,
    server_cpu_s,
)
from benchmarks._routing_floor import write_floor, write_required_floor
from benchmarks._routing_floor_sqlite import write_required_sqlite_floor, write_sqlite_floor
from trace_core.authoring.events import DatasetEvent
from trace_core.clock import SystemClock
from trace_core.dag import DeployResult, deploy, parse_dag
from trace_core.dispatcher.events import ROUTE_EVENT, EventGateway, Producer
from trace_core.dispatcher.routing import EventRouter
from trace_core.outbox import OutboxHandler, OutboxRelay, RelayConfig
from trace_core.storage import schema
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import ENQUEUE_TASK, TaskQueue

__all__ = ["RoutingParams", "SqlTrace", "build_dag", "build_events", "run_routing"]

_CHECKED = ("tasks", "distinct_task_keys", "new_events", "events_stored", "deliveries")
"""What a run's check compares, logged when it fails."""

SOURCE_JOB = "follow"
DATASET = "blocks"


@dataclass(frozen=True)
class RoutingParams:
    """What one routing run does."""

    events: int = 10_000
    """Distinct partition events (duplicates come on top)."""
    dependents: int = 10
    duplicates: float = 0.3
    """Duplicates added, as a fraction of ``events`` (resampled with replacement)."""
    batch: int = 500
    """Events per ``EventGateway.accept`` request."""
    block_span: int = 100
    seed: int = 20_260_101
    drain_wakeups: bool = True
    """Register a no-op ``enqueue_task`` handler so the wake-up rows are drained
    (and timed) too; otherwise they are left ``Pending``."""
    relay_batch: int = RelayConfig.batch_size
    relay_concurrency: int = RelayConfig.concurrency
    profile_path: str | None = None
    """cProfile the timed phases into this file."""
    trace_sql: bool = False
    """Count and time every statement (per phase) and log the table."""
    overlap: bool = False
    """Route while accepting (the relay's service loop runs), as a Dispatcher does."""
    floor: bool = True
    """Measure the floor (the bare task writes) after the run."""


def build_dag(dependents: int) -> str:
    """The DAG YAML: one source producing ``blocks``, ``dependents`` PerPartition readers."""
    jobs = [
        f"""  - name: {SOURCE_JOB}
    activation: source
    runtime: dispatcher
    operator: block_follower
    source: {{ kind: always_on }}
    outputs: [ {{ dataset: {DATASET}, kind: parquet }} ]
    update_strategy: replace"""
    ]
    for i in range(dependents):
        jobs.append(
            f"""  - name: dep{i:03d}
    activation: reactive
    runtime: ecs_platform
    operator: range_aggregator
    execution_strategy: PerPartition
    inputs: [ {{ from: {{ dataset: {DATASET} }} }} ]
    outputs: [ {{ dataset: out{i:03d}, kind: parquet }} ]
    update_strategy: replace"""
        )
    return "dag: routing_bench\njobs:\n" + "\n".join(jobs) + "\n"


def build_events(
    dataset_uuid: uuid.UUID, dataset_version: uuid.UUID, params: RoutingParams
) -> list[DatasetEvent]:
    """Distinct partitions plus resampled duplicates, shuffled (deterministic)."""
    span = params.block_span
    distinct = [
        DatasetEvent(
            dataset_uuid,
            dataset_version,
            partition_key=f"{i * span}-{i * span + span - 1}",
            start=i * span,
            end=i * span + span - 1,
        )
        for i in range(params.events)
    ]
    rng = random.Random(params.seed)
    extra = round(params.events * params.duplicates)
    events = distinct + rng.choices(distinct, k=extra)
    rng.shuffle(events)
    return events


# --- statement tracing -----------------------------------------------------------


_WORDS = re.compile(r"\s+")
_TABLE = re.compile(r"\b(?:FROM|INTO|UPDATE|JOIN)\s+\"?(\w+)", re.IGNORECASE)


def _statement_key(statement: str) -> str:
    """A short label for a statement: its verb and the tables it names."""
    text = _WORDS.sub(" ", statement).strip()
    verb = text.split(" ", 1)[0].upper()
    if verb == "WITH":
        verb = "WITH…" + ("UPDATE" if " UPDATE " in text.upper() else "SELECT")
    tables = list(dict.fromkeys(m.group(1).lower() for m in _TABLE.finditer(text)))
    if verb == "SELECT" and "pg_notify" in text:
        return "SELECT pg_notify"
    return f"{verb} {','.join(tables[:4])}".strip()


@dataclass
class SqlTrace:
    """Statements executed (cursor executions: one per round trip, except
    psycopg's pipelined ``executemany``), with client-side elapsed time, per phase."""

    phase: str = "setup"
    counts: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    rows: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    _started: dict[int, float] = field(default_factory=dict)

    def attach(self, repo: SqlRepository) -> None:
        """Listen to the cursor executions of ``repo``'s engine."""
        engine = repo.engine.sync_engine

        def before(
            conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool
        ) -> None:
            self._started[id(cursor)] = time.perf_counter()

        def after(
            conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool
        ) -> None:
            elapsed = time.perf_counter() - self._started.pop(id(cursor), time.perf_counter())
            key = (self.phase, _statement_key(statement))
            self.counts[key] += 1
            self.seconds[key] += elapsed
            if many and isinstance(params, list | tuple):
                self.rows[key] += len(params)

        sa_event.listen(engine, "before_cursor_execute", before)
        sa_event.listen(engine, "after_cursor_execute", after)

    @contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        """Attribute statements to ``phase`` while inside."""
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    def table(self) -> list[dict[str, Any]]:
        """One entry per (phase, statement), slowest first."""
        return [
            {
                "phase": phase,
                "statement": key,
                "executions": self.counts[(phase, key)],
                "executemany_rows": self.rows.get((phase, key), 0),
                "seconds": round(self.seconds[(phase, key)], 3),
            }
            for phase, key in sorted(self.seconds, key=lambda k: -self.seconds[k])
        ]


# --- one run ---------------------------------------------------------------------


async def _noop(payload: Mapping[str, Any]) -> None:
    """The wake-up handler: workers poll in this benchmark."""
    return None


async def _start_source(tasks: TaskQueue, deployed: DeployResult) -> Producer:
    """Create and claim the source's run task, as the source supervisor does."""
    job = deployed.jobs[SOURCE_JOB]
    (run,) = await tasks.create([NewTask(job, dedupe_key=f"source-run:{job}")])
    outcome = await tasks.claim(run.task_id, "bench-source")
    assert outcome.lease is not None, outcome
    return Producer(run.task_id, outcome.lease.attempt)


async def _counts(repo: SqlRepository, source_job: uuid.UUID) -> dict[str, Any]:
    """What the run left in the database: tasks, events, outbox rows by kind/status."""
    t, e, o = schema.tasks, schema.events, schema.outbox
    async with repo.read() as tx:
        conn = tx.connection
        tasks = (
            await conn.execute(sa.select(sa.func.count()).where(t.c.job_id != source_job))
        ).scalar_one()
        distinct_keys = (
            await conn.execute(
                sa.select(sa.func.count()).select_from(
                    sa.select(t.c.job_id, t.c.dedupe_key)
                    .where(t.c.job_id != source_job)
                    .distinct()
                    .subquery()
                )
            )
        ).scalar_one()
        events = (await conn.execute(sa.select(sa.func.count()).select_from(e))).scalar_one()
        deliveries = (await conn.execute(sa.select(sa.func.sum(e.c.deliveries)))).scalar_one()
        pending = (
            await conn.execute(sa.select(sa.func.count()).where(e.c.route_status != "routed"))
        ).scalar_one()
        outbox = (
            await conn.execute(
                sa.select(o.c.kind, o.c.status, sa.func.count()).group_by(o.c.kind, o.c.status)
            )
        ).all()
    return {
        "tasks": int(tasks),
        "distinct_task_keys": int(distinct_keys),
        "events_stored": int(events),
        "deliveries": int(deliveries or 0),
        "events_not_routed": int(pending),
        "outbox": {f"{kind}:{status}": int(n) for kind, status, n in outbox},
    }


async def _run(
    url: str, params: RoutingParams, trace: SqlTrace | None, postmaster: int | None
) -> dict[str, Any]:
    repo = SqlRepository(url)
    if trace is not None:
        trace.attach(repo)
    try:
        deployed = await _deploy(repo, params)
        tasks = TaskQueue(repo)
        producer = await _start_source(tasks, deployed)
        pointer = deployed.datasets[DATASET]
        events = build_events(pointer.dataset_uuid, pointer.dataset_version, params)
        gateway = EventGateway(repo)
        router = EventRouter(repo, tasks=tasks)
        handlers: dict[str, OutboxHandler] = {ROUTE_EVENT: router.handle}
        if params.drain_wakeups:
            handlers[ENQUEUE_TASK] = _noop
        relay = OutboxRelay(
            repo,
            handlers,
            config=RelayConfig(batch_size=params.relay_batch, concurrency=params.relay_concurrency),
        )
        # Open the pool's connections before the clock starts, as a running
        # dispatcher has them open already.
        async with anyio.create_task_group() as tg:
            for _ in range(params.relay_concurrency):
                tg.start_soon(_touch, repo)

        profiler = cProfile.Profile() if params.profile_path else None
        request_ms: list[float] = []
        new = 0
        if profiler is not None:
            profiler.enable()
        server0 = server_cpu_s(postmaster) if postmaster is not None else None
        cpu0 = time.process_time()
        started = time.perf_counter()
        with trace.in_phase("accept") if trace is not None else _nothing():
            async with anyio.create_task_group() as tg:
                if params.overlap:
                    await relay.start(tg)
                for k in range(0, len(events), params.batch):
                    t0 = time.perf_counter()
                    result = await gateway.accept(events[k : k + params.batch], producer=producer)
                    request_ms.append((time.perf_counter() - t0) * 1000)
                    new += result.new
                accepted = time.perf_counter()
                # CPU split at the end of the requests (with --overlap, the
                # accept phase includes the routing done meanwhile)
                accept_cpu = time.process_time() - cpu0
                accept_server = (
                    server_cpu_s(postmaster) - server0
                    if postmaster is not None and server0 is not None
                    else None
                )
                if params.overlap:
                    await relay.stop()
        rounds = 0
        with trace.in_phase("route") if trace is not None else _nothing():
            # Rows only, not a poll loop: everything is claimable at once, so the
            # drain ends at the first empty claim.
            while await relay.run_once():
                rounds += 1
        routed = time.perf_counter()
        cpu = time.process_time() - cpu0
        server = None
        if postmaster is not None and server0 is not None:
            server = server_cpu_s(postmaster) - server0
        if profiler is not None:
            profiler.disable()
            assert params.profile_path is not None
            profiler.dump_stats(params.profile_path)
        counts = await _counts(repo, deployed.jobs[SOURCE_JOB])
    finally:
        await repo.close()
    return {
        "accept_seconds": accepted - started,
        "route_seconds": routed - accepted,
        "seconds": routed - started,
        "events": len(events),
        "new_events": new,
        "requests": len(request_ms),
        "accept_ms_p50": round(median(request_ms), 1),
        "accept_ms_p95": round(percentile(request_ms, 95), 1),
        "relay_rounds": rounds,
        "client_cpu_s": round(cpu, 2),
        "server_cpu_s": None if server is None else round(server, 2),
        "accept_client_cpu_s": round(accept_cpu, 2),
        "accept_server_cpu_s": None if accept_server is None else round(accept_server, 2),
        **counts,
    }


async def _deploy(repo: SqlRepository, params: RoutingParams) -> DeployResult:
    return await deploy(
        repo, parse_dag(build_dag(params.dependents), file="bench.yaml"), clock=SystemClock()
    )


async def _floor(url: str, params: RoutingParams, postmaster: int | None) -> dict[str, Any]:
    repo = SqlRepository(url)
    try:
        deployed = await _deploy(repo, params)
        pointer = deployed.datasets[DATASET]
        if repo.engine_name == "sqlite":
            return await write_sqlite_floor(
                repo,
                jobs=[job for name, job in deployed.jobs.items() if name != SOURCE_JOB],
                dataset=pointer.dataset_uuid,
                version=pointer.dataset_version,
                units=params.events,
                span=params.block_span,
            )
        return await write_floor(
            repo,
            jobs=[job for name, job in deployed.jobs.items() if name != SOURCE_JOB],
            dataset=pointer.dataset_uuid,
            version=pointer.dataset_version,
            units=params.events,
            span=params.block_span,
            parts=params.relay_concurrency,
            postmaster=postmaster,
        )
    finally:
        await repo.close()


async def _required_floor(
    url: str, params: RoutingParams, postmaster: int | None
) -> dict[str, Any]:
    """The required-rows floor (:func:`write_required_floor`) of this run's events."""
    repo = SqlRepository(url)
    try:
        deployed = await _deploy(repo, params)
        pointer = deployed.datasets[DATASET]
        events = build_events(pointer.dataset_uuid, pointer.dataset_version, params)
        copies = Counter(e.partition_key for e in events)
        span = params.block_span
        write = (
            write_required_sqlite_floor
            if repo.engine_name == "sqlite"
            else functools.partial(write_required_floor, postmaster=postmaster)
        )
        return await write(
            repo,
            jobs={name: job for name, job in deployed.jobs.items() if name != SOURCE_JOB},
            dataset=pointer.dataset_uuid,
            version=pointer.dataset_version,
            copies=[copies[f"{i * span}-{i * span + span - 1}"] for i in range(params.events)],
            span=span,
            parts=params.relay_concurrency,
        )
    finally:
        await repo.close()


async def _touch(repo: SqlRepository) -> None:
    async with repo.read() as tx:
        await tx.connection.execute(sa.text("SELECT 1"))


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def run_routing(
    dbs: Databases,
    params: RoutingParams,
    run: int,
    emit: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """One run on a fresh database; emits and returns its result object."""
    url = dbs.fresh(f"routing{run}")
    trace = SqlTrace() if params.trace_sql else None
    log.info(
        "run %d: %d events (+%.0f%% duplicates), %d dependents, batch %d",
        run,
        params.events,
        params.duplicates * 100,
        params.dependents,
        params.batch,
    )
    load = load_average()
    out = anyio.run(_run, url, params, trace, dbs.postmaster, backend="asyncio")
    expected = params.events * params.dependents
    row: dict[str, Any] = {
        "bench": "routing",
        "engine": dbs.engine,
        "run": run,
        "events": out["events"],
        "distinct_events": params.events,
        "dependents": params.dependents,
        "tasks_created": out["tasks"],
        "tasks_expected": expected,
        "deliveries": out["deliveries"],
        "verified": out["tasks"] == expected
        and out["distinct_task_keys"] == expected
        and out["new_events"] == params.events
        and out["events_stored"] == params.events
        and out["deliveries"] == out["events"]  # every redelivery counted
        and out["events_not_routed"] == 0,
        "seconds": round(out["seconds"], 3),
        "events_per_s": round(out["events"] / out["seconds"], 1),
        "distinct_events_per_s": round(params.events / out["seconds"], 1),
        "tasks_per_s": round(out["tasks"] / out["seconds"], 1),
        "accept_seconds": round(out["accept_seconds"], 3),
        "route_seconds": round(out["route_seconds"], 3),
        "batch": params.batch,
        "requests": out["requests"],
        "accept_ms_p50": out["accept_ms_p50"],
        "accept_ms_p95": out["accept_ms_p95"],
        "relay_batch": params.relay_batch,
        "relay_concurrency": params.relay_concurrency,
        "relay_rounds": out["relay_rounds"],
        "client_cpu_s": out["client_cpu_s"],
        "server_cpu_s": out["server_cpu_s"],
        "accept_client_cpu_s": out["accept_client_cpu_s"],
        "accept_server_cpu_s": out["accept_server_cpu_s"],
        "wakeups": "drained" if params.drain_wakeups else "left_pending",
        "outbox": out["outbox"],
        "overlap": params.overlap,
        "load_avg_1m": load,
    }
    if params.floor:
        floor_url = dbs.fresh(f"routingfloor{run}")
        floor = anyio.run(_floor, floor_url, params, dbs.postmaster, backend="asyncio")
        dbs.drop(floor_url)
        ceiling = out["events"] / floor["seconds"]
        row |= {
            "floor_seconds": round(floor["seconds"], 3),
            "floor_server_cpu_s": floor["server_cpu_s"],
            "floor_rows_ok": floor["rows"] == expected,
            "events_per_s_ceiling": round(ceiling, 1),
            "share_of_ceiling": round(row["events_per_s"] / ceiling, 3),
        }
    if params.floor:
        required_url = dbs.fresh(f"routingrequired{run}")
        required = anyio.run(_required_floor, required_url, params, dbs.postmaster)
        dbs.drop(required_url)
        required_ceiling = out["events"] / required["seconds"]
        row |= {
            "required_floor_seconds": round(required["seconds"], 3),
            "required_floor_server_cpu_s": required["server_cpu_s"],
            "required_floor_rows_ok": required["rows"] == expected
            and required["events"] == params.events,
            "events_per_s_required_ceiling": round(required_ceiling, 1),
            "share_of_required_ceiling": round(row["events_per_s"] / required_ceiling, 3),
        }
    emit(row)
    if trace is not None:
        for entry in trace.table():
            log.info("sql %s", entry)
        emit({"bench": "routing-sql", "engine": dbs.engine, "run": run, "table": trace.table()})
    if not row["verified"]:
        log.error(
            "run %d: expected %d tasks (%d distinct events x %d dependents), got %s",
            run,
            expected,
            params.events,
            params.dependents,
            {k: out[k] for k in _CHECKED},
        )
    return row
