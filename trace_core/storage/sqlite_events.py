"""SQLite: a request's new events in ONE statement, sent as one JSON parameter.

The SQLite side of :meth:`~trace_core.storage.sql_events.SqlEventOps.store_events`
(Postgres: :mod:`~trace_core.storage.sql_events_insert`). Sent as one
SQLAlchemy ``executemany`` of 17 bound columns per event, binding (a type
processor per value) was most of an acceptance's client time. Here the units
travel as one JSON array of arrays (encoded in C), what is the same for every
event (origin, producer, time) once, and SQLite unpacks them with
``json_each``: the upsert stores each new unit with a time-ordered id (the
block of :func:`~trace_core.storage.bulk.id_block` plus the unit's place in
the request) and adds the copies of a stored one to its deliveries, and
answers every unit's row.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from trace_core.storage import schema
from trace_core.storage.bulk import id_block
from trace_core.storage.ports.events import NewEvent

__all__ = ["STORE_EVENTS", "store_events_params"]

_e = schema.events

# WHERE true: an INSERT … SELECT followed by ON CONFLICT needs it (else the
# parser reads ON as a join constraint). Units are unique in a request.
STORE_EVENTS = (
    sa.text(
        """
INSERT INTO events (id, dataset_uuid, dataset_version, unit_key, cursor, partition_key,
                    range_start, range_end, origin, producer_task_id, producer_attempt,
                    received_at, last_received_at, deliveries, route_status,
                    tasks_created, tasks_existing)
SELECT :id_prefix || printf('%08x', r.key), json_extract(r.value, '$[0]'),
       json_extract(r.value, '$[1]'), json_extract(r.value, '$[2]'),
       json_extract(r.value, '$[3]'), json_extract(r.value, '$[4]'),
       json_extract(r.value, '$[5]'), json_extract(r.value, '$[6]'), :origin,
       :producer_task_id, :producer_attempt, :now, :now, json_extract(r.value, '$[7]'),
       'pending', 0, 0
FROM json_each(:units) AS r WHERE true
ON CONFLICT (dataset_version, unit_key)
DO UPDATE SET deliveries = events.deliveries + excluded.deliveries,
              last_received_at = excluded.last_received_at
RETURNING id, dataset_version, unit_key, deliveries"""
    )
    .bindparams(sa.bindparam("now", type_=_e.c.received_at.type))
    .columns(_e.c.id, _e.c.dataset_version, _e.c.unit_key, _e.c.deliveries)
)
"""The upsert; its parameters are :func:`store_events_params`'s. It answers
``(id, dataset_version, unit_key, deliveries)`` for every unit: a unit
inserted now has this request's copies, a stored one more."""


def store_events_params(
    events: Sequence[NewEvent], *, producer: tuple[uuid.UUID, int] | None, now: datetime
) -> dict[str, Any]:
    """The parameters of :data:`STORE_EVENTS` for ``events`` accepted at
    ``now`` from ``producer`` (``None``: a manual event)."""
    hexes: dict[uuid.UUID, str] = {}

    def hexed(value: uuid.UUID) -> str:
        # few distinct datasets and versions per request: format each once
        return hexes.get(value) or hexes.setdefault(value, value.hex)

    units = [
        [
            hexed(ev.dataset_uuid),
            hexed(ev.dataset_version),
            ev.unit_key,
            ev.cursor,
            ev.partition_key,
            ev.start,
            ev.end,
            ev.copies,
        ]
        for ev in events
    ]
    return {
        "id_prefix": id_block(),
        "units": json.dumps(units),
        "origin": "manual" if producer is None else "task",
        "producer_task_id": None if producer is None else producer[0].hex,
        "producer_attempt": None if producer is None else producer[1],
        "now": now,
    }
