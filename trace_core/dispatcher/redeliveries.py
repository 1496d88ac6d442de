"""Counting redeliveries on Postgres without waiting for a routing.

A redelivered event only bumps its ``deliveries`` and ``last_received_at``.
But routing holds the row locks of the events it routes until it commits, so
an accept that bumped a redelivery of one of them in place would wait for
that whole routing (seconds under load: a producer retrying a request while
its first copy is routed). Instead the accept bumps at once the rows no one
holds (``FOR UPDATE SKIP LOCKED``) and leaves the counts of the others in a
``route_event`` outbox row of its own transaction; the router applies them
after commit (:func:`apply_redeliveries`), waiting for the lock there, off
the request's path. Counts are never lost, only late for events being routed.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from trace_core.storage.bulk import records_param

__all__ = ["REDELIVERIES", "apply_redeliveries", "count_redeliveries", "deferred_payload"]

REDELIVERIES = "redeliveries"
"""Key of a ``route_event`` payload that carries deferred counts, not events to route."""

# c: the request's redelivered units with their copies; found: their rows;
# free: those no transaction holds, locked in the order routing locks events;
# bumped: the counts applied now. The rest is returned as not counted.
_COUNT_NOW = sa.text(
    """
WITH c AS (
    SELECT * FROM jsonb_to_recordset(CAST(:rows AS jsonb))
        AS c(dataset_version uuid, unit_key text, n integer)
), found AS (
    SELECT e.id, e.dataset_version, e.unit_key, c.n
    FROM c JOIN events e ON e.dataset_version = c.dataset_version AND e.unit_key = c.unit_key
), free AS (
    SELECT e.id FROM events e WHERE e.id IN (SELECT id FROM found)
    ORDER BY e.dataset_version, e.unit_key COLLATE "C"
    FOR UPDATE SKIP LOCKED
), bumped AS (
    UPDATE events SET deliveries = events.deliveries + found.n, last_received_at = :now
    FROM found JOIN free ON free.id = found.id
    WHERE events.id = found.id
    RETURNING events.id
)
SELECT found.id, found.dataset_version, found.unit_key, found.n, bumped.id IS NOT NULL
FROM found LEFT JOIN bumped ON bumped.id = found.id
"""
)

# Deferred counts, applied by the router: wait for each row, locked in routing's order.
_APPLY = sa.text(
    """
WITH c AS (
    SELECT * FROM jsonb_to_recordset(CAST(:rows AS jsonb)) AS c(id uuid, n integer)
), locked AS (
    SELECT e.id FROM events e WHERE e.id IN (SELECT id FROM c)
    ORDER BY e.dataset_version, e.unit_key COLLATE "C"
    FOR UPDATE
)
UPDATE events
SET deliveries = events.deliveries + c.n,
    last_received_at = greatest(events.last_received_at, CAST(:at AS timestamptz))
FROM c JOIN locked ON locked.id = c.id
WHERE events.id = c.id
"""
)


async def count_redeliveries(
    conn: AsyncConnection, copies: Mapping[tuple[uuid.UUID, str], int], now: datetime
) -> tuple[dict[tuple[uuid.UUID, str], uuid.UUID], dict[uuid.UUID, int]]:
    """Bump the stored events of ``copies`` (``(dataset_version, unit_key)`` ->
    copies received) that no transaction holds; ``({key: event id}, {event
    id: copies not counted yet})``."""
    rows = [
        {"dataset_version": version.hex, "unit_key": unit_key, "n": n}
        for (version, unit_key), n in copies.items()
    ]
    result = await conn.execute(_COUNT_NOW, {"rows": records_param(rows), "now": now})
    ids: dict[tuple[uuid.UUID, str], uuid.UUID] = {}
    later: dict[uuid.UUID, int] = {}
    for event_id, version, unit_key, n, counted in result.all():
        ids[(version, unit_key)] = event_id
        if not counted:
            later[event_id] = n
    return ids, later


def deferred_payload(later: Mapping[uuid.UUID, int], now: datetime) -> dict[str, Any]:
    """The ``route_event`` payload that carries counts :func:`count_redeliveries` left."""
    return {REDELIVERIES: [[str(i), n] for i, n in sorted(later.items())], "at": now.isoformat()}


async def apply_redeliveries(conn: AsyncConnection, payload: Mapping[str, Any]) -> None:
    """Apply the counts of a :func:`deferred_payload` (waits for routings holding them)."""
    rows = [{"id": str(i), "n": int(n)} for i, n in payload[REDELIVERIES]]
    await conn.execute(_APPLY, {"rows": records_param(rows), "at": payload["at"]})
