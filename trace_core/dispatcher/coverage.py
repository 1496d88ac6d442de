"""Recording coverage: accepted events advance their dataset versions' progress.

Coverage (merged block ranges and the highest cursor, see
:mod:`trace_core.dag.coverage`) is advanced in the transaction that accepts
the events, so it is committed before those events are routed. That order is
what makes the ``PerPartition`` join race-free: whichever input's event is
routed last sees every input's coverage.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa

from trace_core.authoring.events import DatasetEvent
from trace_core.dag.coverage import Range, merge_ranges
from trace_core.storage import schema
from trace_core.storage.sql import SqlTransaction

__all__ = ["record_coverage"]


async def record_coverage(
    tx: SqlTransaction, events: Sequence[DatasetEvent], *, now: datetime
) -> None:
    """Fold newly accepted ``events`` into their versions' progress rows."""
    by_version: dict[uuid.UUID, list[DatasetEvent]] = {}
    for event in events:
        by_version.setdefault(event.dataset_version, []).append(event)
    fold = _fold_in_sql if tx.engine_name == "postgres" else _fold_in_python
    for version in sorted(by_version):  # a fixed lock order: no deadlock between acceptors
        batch = by_version[version]
        spans = merge_ranges(
            (e.start, e.end) for e in batch if e.start is not None and e.end is not None
        )
        cursor = max((e.cursor for e in batch if isinstance(e.cursor, int)), default=None)
        await fold(tx, _Fold(version, batch[0].dataset_uuid, spans, cursor, len(batch), now))


@dataclass(frozen=True)
class _Fold:
    """What one acceptance adds to one dataset version's progress row."""

    version: uuid.UUID
    dataset_uuid: uuid.UUID
    spans: list[Range]
    """Merged inclusive block ranges."""
    cursor: int | None
    """The highest integer cursor, if any."""
    count: int
    now: datetime


# One round trip: insert the row or, row-locked by ON CONFLICT, merge into it.
# The merge is merge_ranges' in SQL: int8range(start, end, '[]') makes
# inclusive bounds canonical ([start, end + 1)), and range_agg joins ranges
# that overlap or touch, so the stored ranges are identical (unnest reads a
# multirange out in ascending order). Reading the growing range list into
# Python and writing it back cost two more round trips and ~15 ms of client
# CPU per 500-event acceptance (its JSON both ways, the merge) once shuffled
# partitions had left a few thousand ranges.
_FOLD = sa.text(
    """
INSERT INTO dataset_version_progress AS p
       (dataset_version, dataset_uuid, ranges, max_cursor, events, updated_at)
VALUES (:version, :dataset_uuid, CAST(:ranges AS jsonb), CAST(:max_cursor AS bigint), :events,
        :now)
ON CONFLICT (dataset_version) DO UPDATE SET
    ranges = (
        SELECT coalesce(jsonb_agg(jsonb_build_array(lower(r), upper(r) - 1)), '[]')
        FROM unnest((
            SELECT range_agg(int8range(CAST(x ->> 0 AS bigint), CAST(x ->> 1 AS bigint), '[]'))
            FROM jsonb_array_elements(p.ranges || excluded.ranges) AS x
        )) AS r
    ),
    max_cursor = greatest(p.max_cursor, excluded.max_cursor),
    events = p.events + excluded.events,
    updated_at = excluded.updated_at
"""
)


async def _fold_in_sql(tx: SqlTransaction, fold: _Fold) -> None:
    """Postgres: merge on the server (:data:`_FOLD`, multiranges: PostgreSQL 14+)."""
    await tx.connection.execute(
        _FOLD,
        {
            "version": fold.version,
            "dataset_uuid": fold.dataset_uuid,
            "ranges": json.dumps(fold.spans),
            "max_cursor": fold.cursor,
            "events": fold.count,
            "now": fold.now,
        },
    )


async def _fold_in_python(tx: SqlTransaction, fold: _Fold) -> None:
    """SQLite: read the row, merge with :func:`merge_ranges`, write it back
    (in-process, the round trips cost nothing; SQLite has no range types)."""
    conn = tx.connection
    p = schema.dataset_version_progress
    await conn.execute(
        tx.insert(p)
        .values(
            dataset_version=fold.version,
            dataset_uuid=fold.dataset_uuid,
            ranges=[],
            max_cursor=None,
            events=0,
            updated_at=fold.now,
        )
        .on_conflict_do_nothing()
    )
    ranges, max_cursor, events = (
        await conn.execute(
            sa.select(p.c.ranges, p.c.max_cursor, p.c.events).where(
                p.c.dataset_version == fold.version
            )
        )
    ).one()
    cursors = [c for c in (fold.cursor, max_cursor) if c is not None]
    await conn.execute(
        sa.update(p)
        .where(p.c.dataset_version == fold.version)
        .values(
            ranges=[list(r) for r in merge_ranges([*(ranges or ()), *fold.spans])],
            max_cursor=max(int(c) for c in cursors) if cursors else None,
            events=int(events) + fold.count,
            updated_at=fold.now,
        )
    )
