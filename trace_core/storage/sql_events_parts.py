"""SQL fragments the events statements share (Postgres).

:mod:`~trace_core.storage.sql_events` runs them on their own (counting a
request's redeliveries, folding one version's progress);
:mod:`~trace_core.storage.sql_events_accept` puts them in its one-statement
acceptance.
"""

from __future__ import annotations

__all__ = ["COUNT_CTES", "FOLD_MERGE"]

# Redeliveries on Postgres, counted without waiting for a routing.
# A redelivered event only bumps its ``deliveries`` and ``last_received_at``.
# But routing holds the row locks of the events it routes until it commits, so
# an accept that bumped a redelivery of one of them in place would wait for
# that whole routing (seconds under load: a producer retrying a request while
# its first copy is routed). Instead the accept bumps at once the rows no one
# holds (FOR UPDATE SKIP LOCKED) and returns the counts of the others, which
# the caller leaves for the router (apply_deferred_deliveries).
# c: the request's redelivered units with their copies; found: their rows;
# free: those no transaction holds, locked in the order routing locks events;
# bumped: the counts applied now. The rest is returned as not counted.
COUNT_CTES = """found AS (  -- one unique-index probe per unit (never a scan of every event)
    SELECT e.id, e.dataset_version, e.unit_key, c.n
    FROM c CROSS JOIN LATERAL (
        SELECT e.id, e.dataset_version, e.unit_key FROM events e
        WHERE e.dataset_version = c.dataset_version AND e.unit_key = c.unit_key
        OFFSET 0
    ) AS e
), free AS (  -- found's ids as one array: primary-key probes, never a scan of every event
    SELECT e.id FROM events e WHERE e.id = ANY(ARRAY(SELECT id FROM found))
    ORDER BY e.dataset_version, e.unit_key COLLATE "C"
    FOR UPDATE SKIP LOCKED
), bumped AS (
    UPDATE events SET deliveries = events.deliveries + found.n, last_received_at = :now
    FROM found
    WHERE events.id = ANY(ARRAY(SELECT id FROM free)) AND events.id = found.id
    RETURNING events.id
)"""
"""The CTEs ``found``, ``free`` and ``bumped`` of the redelivery count, over a
CTE ``c(dataset_version, unit_key, n)`` of the redelivered units."""

# One round trip: insert the row or, row-locked by ON CONFLICT, merge into it.
# The merge is merge_ranges' in SQL: int8range(start, end, '[]') makes
# inclusive bounds canonical ([start, end + 1)), and range_agg joins ranges
# that overlap or touch, so the stored ranges are identical (unnest reads a
# multirange out in ascending order). Reading the growing range list into
# Python and writing it back cost two more round trips and ~15 ms of client
# CPU per 500-event acceptance (its JSON both ways, the merge) once shuffled
# partitions had left a few thousand ranges. Multiranges: PostgreSQL 14+.
FOLD_MERGE = """ON CONFLICT (dataset_version) DO UPDATE SET
    ranges = (
        SELECT coalesce(jsonb_agg(jsonb_build_array(lower(r), upper(r) - 1)), '[]')
        FROM unnest((
            SELECT range_agg(int8range(CAST(x ->> 0 AS bigint), CAST(x ->> 1 AS bigint), '[]'))
            FROM jsonb_array_elements(p.ranges || excluded.ranges) AS x
        )) AS r
    ),
    max_cursor = greatest(p.max_cursor, excluded.max_cursor),
    events = p.events + excluded.events,
    updated_at = excluded.updated_at"""
"""How a fold merges into an existing progress row (the row's alias is ``p``)."""
