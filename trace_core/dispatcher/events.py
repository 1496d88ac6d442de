"""Upstream events: validation, producer fencing and durable acceptance.

An event says that a dataset version materialized one unit of work: a cursor
position or a partition (``{start}-{end}``, inclusive, for block ranges).
Accepting events stores each once per ``(dataset_version, unit_key)`` (a
redelivery only bumps its ``deliveries`` count; on Postgres, for an event
being routed, the router applies it later:
:mod:`~trace_core.dispatcher.redeliveries`), advances the version's coverage,
and writes one ``route_event`` outbox row for the new ones, all in the
caller's transaction (on Postgres, after the producer check, as one
statement: :mod:`~trace_core.storage.sql_events_accept`). Routing happens
after commit, from the outbox, so a crash between the two loses nothing.

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

from trace_core.authoring.events import AcceptResult, DatasetEvent
from trace_core.clock import Clock, SystemClock
from trace_core.dispatcher.coverage import record_coverage
from trace_core.dispatcher.redeliveries import REDELIVERIES, deferred_at, deferred_payload
from trace_core.errors import InvalidInput, InvalidTransition, StaleClaim
from trace_core.model import TASKS
from trace_core.outbox import OUTBOX_CHANNEL, write_outbox
from trace_core.storage.ports.events import NewEvent, ProducerAttempt, RouteRows
from trace_core.storage.protocol import NewOutboxRow, Repository, Transaction, within
from trace_core.storage.sql_errors import translate_errors

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
            now = self.clock.now()
            versions = {e.dataset_version for e in events}
            if producer is None:
                owners = await t.events.datasets_of_versions(versions)
            else:
                found, owners = await t.events.lock_producer_and_versions(
                    producer.task_id, versions
                )
                _check_producer(found, producer, events)
            _check_versions(owners, events)
            if t.events.accepts_in_one_statement:
                ids, fresh = await _accept_in_one_statement(t, events, producer, now)
                return AcceptResult(ids, len(fresh), len(events) - len(fresh))
            ids, fresh, later = await _store_events(t, events, producer, now)
            first = {i: e for e, i in reversed(list(zip(events, ids, strict=True)))}
            await record_coverage(t, [first[i] for i in fresh], now=now)
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


def _check_producer(
    found: ProducerAttempt | None, producer: Producer, events: Sequence[DatasetEvent]
) -> None:
    # ``found`` is locked (Postgres): a claim of a newer attempt waits for this
    # acceptance to commit (and vice versa), so "current attempt" is judged
    # consistently.
    if found is None:
        raise StaleClaim("tasks", producer.task_id, "no such task")
    status, attempt, replying = found.status, found.attempt, found.replying
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
    produced = {d.int for d in found.output_datasets}
    # uuids hash in Python: compare their integers, distinct ones once
    if {e.dataset_uuid.int for e in events} <= produced:
        return
    for i, event in enumerate(events):
        if event.dataset_uuid.int not in produced:
            raise InvalidInput(
                f"events[{i}].dataset_uuid",
                f"dataset {event.dataset_uuid} is not an output of the producing task's job",
            )


def _check_versions(owner: Mapping[uuid.UUID, uuid.UUID], events: Sequence[DatasetEvent]) -> None:
    # Each distinct (version, dataset) pair once, as integers (a uuid hashes in
    # Python); the event-by-event pass below only names the first bad event.
    known = {version.int: dataset.int for version, dataset in owner.items()}
    pairs = {(e.dataset_version.int, e.dataset_uuid.int) for e in events}
    if all(known.get(version) == dataset for version, dataset in pairs):
        return
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


def _new_events(events: Sequence[DatasetEvent]) -> list[NewEvent]:
    """The request's distinct units with their copies, in unique-key order."""
    return _units(events)[0]


def _units(events: Sequence[DatasetEvent]) -> tuple[list[NewEvent], list[int]]:
    """The request's distinct units with their copies, in unique-key order, and
    for each event the index of its unit in that list."""
    # Keyed by the version's integer: a uuid hashes and compares in Python, and
    # a request has hundreds of events. Integers order as uuids do.
    unique: dict[tuple[int, str], tuple[int, DatasetEvent, str]] = {}
    copies: dict[tuple[int, str], int] = {}
    keys = []
    for position, event in enumerate(events):
        unit_key = event.unit_key
        key = (event.dataset_version.int, unit_key)
        keys.append(key)
        if key in unique:
            copies[key] += 1
        else:
            unique[key] = (position, event, unit_key)
            copies[key] = 1
    # In unique-key order, the order routing locks events in
    # (``RoutingOps.lock_pending_events``): accepts inserting the same
    # new units wait for each other in one order instead of deadlocking.
    ordered = sorted(unique)
    slot = {key: n for n, key in enumerate(ordered)}
    new = []
    for key in ordered:
        position, ev, unit_key = unique[key]
        new.append(
            NewEvent(
                dataset_uuid=ev.dataset_uuid,
                dataset_version=ev.dataset_version,
                unit_key=unit_key,
                cursor=None if ev.cursor is None else str(ev.cursor),
                partition_key=ev.partition_key,
                start=ev.start,
                end=ev.end,
                copies=copies[key],
                position=position,
                # coverage's max_cursor counts integer cursors only (record_coverage)
                int_cursor=ev.cursor if isinstance(ev.cursor, int) else None,
            )
        )
    return new, [slot[key] for key in keys]


def _producer_key(producer: Producer | None) -> tuple[uuid.UUID, int] | None:
    return None if producer is None else (producer.task_id, producer.attempt)


async def _store_events(
    tx: Transaction,
    events: Sequence[DatasetEvent],
    producer: Producer | None,
    now: datetime,
) -> tuple[list[uuid.UUID], set[uuid.UUID], dict[uuid.UUID, int]]:
    """Insert new events, count redeliveries; the id of each, the new ids and
    the redelivery counts left for the router (Postgres, events being routed)."""
    stored = await tx.events.store_events(
        _new_events(events), producer=_producer_key(producer), now=now
    )
    ids = [stored.ids[(ev.dataset_version, ev.unit_key)] for ev in events]
    return ids, stored.fresh, stored.later


async def _accept_in_one_statement(
    tx: Transaction,
    events: Sequence[DatasetEvent],
    producer: Producer | None,
    now: datetime,
) -> tuple[list[uuid.UUID], set[uuid.UUID]]:
    """Postgres: store, count, fold and write the outbox rows in one statement
    (the same rows as the generic path); the id of each event and the new ids."""
    units, slots = _units(events)
    stored = await tx.events.accept_in_one_statement(
        units,
        producer=_producer_key(producer),
        now=now,
        rows=RouteRows(
            kind=ROUTE_EVENT,
            ids_key="event_ids",
            chunk=_ROUTE_CHUNK,
            deferred_key=REDELIVERIES,
            at=deferred_at(now),
            channel=OUTBOX_CHANNEL,
            max_attempts=NewOutboxRow.max_attempts,
        ),
    )
    if stored.later:  # units another acceptance stored meanwhile, held by a routing
        await write_outbox(
            tx, [NewOutboxRow(ROUTE_EVENT, deferred_payload(stored.later, now))], now
        )
    unit_ids = [stored.ids[(unit.dataset_version, unit.unit_key)] for unit in units]
    return [unit_ids[slot] for slot in slots], stored.fresh
