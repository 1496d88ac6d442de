"""The handover area (:mod:`trace_core.storage.ports.handover`) in SQL, for both engines."""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa

from trace_core.model import Fence, QueueSpec
from trace_core.storage.queue_tables import QUEUE_TABLES
from trace_core.storage.sql_area import SqlArea
from trace_core.storage.sql_leasing import status_in

__all__ = ["SqlHandoverOps"]


def _prefix_pattern(prefix: str) -> str:
    """A ``LIKE`` pattern matching ids that start with ``prefix`` taken literally."""
    escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"{escaped}%"


class SqlHandoverOps(SqlArea):
    """:class:`~trace_core.storage.ports.handover.HandoverOps` on a SQL transaction."""

    async def revoke_leases(
        self, queue: QueueSpec, *, worker_prefix: str, now: datetime, limit: int
    ) -> list[Fence]:
        if not worker_prefix:
            raise ValueError("worker_prefix must not be empty: it would match every holder")
        qt = QUEUE_TABLES[queue.name]
        c = qt.c
        held = sa.and_(
            status_in(c.status, queue.leased),
            c.worker_id.like(_prefix_pattern(worker_prefix), escape="\\"),
        )
        # Picked first, then updated by id: LIMIT in an UPDATE is not portable,
        # and the rows of a gone holder are few (its workers' concurrency).
        pick = sa.select(c.id).where(held).order_by(c.id).limit(limit)
        ids = [row[0] for row in await self._rows("leases held by a gone holder", pick)]
        if not ids:
            return []
        stmt = (
            sa.update(qt.table)
            .where(c.id.in_(ids), held)
            .values({c.lease_expires_at: now, c.claim_version: c.claim_version + 1})
            .returning(c.id, qt.attempt, c.lease_token, c.claim_version)
        )
        rows = await self._rows("revoke leases", stmt)
        return [Fence(r[0], r[1], r[2], r[3]) for r in sorted(rows, key=lambda r: str(r[0]))]
