"""Upstream events: validation, producer fencing and durable acceptance.

An event says that a dataset version materialized one unit of work: a cursor
position or a partition (``{start}-{end}``, inclusive, for block ranges).
Accepting events stores each once per ``(dataset_version, unit_key)`` (a
redelivery only bumps its ``deliveries`` count; on Postgres, for an event
being routed, the router applies it later:
:mod:`~trace_core.dispatcher.redeliveries`), advances the version's coverage,
and writes one ``route_event`` outbox row for the new ones, all in the
caller's transaction. Routing happens after commit, from the outbox, so a
crash between the two loses nothing.

Events from a task are fenced: only the task's current attempt may emit,
while it runs, and only for datasets its job produces. A late reply of the
current attempt is accepted after a timeout mark as long as no newer attempt
has been claimed (interface-contracts.md); an attempt that ended otherwise
(completed, failed by its own report, canceled, dead-lettered by an
operator) and a stale attempt are refused and change nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from trace_core.authoring.events import AcceptResult, DatasetEvent
from trace_core.clock import Clock, SystemClock
from trace_core.dispatcher.coverage import record_coverage
from trace_core.dispatcher.redeliveries import count_redeliveries, deferred_payload
from trace_core.errors import InvalidInput, InvalidTransition, StaleClaim
from trace_core.model import TASKS
from trace_core.outbox import write_outbox
from trace_core.storage import schema
from trace_core.storage.bulk import bulk_insert, id_block, records_param
from trace_core.storage.protocol import NewOutboxRow, Repository, Transaction, within
from trace_core.storage.sql import SqlTransaction, as_sql
from trace_core.storage.sql_errors import translate_errors
from trace_core.storage.sql_leasing import reply_accepted

__all__ = ["ROUTE_EVENT", "EventGateway", "Producer"]

ROUTE_EVENT = "route_event"
"""Outbox kind: route the events named in ``{"event_ids": [...]}``."""

_ROUTE_CHUNK = 500  # event ids per route_event row: one routing transaction each


@dataclass(frozen=True)
class Producer:
    """The task attempt that emits events (its ``task_id`` is the run id)."""

    task_id: uuid.UUID
    attempt: int


class EventGateway:
    """Accepts upstream events: fenced, deduplicated, routed through the outbox."""

    def __init__(self, repo: Repository, *, clock: Clock | None = None) -> None:
        self.repo = repo
        self.clock = clock or SystemClock()

    async def accept(
        self,
        events: Sequence[DatasetEvent],
        *,
        producer: Producer | None,
        tx: Transaction | None = None,
    ) -> AcceptResult:
        """Store ``events`` and schedule their routing, in one transaction.

        ``producer=None`` is a manual event (the trigger API). Raises
        :class:`~trace_core.errors.StaleClaim` for a stale producer attempt or
        one that has ended (:class:`~trace_core.errors.InvalidTransition` if it
        completed, as a repeated completion is answered), and
        :class:`~trace_core.errors.InvalidInput` for an event naming an unknown
        dataset version or a dataset the producer's job does not produce.
        """
        if not events:
            return AcceptResult([], 0, 0)
        # A deadlock or a lost connection is DatabaseUnavailable: retryable (503).
        with translate_errors("accept events"):
            return await self._accept(events, producer, tx)

    async def _accept(
        self, events: Sequence[DatasetEvent], producer: Producer | None, tx: Transaction | None
    ) -> AcceptResult:
        async with within(self.repo, tx) as t:
            st = as_sql(t)
            conn = st.connection
            now = self.clock.now()
            if producer is not None:
                await _check_producer(conn, producer, events)
            await _check_versions(conn, events)
            ids, fresh, later = await _upsert_events(st, events, producer, now)
            first = {i: e for e, i in reversed(list(zip(events, ids, strict=True)))}
            await record_coverage(st, [first[i] for i in fresh], now=now)
            ordered_new = [i for i in dict.fromkeys(ids) if i in fresh]
            rows = [
                NewOutboxRow(
                    ROUTE_EVENT,
                    {"event_ids": [str(i) for i in ordered_new[k : k + _ROUTE_CHUNK]]},
                )
                for k in range(0, len(ordered_new), _ROUTE_CHUNK)
            ]
            if later:
                rows.append(NewOutboxRow(ROUTE_EVENT, deferred_payload(later, now)))
            await write_outbox(t, rows, now)
        return AcceptResult(ids, len(fresh), len(events) - len(fresh))


async def _check_producer(
    conn: AsyncConnection, producer: Producer, events: Sequence[DatasetEvent]
) -> None:
    t, j = schema.tasks, schema.jobs
    # The same status test as a fenced completion (one rule for every reply).
    replying = reply_accepted(TASKS).label("replying")
    stmt = (
        sa.select(t.c.status, t.c.attempt, replying, j.c.output_datasets)
        .join(j, j.c.id == t.c.job_id)
        .where(t.c.id == producer.task_id)
    )
    if conn.dialect.name == "postgresql":
        # A claim of a newer attempt waits for this acceptance to commit (and
        # vice versa), so "current attempt" is judged consistently.
        stmt = stmt.with_for_update(read=True, of=t)
    row = (await conn.execute(stmt)).one_or_none()
    if row is None:
        raise StaleClaim("tasks", producer.task_id, "no such task")
    status, attempt, replying, outputs = row
    if attempt != producer.attempt:
        raise StaleClaim(
            "tasks",
            producer.task_id,
            f"attempt {producer.attempt} is not current (attempt {attempt}, {status})",
        )
    if status == TASKS.done:
        # Answered as the completion itself answers a repeated report, so a
        # repeated completion with final events is recognized as a duplicate.
        raise InvalidTransition(TASKS.lifecycle.name, status, TASKS.done, producer.task_id)
    if not replying:
        raise StaleClaim(
            "tasks", producer.task_id, f"attempt {attempt} has ended ({status}): it emits nothing"
        )
    produced = {str(o) for o in outputs or ()}
    for i, event in enumerate(events):
        if str(event.dataset_uuid) not in produced:
            raise InvalidInput(
                f"events[{i}].dataset_uuid",
                f"dataset {event.dataset_uuid} is not an output of the producing task's job",
            )


async def _check_versions(conn: AsyncConnection, events: Sequence[DatasetEvent]) -> None:
    v = schema.dataset_versions
    wanted = {e.dataset_version for e in events}
    rows = await conn.execute(sa.select(v.c.id, v.c.dataset_uuid).where(v.c.id.in_(wanted)))
    owner = {r[0]: r[1] for r in rows}
    for i, event in enumerate(events):
        if event.dataset_version not in owner:
            raise InvalidInput(
                f"events[{i}].dataset_version", f"unknown dataset version {event.dataset_version}"
            )
        if owner[event.dataset_version] != event.dataset_uuid:
            raise InvalidInput(
                f"events[{i}].dataset_version",
                f"{event.dataset_version} is not a version of dataset {event.dataset_uuid}",
            )


async def _upsert_events(
    tx: SqlTransaction,
    events: Sequence[DatasetEvent],
    producer: Producer | None,
    now: datetime,
) -> tuple[list[uuid.UUID], set[uuid.UUID], dict[uuid.UUID, int]]:
    """Insert new events, count redeliveries; the id of each, the new ids and
    the redelivery counts left for the router (Postgres, events being routed)."""
    e = schema.events
    unique: dict[tuple[uuid.UUID, str], DatasetEvent] = {}
    copies: dict[tuple[uuid.UUID, str], int] = {}
    for event in events:
        key = (event.dataset_version, event.unit_key)
        unique.setdefault(key, event)
        copies[key] = copies.get(key, 0) + 1
    pg = tx.engine_name == "postgres"
    text: dict[uuid.UUID | datetime, str] = {}

    def value(v: uuid.UUID | datetime | None) -> Any:
        # Postgres rows travel as JSON: format each distinct id and time once
        if not pg or v is None:
            return v
        return text.get(v) or text.setdefault(
            v, v.hex if isinstance(v, uuid.UUID) else v.isoformat()
        )

    block = id_block()  # time-ordered ids: appended to the primary key, not scattered
    producer_id = value(None if producer is None else producer.task_id)
    at = value(now)
    rows = [
        {
            "id": f"{block}{n:08x}" if pg else uuid.UUID(f"{block}{n:08x}"),
            "dataset_uuid": value(ev.dataset_uuid),
            "dataset_version": value(ev.dataset_version),
            "unit_key": ev.unit_key,
            "cursor": None if ev.cursor is None else str(ev.cursor),
            "partition_key": ev.partition_key,
            "range_start": ev.start,
            "range_end": ev.end,
            "origin": "manual" if producer is None else "task",
            "producer_task_id": producer_id,
            "producer_attempt": None if producer is None else producer.attempt,
            "received_at": at,
            "last_received_at": at,
            "deliveries": copies[(ev.dataset_version, ev.unit_key)],
            "route_status": "pending",
            "tasks_created": 0,
            "tasks_existing": 0,
        }
        # In unique-key order, the order routing locks events in
        # (``routing._pending``): accepts inserting the same new units wait
        # for each other in one order instead of deadlocking.
        for n, (_, ev) in enumerate(sorted(unique.items()))
    ]
    if pg:
        return await _upsert_events_pg(tx, events, rows, copies, now)
    insert = tx.insert(e)
    stmt = insert.on_conflict_do_update(
        index_elements=[e.c.dataset_version, e.c.unit_key],
        set_={
            "deliveries": e.c.deliveries + insert.excluded.deliveries,
            "last_received_at": insert.excluded.last_received_at,
        },
    ).returning(e.c.id, e.c.dataset_version, e.c.unit_key, e.c.deliveries)
    result = await tx.connection.execute(stmt, rows)
    by_key: dict[tuple[uuid.UUID, str], uuid.UUID] = {}
    fresh: set[uuid.UUID] = set()
    for row_id, version, unit_key, deliveries in result.all():
        by_key[(version, unit_key)] = row_id
        # inserted now: its count is this request's copies; else it grew past them
        if deliveries == copies[(version, unit_key)]:
            fresh.add(row_id)
    ids = [by_key[(ev.dataset_version, ev.unit_key)] for ev in events]
    return ids, fresh, {}


async def _upsert_events_pg(
    tx: SqlTransaction,
    events: Sequence[DatasetEvent],
    rows: list[dict[str, Any]],
    copies: Mapping[tuple[uuid.UUID, str], int],
    now: datetime,
) -> tuple[list[uuid.UUID], set[uuid.UUID], dict[uuid.UUID, int]]:
    """Postgres: insert the new events; count redeliveries without waiting for
    a routing that holds them (:mod:`~trace_core.dispatcher.redeliveries`)."""
    e = schema.events
    stmt = (
        bulk_insert(e, list(rows[0]))
        .on_conflict_do_nothing(index_elements=[e.c.dataset_version, e.c.unit_key])
        .returning(e.c.id, e.c.dataset_version, e.c.unit_key)
    )
    result = await tx.connection.execute(stmt, {"rows": records_param(rows)})
    by_key = {(version, unit_key): row_id for row_id, version, unit_key in result.all()}
    fresh = set(by_key.values())
    later: dict[uuid.UUID, int] = {}
    stored = {key: n for key, n in copies.items() if key not in by_key}
    if stored:
        found, later = await count_redeliveries(tx.connection, stored, now)
        by_key.update(found)
    ids = [by_key[(ev.dataset_version, ev.unit_key)] for ev in events]
    return ids, fresh, later
