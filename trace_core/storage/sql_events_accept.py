"""Postgres: a whole acceptance in ONE statement (data-modifying CTEs).

An acceptance was a chain of round trips after the producer check: insert the
new events (:data:`~trace_core.storage.sql_events_insert.INSERT_EVENTS`),
count the redeliveries, fold the new events into their versions' progress
rows, insert the ``route_event`` outbox rows, notify the relays. A producer
sends its requests one after the other, so each round trip (and each wake-up
of the client between them, on a busy machine) was on the path of every
request. Here one statement does it all, with the same rows, locks and lock
order:

- ``r``: the request's distinct units, sent as columns (in unique-key order);
- ``ins``: the new ones inserted, in that order (``ON CONFLICT DO NOTHING``);
- ``c``/``found``/``free``/``bumped``: the redeliveries counted at once where
  no routing holds the row, the others left for the router
  (:data:`~trace_core.storage.sql_events_parts.COUNT_CTES`);
- ``fold``: the new events' ranges, highest integer cursor and count merged
  into each version's progress row, versions in order
  (:data:`~trace_core.storage.sql_events_parts.FOLD_MERGE`);
- ``out``: the outbox rows: the new ids in the order of the request, ``chunk``
  per row, then one row for the counts left for the router;
- ``note``: ``pg_notify`` of the relays' channel when rows were written.

A statement sees the rows committed before it began. A unit another
acceptance stored after that is neither inserted (it conflicts) nor found:
the answer names it, and the caller counts it with the generic statement.
"""

from __future__ import annotations

import sqlalchemy as sa

from trace_core.storage import schema
from trace_core.storage.sql_events_insert import INSERT_NEW_EVENTS, rows_from
from trace_core.storage.sql_events_parts import COUNT_CTES, FOLD_MERGE

__all__ = ["ACCEPT_EVENTS"]

ACCEPT_EVENTS = sa.text(
    f"""
WITH r AS MATERIALIZED (
    SELECT * FROM {rows_from(fold=True)}
), ins AS (
    {INSERT_NEW_EVENTS.replace("{source}", "r")}
), c AS (  -- the units stored before (the others, just inserted, no statement here sees)
    SELECT r.dataset_version, r.unit_key, r.copies AS n FROM r
    WHERE NOT EXISTS (SELECT FROM ins
                      WHERE ins.dataset_version = r.dataset_version AND ins.unit_key = r.unit_key)
), {COUNT_CTES}, fresh AS (
    SELECT ins.id, r.* FROM ins
    JOIN r ON r.dataset_version = ins.dataset_version AND r.unit_key = ins.unit_key
), g AS (
    SELECT dataset_version, (array_agg(dataset_uuid))[1] AS dataset_uuid,
           range_agg(int8range(range_start, range_end, '[]'))
               FILTER (WHERE range_start IS NOT NULL AND range_end IS NOT NULL) AS spans,
           max(int_cursor) AS max_cursor, count(*) AS events
    FROM fresh GROUP BY dataset_version
), fold AS (
    INSERT INTO dataset_version_progress AS p
           (dataset_version, dataset_uuid, ranges, max_cursor, events, updated_at)
    SELECT g.dataset_version, g.dataset_uuid,
           coalesce((SELECT jsonb_agg(jsonb_build_array(lower(x), upper(x) - 1))
                     FROM unnest(g.spans) AS x), '[]'),
           g.max_cursor, g.events, :now
    FROM g ORDER BY g.dataset_version
    {FOLD_MERGE}
), out AS (
    INSERT INTO outbox (kind, payload, status, available_at, attempts, claim_version,
                        max_attempts, created_at)
    SELECT CAST(:kind AS text), payload, 'Pending', :now, 0, 0, :max_attempts, :now
    FROM (
        SELECT chunk, jsonb_build_object(CAST(:ids_key AS text),
                                         jsonb_agg(CAST(id AS text) ORDER BY first_seen)) AS payload
        FROM (SELECT id, first_seen, (row_number() OVER (ORDER BY first_seen) - 1) / :chunk AS chunk
              FROM fresh) AS numbered
        GROUP BY chunk
        UNION ALL
        SELECT NULL, jsonb_build_object(
                   CAST(:deferred_key AS text),
                   jsonb_agg(jsonb_build_array(CAST(found.id AS text), found.n) ORDER BY found.id),
                   'at', CAST(:at AS text))
        FROM found LEFT JOIN bumped ON bumped.id = found.id
        WHERE bumped.id IS NULL
        HAVING count(*) > 0
    ) AS rows
    ORDER BY chunk NULLS LAST
    RETURNING id
), note AS (
    SELECT count(pg_notify(CAST(:channel AS text), '')) AS n
    FROM (SELECT 1 FROM out LIMIT 1) AS written
)
SELECT ins.id, found.id, (SELECT n FROM note)
FROM r
LEFT JOIN ins ON ins.dataset_version = r.dataset_version AND ins.unit_key = r.unit_key
LEFT JOIN found ON found.dataset_version = r.dataset_version AND found.unit_key = r.unit_key
ORDER BY r.n
"""
).bindparams(sa.bindparam("now", type_=schema.events.c.received_at.type))
"""The statement. Its parameters: :func:`~trace_core.storage.sql_events_insert.insert_events_params`
(with ``fold``) plus the outbox rows' (``kind``, ``ids_key``, ``chunk``,
``deferred_key``, ``at``, ``max_attempts``, ``channel``). One row per unit,
in the order given: ``(id if inserted, id if stored before, notified)``; a
unit with neither id was stored meanwhile. Nothing else comes back: the
caller knows each unit's key, and every column answered is decoded on the
client (a uuid per row is an object to build)."""
