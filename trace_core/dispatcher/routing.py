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
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from trace_core.clock import Clock, SystemClock
from trace_core.dag.coverage import Coverage, covers, read_coverage
from trace_core.dispatcher.periodic import Handicap, no_handicap
from trace_core.dispatcher.redeliveries import REDELIVERIES, apply_redeliveries
from trace_core.dispatcher.routing_sql import route_in_sql, set_based, single_input_jobs
from trace_core.dispatcher.topology import (
    Dependent,
    InputEdge,
    dependents_by_dataset,
    every_reactive_dependent,
    reactive_dependents,
    reactive_dependents_of,
)
from trace_core.outbox import Deferred
from trace_core.storage.ports.routing import RouteOutcome, StoredEvent, TaskInput
from trace_core.storage.protocol import NewTask, Repository, TaskCreated, Transaction
from trace_core.tasks import TaskQueue

__all__ = ["EventRouter", "RouteReport", "dedupe_key"]


def _own_key(event: StoredEvent) -> str:
    """The dedupe key of an event's own unit (dataset, version, unit)."""
    if event.partition_key is not None:
        return f"partition:{event.dataset_uuid}:{event.dataset_version}:{event.partition_key}"
    return f"cursor:{event.dataset_uuid}:{event.dataset_version}:{event.cursor}"


def _unit(event: StoredEvent) -> dict[str, Any]:
    """The unit of work as it appears in a task's input entry."""
    if event.partition_key is not None:
        unit: dict[str, Any] = {"partition_key": event.partition_key}
        if event.start is not None:
            unit["start"], unit["end"] = event.start, event.end
        return unit
    return {"cursor": event.cursor}


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


def dedupe_key(job: Dependent, event: StoredEvent) -> str:
    """The unit of work an event means for ``job`` (see the module docstring)."""
    if event.partition_key is not None and job.execution_strategy == "PerPartition":
        return job.partition_prefix + event.partition_key
    return _own_key(event)


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
        handicap: Handicap | None = None,
        defer_seconds: float = 5.0,
    ) -> None:
        self.repo = repo
        self.clock = clock or SystemClock()
        self.tasks = tasks or TaskQueue(repo, clock=self.clock)
        self.handicap = handicap or no_handicap
        self.defer_seconds = defer_seconds

    async def handle(self, payload: Mapping[str, Any]) -> None:
        """Outbox handler: route ``payload["event_ids"]``; defer if a job is paused.
        A payload of redelivery counts an accept left is applied instead."""
        if REDELIVERIES in payload:
            async with self.repo.transaction() as tx:
                await apply_redeliveries(tx, payload)
            return
        report = await self.route([uuid.UUID(str(i)) for i in payload["event_ids"]])
        if report.deferred:
            raise Deferred(self.defer_seconds, f"{report.deferred} events wait for paused jobs")

    async def route(self, event_ids: Sequence[uuid.UUID]) -> RouteReport:
        """Route the pending events among ``event_ids`` in one transaction."""
        report = RouteReport()
        async with self.repo.transaction() as tx:
            topology: tuple[list[Dependent], set[uuid.UUID]] | None = None
            if event_ids and tx.routing.locks_and_routes_in_one_statement:
                # The topology does not depend on the events: read first, it
                # lets one statement lock and route them (_lock_and_route_in_sql)
                topology = (
                    await every_reactive_dependent(tx),
                    set(await tx.job_states.paused_jobs()),
                )
                if self._all_set_based(*topology):
                    await self._lock_and_route_in_sql(tx, event_ids, topology[0], report)
                    return report
            events = await tx.routing.lock_pending_events(event_ids)
            report.events = len(events)
            if not events:
                return report
            datasets = {e.dataset_uuid for e in events}
            if topology is None:
                dependents = await reactive_dependents(tx, datasets)
                paused = set(await tx.job_states.paused_jobs())
            else:  # read above: not twice
                dependents = dependents_by_dataset(topology[0], datasets)
                paused = topology[1]
            live = await tx.deploy.live_dataset_versions()
            now = self.clock.now()
            if tx.routing.routes_in_one_statement and self._set_based(dependents, paused):
                await self._route_in_sql(tx, events, dependents, live, now, report)
                return report
            plan = await self._plan(tx, events, dependents, paused, report)
            task_ids = await self._create(tx, plan)
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
                    RouteOutcome(
                        event.id,
                        status,
                        now if status != "pending" else None,
                        made,
                        existing,
                        detail or None,
                    )
                )
            await tx.routing.store_route_outcomes(updates)
        return report

    async def _lock_and_route_in_sql(
        self,
        tx: Transaction,
        event_ids: Sequence[uuid.UUID],
        jobs: Sequence[Dependent],
        report: RouteReport,
    ) -> None:
        """Postgres, when every live reactive job (``jobs``) reads one input,
        none is paused and their settings are valid: lock the events among
        ``event_ids`` and route the pending ones in one statement, to all of ``jobs`` (each
        event reaches the ones pinning its version). One round trip and one
        pass over the event rows fewer than locking them first."""
        live = await tx.deploy.live_dataset_versions()
        now = self.clock.now()
        done = await tx.routing.lock_and_route_single_input_events(
            event_ids,
            live,
            single_input_jobs([(job, self.handicap(job.priority_tier)) for job in jobs], now),
            now=now,
            wakeup=self.tasks.wakeup,
        )
        report.events = done.events
        report.not_current = done.not_current
        report.routed = done.events - done.not_current
        report.tasks_created = done.created
        report.tasks_existing = done.decisions - done.created

    def _set_based(
        self,
        dependents: Mapping[uuid.UUID, list[tuple[Dependent, InputEdge]]],
        paused: set[uuid.UUID],
    ) -> bool:
        """Whether the batch can be routed by one set-based statement: only
        single-input dependents, none paused, valid task settings (else the
        generic path decides, and rejects bad settings with its errors)."""
        jobs = [job for deps in dependents.values() for job, _ in deps]
        return set_based(dependents) and self._all_set_based(jobs, paused)

    def _all_set_based(self, jobs: Sequence[Dependent], paused: set[uuid.UUID]) -> bool:
        """Whether one set-based statement can route to ``jobs``: each reads
        one input, none is paused, their task settings are valid."""
        return all(
            len(job.inputs) == 1
            and job.job_id not in paused
            and job.max_attempts >= 1
            and self.handicap(job.priority_tier) >= 0
            for job in jobs
        )

    async def _route_in_sql(
        self,
        tx: Transaction,
        events: Sequence[StoredEvent],
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
            tx,
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
                versions = await _input_versions_of(tx, wanted)
                events = await tx.routing.event_history(versions, after=after, limit=batch)
                if not events:
                    return report
                report.events += len(events)
                found = await reactive_dependents(tx, {e.dataset_uuid for e in events})
                dependents = {
                    ds: [(job, edge) for job, edge in deps if job.job_id in wanted]
                    for ds, deps in found.items()
                }
                paused = set(await tx.job_states.paused_jobs())
                plan = await self._plan(tx, events, dependents, paused, report)
                task_ids = await self._create(tx, plan)
            report.tasks_created += sum(1 for c in task_ids.values() if c.created)
            report.tasks_existing += sum(1 for c in task_ids.values() if not c.created)
            report.deferred += sum(1 for o in plan.outcomes.values() if "paused" in o.values())
            after = (events[-1].received_at, events[-1].id)

    async def _plan(
        self,
        tx: Transaction,
        events: Sequence[StoredEvent],
        dependents: Mapping[uuid.UUID, list[tuple[Dependent, InputEdge]]],
        paused: set[uuid.UUID],
        report: RouteReport,
    ) -> _Plan:
        # every input of every dependent: a PerPartition join checks the others
        inputs = {e.dataset_version for d in dependents.values() for j, _ in d for e in j.inputs}
        coverage = await read_coverage(tx, inputs)
        plan = _Plan()
        for event in events:
            self._plan_event(event, dependents, paused, coverage, plan, report)
        return plan

    async def _create(self, tx: Transaction, plan: _Plan) -> dict[Any, TaskCreated]:
        """Create the planned tasks (with their wake-ups) and their task_inputs rows."""
        created = await self.tasks.create(list(plan.tasks.values()), tx=tx)
        task_ids = dict(zip(plan.tasks, created, strict=True))
        await tx.routing.insert_task_inputs_if_absent(
            [
                TaskInput(task_ids[key].task_id, dataset_uuid, unit, version)
                for key, entries in plan.inputs.items()
                if task_ids[key].created
                for dataset_uuid, unit, version in entries
            ]
        )
        return task_ids

    def _plan_event(
        self,
        event: StoredEvent,
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


def _inputs_ready(
    job: Dependent, event: StoredEvent, coverage: Mapping[uuid.UUID, Coverage]
) -> bool:
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


def _input_versions(job: Dependent, event: StoredEvent) -> dict[str, Any]:
    """The task's pinned inputs: every edge's version and ``where`` filter, with
    the unit of work on the triggering edge (on every edge for PerPartition)."""
    every = job.execution_strategy == "PerPartition" and event.partition_key is not None
    unit = _unit(event)
    inputs = [
        {**edge.pinned, **unit} if every or edge.dataset_uuid == event.dataset_uuid else edge.pinned
        for edge in job.inputs
    ]
    return {"inputs": inputs, "trigger_event_id": str(event.id)}


def _task_input_rows(job: Dependent, event: StoredEvent) -> list[tuple[uuid.UUID, str, datetime]]:
    unit = event.partition_key if event.partition_key is not None else f"cursor:{event.cursor}"
    if job.execution_strategy == "PerPartition" and event.partition_key is not None:
        return [(edge.dataset_uuid, unit, event.received_at) for edge in job.inputs]
    return [(event.dataset_uuid, unit, event.received_at)]


async def _input_versions_of(tx: Transaction, job_ids: set[uuid.UUID]) -> set[uuid.UUID]:
    deps = await reactive_dependents_of(tx, job_ids)
    return {edge.dataset_version for job in deps for edge in job.inputs}
