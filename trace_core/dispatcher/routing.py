"""Event routing: accepted events become tasks of the jobs that read them.

The ``route_event`` outbox handler. For a batch of stored events it finds the
live reactive jobs whose input edges point at the event's dataset *version*
(events of versions no live DAG version points at are kept for audit and
marked ``not_current``), and creates at most one task per unit of work:

- ``PerUpdate``: one task per event, dedupe key
  ``cursor:{dataset_uuid}:{dataset_version}:{cursor}`` (or ``partition:…`` for
  a partition event);
- ``PerPartition``: one task per partition, dedupe key
  ``partition:{dataset_uuid}:{dataset_version}:{partition_key}`` of the job's
  first input; a job with several inputs gets its task once every input holds
  the partition (the last input to arrive creates it).

Duplicates and out-of-order deliveries therefore create nothing new. Each
task carries its pinned input versions with their ``where`` filters, and
``task_inputs`` rows record them. Jobs paused by backpressure get nothing now:
the event stays ``pending`` and its outbox row is retried later. The outcome
of every routing decision is stored on the event row (``route_detail``) for
``explain``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import AsyncConnection

from trace_core.clock import Clock, SystemClock
from trace_core.dag.coverage import Coverage, covers, read_coverage
from trace_core.dispatcher.redeliveries import REDELIVERIES, apply_redeliveries
from trace_core.dispatcher.routing_sql import route_in_sql, set_based
from trace_core.dispatcher.topology import (
    Dependent,
    InputEdge,
    live_pointers,
    reactive_dependents,
    reactive_dependents_of,
)
from trace_core.outbox import Deferred
from trace_core.storage import schema
from trace_core.storage.bulk import bulk_insert, json_records, records_param, uuid_array
from trace_core.storage.protocol import NewTask, Repository, TaskCreated
from trace_core.storage.sql import SqlTransaction, as_sql
from trace_core.tasks import TaskQueue

__all__ = ["EventRouter", "RouteReport", "dedupe_key"]


@dataclass(frozen=True)
class _Event:
    id: uuid.UUID
    dataset_uuid: uuid.UUID
    dataset_version: uuid.UUID
    unit_key: str
    cursor: str | None
    partition_key: str | None
    start: int | None
    end: int | None
    received_at: datetime

    @cached_property
    def own_key(self) -> str:
        """The dedupe key of this event's own unit (dataset, version, unit)."""
        if self.partition_key is not None:
            return f"partition:{self.dataset_uuid}:{self.dataset_version}:{self.partition_key}"
        return f"cursor:{self.dataset_uuid}:{self.dataset_version}:{self.cursor}"

    @cached_property
    def unit(self) -> dict[str, Any]:
        """The unit of work as it appears in a task's input entry."""
        if self.partition_key is not None:
            unit: dict[str, Any] = {"partition_key": self.partition_key}
            if self.start is not None:
                unit["start"], unit["end"] = self.start, self.end
            return unit
        return {"cursor": self.cursor}


@dataclass
class RouteReport:
    """What one routing pass did."""

    events: int = 0
    routed: int = 0
    not_current: int = 0
    deferred: int = 0
    tasks_created: int = 0
    tasks_existing: int = 0
    waiting: int = 0
    """Decisions postponed until the job's other inputs hold the partition."""


def dedupe_key(job: Dependent, event: _Event) -> str:
    """The unit of work an event means for ``job`` (see the module docstring)."""
    if event.partition_key is not None and job.execution_strategy == "PerPartition":
        return job.partition_prefix + event.partition_key
    return event.own_key


@dataclass
class _Plan:
    tasks: dict[tuple[uuid.UUID, str], NewTask] = field(default_factory=dict)
    inputs: dict[tuple[uuid.UUID, str], list[tuple[uuid.UUID, str, datetime]]] = field(
        default_factory=dict
    )
    outcomes: dict[uuid.UUID, dict[str, str]] = field(default_factory=dict)
    keys: dict[uuid.UUID, list[tuple[str, tuple[uuid.UUID, str]]]] = field(default_factory=dict)


class EventRouter:
    """Routes stored events to dependent jobs (the ``route_event`` handler)."""

    def __init__(
        self,
        repo: Repository,
        *,
        clock: Clock | None = None,
        tasks: TaskQueue | None = None,
        handicap: Callable[[str], float] | None = None,
        defer_seconds: float = 5.0,
    ) -> None:
        self.repo = repo
        self.clock = clock or SystemClock()
        self.tasks = tasks or TaskQueue(repo, clock=self.clock)
        self.handicap = handicap or (lambda tier: 0.0)
        self.defer_seconds = defer_seconds

    async def handle(self, payload: Mapping[str, Any]) -> None:
        """Outbox handler: route ``payload["event_ids"]``; defer if a job is paused.
        A payload of redelivery counts an accept left is applied instead."""
        if REDELIVERIES in payload:
            async with self.repo.transaction() as tx:
                await apply_redeliveries(as_sql(tx).connection, payload)
            return
        report = await self.route([uuid.UUID(str(i)) for i in payload["event_ids"]])
        if report.deferred:
            raise Deferred(self.defer_seconds, f"{report.deferred} events wait for paused jobs")

    async def route(self, event_ids: Sequence[uuid.UUID]) -> RouteReport:
        """Route the pending events among ``event_ids`` in one transaction."""
        report = RouteReport()
        async with self.repo.transaction() as tx:
            st = as_sql(tx)
            events = await _pending(st.connection, event_ids)
            report.events = len(events)
            if not events:
                return report
            conn = st.connection
            dependents = await reactive_dependents(st, {e.dataset_uuid for e in events})
            paused = await _paused(conn)
            live = await live_pointers(conn)
            now = self.clock.now()
            if st.engine_name == "postgres" and self._set_based(dependents, paused):
                await self._route_in_sql(st, events, dependents, live, now, report)
                return report
            plan = await self._plan(st, events, dependents, paused, report)
            task_ids = await self._create(st, plan)
            updates = []
            for event in events:
                detail = plan.outcomes.get(event.id, {})
                made = existing = 0
                for job_name, key in plan.keys.get(event.id, []):
                    if task_ids[key].created and detail.get(job_name) != "existing":
                        detail[job_name] = "created"
                        made += 1
                    else:
                        detail[job_name] = "existing"
                        existing += 1
                report.tasks_created += made
                report.tasks_existing += existing
                if "paused" in detail.values():
                    status = "pending"
                    report.deferred += 1
                elif event.dataset_version in live:
                    status = "routed"
                    report.routed += 1
                else:
                    status = "not_current"
                    report.not_current += 1
                updates.append(
                    {
                        "id": event.id,
                        "route_status": status,
                        "routed_at": now if status != "pending" else None,
                        "tasks_created": made,
                        "tasks_existing": existing,
                        "route_detail": detail or None,
                    }
                )
            await _update_events(st, updates)
        return report

    def _set_based(
        self,
        dependents: Mapping[uuid.UUID, list[tuple[Dependent, InputEdge]]],
        paused: set[uuid.UUID],
    ) -> bool:
        """Whether the batch can be routed by one set-based statement: only
        single-input dependents, none paused, valid task settings (else the
        generic path decides, and rejects bad settings with its errors)."""
        jobs = [job for deps in dependents.values() for job, _ in deps]
        return set_based(dependents) and all(
            job.job_id not in paused
            and job.max_attempts >= 1
            and self.handicap(job.priority_tier) >= 0
            for job in jobs
        )

    async def _route_in_sql(
        self,
        st: SqlTransaction,
        events: Sequence[_Event],
        dependents: Mapping[uuid.UUID, list[tuple[Dependent, InputEdge]]],
        live: set[uuid.UUID],
        now: datetime,
        report: RouteReport,
    ) -> None:
        not_current = [e.id for e in events if e.dataset_version not in live]
        report.not_current = len(not_current)
        report.routed = len(events) - report.not_current
        jobs = {job.job_id: job for deps in dependents.values() for job, _ in deps}
        done = await route_in_sql(
            st,
            [e.id for e in events],
            not_current,
            [(job, self.handicap(job.priority_tier)) for job in jobs.values()],
            now=now,
            wakeup=self.tasks.wakeup,
        )
        report.tasks_created = done.created
        report.tasks_existing = done.decisions - done.created

    async def replay(self, job_ids: Collection[uuid.UUID], *, batch: int = 500) -> RouteReport:
        """Backfill: route every stored event of the pinned input versions of
        ``job_ids`` to those jobs only, in batches of ``batch`` events.

        A job that builds a new dataset version (a rematerialization) starts
        from the history its inputs already have; dedupe keys make a replay
        idempotent, so it is safe to repeat after a crash. Paused jobs are
        counted as ``deferred``: replay again once they resume.
        """
        report = RouteReport()
        wanted = set(job_ids)
        after: tuple[datetime, uuid.UUID] | None = None
        while True:
            async with self.repo.transaction() as tx:
                st = as_sql(tx)
                versions = await _input_versions_of(st, wanted)
                events = await _history(st.connection, versions, after, batch)
                if not events:
                    return report
                report.events += len(events)
                found = await reactive_dependents(st, {e.dataset_uuid for e in events})
                dependents = {
                    ds: [(job, edge) for job, edge in deps if job.job_id in wanted]
                    for ds, deps in found.items()
                }
                paused = await _paused(st.connection)
                plan = await self._plan(st, events, dependents, paused, report)
                task_ids = await self._create(st, plan)
            report.tasks_created += sum(1 for c in task_ids.values() if c.created)
            report.tasks_existing += sum(1 for c in task_ids.values() if not c.created)
            report.deferred += sum(1 for o in plan.outcomes.values() if "paused" in o.values())
            after = (events[-1].received_at, events[-1].id)

    async def _plan(
        self,
        st: SqlTransaction,
        events: Sequence[_Event],
        dependents: Mapping[uuid.UUID, list[tuple[Dependent, InputEdge]]],
        paused: set[uuid.UUID],
        report: RouteReport,
    ) -> _Plan:
        # every input of every dependent: a PerPartition join checks the others
        inputs = {e.dataset_version for d in dependents.values() for j, _ in d for e in j.inputs}
        coverage = await read_coverage(st, inputs)
        plan = _Plan()
        for event in events:
            self._plan_event(event, dependents, paused, coverage, plan, report)
        return plan

    async def _create(self, st: SqlTransaction, plan: _Plan) -> dict[Any, TaskCreated]:
        """Create the planned tasks (with their wake-ups) and their task_inputs rows."""
        created = await self.tasks.create(list(plan.tasks.values()), tx=st)
        task_ids = dict(zip(plan.tasks, created, strict=True))
        await _insert_task_inputs(st, plan, task_ids)
        return task_ids

    def _plan_event(
        self,
        event: _Event,
        dependents: Mapping[uuid.UUID, list[tuple[Dependent, InputEdge]]],
        paused: set[uuid.UUID],
        coverage: Mapping[uuid.UUID, Coverage],
        plan: _Plan,
        report: RouteReport,
    ) -> None:
        outcomes = plan.outcomes.setdefault(event.id, {})
        for job, edge in dependents.get(event.dataset_uuid, []):
            if edge.dataset_version != event.dataset_version:
                continue  # this job reads another generation of the dataset
            if job.job_id in paused:
                outcomes[job.job_name] = "paused"
                continue
            if not _inputs_ready(job, event, coverage):
                outcomes[job.job_name] = "waiting_for_inputs"
                report.waiting += 1
                continue
            key = dedupe_key(job, event)
            task_key = (job.job_id, key)
            plan.keys.setdefault(event.id, []).append((job.job_name, task_key))
            if task_key in plan.tasks:
                outcomes[job.job_name] = "existing"  # a duplicate within this batch
                continue
            plan.tasks[task_key] = NewTask(
                job_id=job.job_id,
                dedupe_key=key,
                partitions=[event.partition_key] if event.partition_key is not None else None,
                input_versions=_input_versions(job, event),
                max_attempts=job.max_attempts,
                handicap_seconds=self.handicap(job.priority_tier),
            )
            plan.inputs[task_key] = _task_input_rows(job, event)


def _inputs_ready(job: Dependent, event: _Event, coverage: Mapping[uuid.UUID, Coverage]) -> bool:
    """For a PerPartition join: every other input already holds the range."""
    if job.execution_strategy != "PerPartition" or len(job.inputs) < 2:
        return True
    if event.start is None or event.end is None:
        return True  # non-range partitions cannot be joined by coverage; route as they come
    for edge in job.inputs:
        if edge.dataset_uuid == event.dataset_uuid:
            continue
        held = coverage.get(edge.dataset_version, Coverage())
        if not covers(held, Coverage(((event.start, event.end),))):
            return False
    return True


def _input_versions(job: Dependent, event: _Event) -> dict[str, Any]:
    """The task's pinned inputs: every edge's version and ``where`` filter, with
    the unit of work on the triggering edge (on every edge for PerPartition)."""
    every = job.execution_strategy == "PerPartition" and event.partition_key is not None
    inputs = [
        {**edge.pinned, **event.unit}
        if every or edge.dataset_uuid == event.dataset_uuid
        else edge.pinned
        for edge in job.inputs
    ]
    return {"inputs": inputs, "trigger_event_id": str(event.id)}


def _task_input_rows(job: Dependent, event: _Event) -> list[tuple[uuid.UUID, str, datetime]]:
    unit = event.partition_key if event.partition_key is not None else f"cursor:{event.cursor}"
    if job.execution_strategy == "PerPartition" and event.partition_key is not None:
        return [(edge.dataset_uuid, unit, event.received_at) for edge in job.inputs]
    return [(event.dataset_uuid, unit, event.received_at)]


def _select_events() -> sa.Select[Any]:
    """The columns of :class:`_Event`, in its field order."""
    e = schema.events
    return sa.select(
        e.c.id,
        e.c.dataset_uuid,
        e.c.dataset_version,
        e.c.unit_key,
        e.c.cursor,
        e.c.partition_key,
        e.c.range_start,
        e.c.range_end,
        e.c.received_at,
    )


async def _pending(conn: AsyncConnection, event_ids: Sequence[uuid.UUID]) -> list[_Event]:
    e = schema.events
    if conn.dialect.name == "postgresql":
        # one array parameter, not hundreds of expanded IN parameters
        ids = sa.cast(sa.bindparam("ids", uuid_array(event_ids)), postgresql.ARRAY(sa.Uuid()))
        wanted = e.c.id == sa.func.any(ids)
    else:
        wanted = e.c.id.in_(list(event_ids))
    query = _select_events().where(wanted, e.c.route_status == "pending")
    if conn.dialect.name == "postgresql":
        # Locked in unique-key order (bytewise, as Python sorts them), the one
        # order every writer of event rows takes: accepts insert and count in
        # it (skipping rows held here), and deferred counts wait in it.
        query = query.order_by(e.c.dataset_version, e.c.unit_key.collate("C")).with_for_update()
    events = [_Event(*row) for row in await conn.execute(query)]
    return sorted(events, key=lambda ev: (ev.received_at, ev.id))


async def _input_versions_of(st: SqlTransaction, job_ids: set[uuid.UUID]) -> set[uuid.UUID]:
    deps = await reactive_dependents_of(st, job_ids)
    return {edge.dataset_version for job in deps for edge in job.inputs}


async def _history(
    conn: AsyncConnection,
    versions: set[uuid.UUID],
    after: tuple[datetime, uuid.UUID] | None,
    limit: int,
) -> list[_Event]:
    """Stored events of ``versions`` in (received_at, id) order, after a keyset mark."""
    if not versions:
        return []
    e = schema.events
    stmt = _select_events().where(e.c.dataset_version.in_(versions))
    if after is not None:
        stmt = stmt.where(
            sa.or_(
                e.c.received_at > after[0],
                sa.and_(e.c.received_at == after[0], e.c.id > after[1]),
            )
        )
    rows = await conn.execute(stmt.order_by(e.c.received_at, e.c.id).limit(limit))
    return [_Event(*row) for row in rows]


async def _paused(conn: AsyncConnection) -> set[uuid.UUID]:
    s = schema.job_states
    rows = await conn.execute(sa.select(s.c.job_id).where(s.c.paused.is_(True)))
    return {r[0] for r in rows}


async def _insert_task_inputs(
    st: SqlTransaction, plan: _Plan, task_ids: Mapping[Any, TaskCreated]
) -> None:
    rows: list[dict[str, Any]] = [
        {
            "task_id": task_ids[key].task_id,
            "input_dataset_uuid": dataset_uuid,
            "input_partition_key": unit,
            "input_version": version,
        }
        for key, entries in plan.inputs.items()
        if task_ids[key].created
        for dataset_uuid, unit, version in entries
    ]
    if not rows:
        return
    ti = schema.task_inputs
    if st.engine_name == "postgres":
        text: dict[Any, str] = {}  # few distinct datasets and event times: format once
        for row in rows:
            row["task_id"] = row["task_id"].hex
            for key in ("input_dataset_uuid", "input_version"):
                value = row[key]
                row[key] = text.get(value) or text.setdefault(value, _text(value))
        stmt = bulk_insert(ti, list(rows[0])).on_conflict_do_nothing()
        await st.connection.execute(stmt, {"rows": records_param(rows)})
    else:
        await st.connection.execute(st.insert(ti).on_conflict_do_nothing(), rows)


def _text(value: uuid.UUID | datetime) -> str:
    return value.hex if isinstance(value, uuid.UUID) else value.isoformat()


_EVENT_OUTCOME = ("route_status", "routed_at", "tasks_created", "tasks_existing", "route_detail")


async def _update_events(st: SqlTransaction, updates: list[dict[str, Any]]) -> None:
    """Store each event's routing outcome (counts add up across deferrals)."""
    e = schema.events
    if st.engine_name == "postgres":
        r = json_records([e.c.id, *[e.c[name] for name in _EVENT_OUTCOME]])
        stmt = (
            sa.update(e)
            .where(e.c.id == r.c.id)
            .values(
                route_status=r.c.route_status,
                routed_at=r.c.routed_at,
                tasks_created=e.c.tasks_created + r.c.tasks_created,
                tasks_existing=e.c.tasks_existing + r.c.tasks_existing,
                route_detail=r.c.route_detail,
            )
        )
        await st.connection.execute(stmt, {"rows": records_param(updates)})
        return
    # executemany binds may not reuse column names: prefix them
    stmt = (
        sa.update(e)
        .where(e.c.id == sa.bindparam("b_id"))
        .values(
            route_status=sa.bindparam("b_route_status"),
            routed_at=sa.bindparam("b_routed_at"),
            tasks_created=e.c.tasks_created + sa.bindparam("b_tasks_created"),
            tasks_existing=e.c.tasks_existing + sa.bindparam("b_tasks_existing"),
            route_detail=sa.bindparam("b_route_detail", type_=e.c.route_detail.type),
        )
    )
    await st.connection.execute(stmt, [{f"b_{k}": v for k, v in u.items()} for u in updates])
