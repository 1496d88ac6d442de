"""Postgres: a request's new events in ONE statement, sent as columns.

:meth:`~trace_core.storage.sql_events.SqlEventOps.store_events` inserts the
request's distinct units with ``ON CONFLICT DO NOTHING``. Sent as one JSON
record per event (17 keys each, most of them the same for every event of the
request), building and encoding those records was most of an acceptance's
client time. Here the request travels as a handful of parameters: what is
the same for every event (origin, producer, time, status) once, and each
varying column as one array (few distinct dataset ids: one Postgres array
literal built by ``join``; texts and numbers as JSON arrays, encoded in C).
The server unpacks the columns side by side (``ROWS FROM … WITH
ORDINALITY``) and inserts in input order, the unique-key order the caller
sorted the units in (so concurrent acceptances of the same new units wait
for each other in one order). Ids are time-ordered: the block of
:func:`~trace_core.storage.bulk.id_block` plus the row's ordinal.
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

__all__ = ["INSERT_EVENTS", "INSERT_NEW_EVENTS", "insert_events_params", "rows_from"]

_FOLD_COLUMNS = (
    ("unnest(CAST(:first_seen AS integer[]))", "first_seen"),
    ("unnest(CAST(:int_cursors AS bigint[]))", "int_cursor"),
)
"""What :mod:`~trace_core.storage.sql_events_accept` also unpacks: each
unit's first position in the request and its integer cursor."""


def rows_from(*, fold: bool = False) -> str:
    """The request's columns side by side as ``r`` (with ordinal ``n``), plus
    :data:`_FOLD_COLUMNS` when ``fold``."""
    extra = _FOLD_COLUMNS if fold else ()
    sources = ",\n    ".join([*(src for src, _ in extra)])
    names = "".join(f"{name}, " for _, name in extra)
    return f"""ROWS FROM (
    unnest(CAST(:dataset_uuids AS uuid[])),
    unnest(CAST(:dataset_versions AS uuid[])),
    jsonb_array_elements_text(CAST(:unit_keys AS jsonb)),
    jsonb_array_elements_text(CAST(:cursors AS jsonb)),
    jsonb_array_elements_text(CAST(:partition_keys AS jsonb)),
    unnest(CAST(:starts AS bigint[])),
    unnest(CAST(:ends AS bigint[])),
    unnest(CAST(:copies AS integer[])){"," if extra else ""}
    {sources}
) WITH ORDINALITY AS r(dataset_uuid, dataset_version, unit_key, cursor, partition_key,
                       range_start, range_end, copies, {names}n)"""


INSERT_NEW_EVENTS = """INSERT INTO events (id, dataset_uuid, dataset_version, unit_key, cursor,
                    partition_key, range_start, range_end, origin, producer_task_id,
                    producer_attempt, received_at, last_received_at, deliveries, route_status,
                    tasks_created, tasks_existing)
SELECT CAST(:id_prefix || lpad(to_hex(r.n), 8, '0') AS uuid), r.dataset_uuid,
       r.dataset_version, r.unit_key, r.cursor, r.partition_key, r.range_start, r.range_end,
       CAST(:origin AS text), CAST(:producer_task_id AS uuid),
       CAST(:producer_attempt AS integer), :now, :now, r.copies, 'pending', 0, 0
FROM {source} AS r
ORDER BY r.n
ON CONFLICT (dataset_version, unit_key) DO NOTHING
RETURNING id, dataset_version, unit_key"""
"""The insert of the request's rows (``{source}``: :func:`rows_from`, or a CTE of it)."""

INSERT_EVENTS = sa.text(INSERT_NEW_EVENTS.replace("{source} AS r", rows_from())).bindparams(
    sa.bindparam("now", type_=schema.events.c.received_at.type)
)
"""The statement; its parameters are :func:`insert_events_params`'s. It
answers ``(id, dataset_version, unit_key)`` for each event inserted."""


def _array(values: Sequence[str]) -> str:
    """A Postgres array literal of values that need no quoting (hex ids, integers)."""
    return "{" + ",".join(values) + "}"


def _bound(value: int | None) -> str:
    """A range bound in an array literal (an event without a range has NULL)."""
    return "NULL" if value is None else str(int(value))


def insert_events_params(
    events: Sequence[NewEvent],
    *,
    producer: tuple[uuid.UUID, int] | None,
    now: datetime,
    fold: bool = False,
) -> dict[str, Any]:
    """The parameters of :data:`INSERT_EVENTS` for ``events`` (in insert order)
    accepted at ``now`` from ``producer`` (``None``: a manual event); with
    ``fold``, those of :func:`rows_from`'s extra columns too."""
    hexes: dict[int, str] = {}

    def hexed(value: uuid.UUID) -> str:
        # few distinct datasets and versions per request: format each once
        # (keyed by its integer: a uuid hashes in Python)
        number = value.int
        return hexes.get(number) or hexes.setdefault(number, f"{number:032x}")

    extra = {}
    if fold:
        extra = {
            "first_seen": _array([str(ev.position) for ev in events]),
            "int_cursors": _array([_bound(ev.int_cursor) for ev in events]),
        }
    return {
        **extra,
        "id_prefix": id_block(),
        "dataset_uuids": _array([hexed(ev.dataset_uuid) for ev in events]),
        "dataset_versions": _array([hexed(ev.dataset_version) for ev in events]),
        "unit_keys": json.dumps([ev.unit_key for ev in events]),
        "cursors": json.dumps([ev.cursor for ev in events]),
        "partition_keys": json.dumps([ev.partition_key for ev in events]),
        "starts": _array([_bound(ev.start) for ev in events]),
        "ends": _array([_bound(ev.end) for ev in events]),
        "copies": _array([str(ev.copies) for ev in events]),
        "origin": "manual" if producer is None else "task",
        "producer_task_id": None if producer is None else producer[0].hex,
        "producer_attempt": None if producer is None else producer[1],
        "now": now,
    }
