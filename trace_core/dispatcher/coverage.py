"""Recording coverage: accepted events advance their dataset versions' progress.

Coverage (merged block ranges and the highest cursor, see
:mod:`trace_core.dag.coverage`) is advanced in the transaction that accepts
the events, so it is committed before those events are routed. That order is
what makes the ``PerPartition`` join race-free: whichever input's event is
routed last sees every input's coverage.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING

import sqlalchemy as sa

from trace_core.dag.coverage import merge_ranges
from trace_core.storage import schema
from trace_core.storage.sql import SqlTransaction

if TYPE_CHECKING:
    from trace_core.dispatcher.events import DatasetEvent

__all__ = ["record_coverage"]


async def record_coverage(
    tx: SqlTransaction, events: Sequence[DatasetEvent], *, now: datetime
) -> None:
    """Fold newly accepted ``events`` into their versions' progress rows."""
    conn = tx.connection
    p = schema.dataset_version_progress
    by_version: dict[uuid.UUID, list[DatasetEvent]] = {}
    for event in events:
        by_version.setdefault(event.dataset_version, []).append(event)
    for version in sorted(by_version):  # a fixed lock order: no deadlock between acceptors
        batch = by_version[version]
        await conn.execute(
            tx.insert(p)
            .values(
                dataset_version=version,
                dataset_uuid=batch[0].dataset_uuid,
                ranges=[],
                max_cursor=None,
                events=0,
                updated_at=now,
            )
            .on_conflict_do_nothing()
        )
        stmt = sa.select(p.c.ranges, p.c.max_cursor, p.c.events).where(
            p.c.dataset_version == version
        )
        if conn.dialect.name == "postgresql":
            stmt = stmt.with_for_update()
        ranges, max_cursor, count = (await conn.execute(stmt)).one()
        spans = [tuple(r) for r in ranges or ()]
        spans += [(e.start, e.end) for e in batch if e.start is not None and e.end is not None]
        cursors = [e.cursor for e in batch if isinstance(e.cursor, int)]
        if max_cursor is not None:
            cursors.append(int(max_cursor))
        await conn.execute(
            sa.update(p)
            .where(p.c.dataset_version == version)
            .values(
                ranges=[list(r) for r in merge_ranges(spans)],
                max_cursor=max(cursors) if cursors else None,
                events=int(count) + len(batch),
                updated_at=now,
            )
        )
