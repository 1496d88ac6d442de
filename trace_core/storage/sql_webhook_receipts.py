"""The webhook receipts area (:mod:`trace_core.storage.ports.webhook_receipts`) in SQL.

Both "remember" operations are one ``INSERT … ON CONFLICT`` with
``RETURNING`` (SQLite >= 3.35 and Postgres alike): the primary key decides
between concurrent callers, never a read followed by a write.
"""

from __future__ import annotations

import uuid
from datetime import datetime

import sqlalchemy as sa

from trace_core.storage import schema
from trace_core.storage.sql_area import SqlArea

__all__ = ["SqlWebhookReceiptOps"]


class SqlWebhookReceiptOps(SqlArea):
    """The port's ``WebhookReceiptOps`` on a SQL transaction."""

    async def remember_nonce_if_unused(
        self, nonce: str, *, now: datetime, expires_at: datetime
    ) -> bool:
        n = schema.webhook_nonces
        insert = self._tx.insert(n).values(nonce=nonce, expires_at=expires_at)
        # A live record wins (replay); an expired one not yet pruned is taken over.
        stmt = insert.on_conflict_do_update(
            index_elements=[n.c.nonce],
            set_={"expires_at": insert.excluded.expires_at},
            where=n.c.expires_at <= sa.bindparam("now", now, type_=n.c.expires_at.type),
        ).returning(n.c.nonce)
        return bool(await self._rows("remember webhook nonce", stmt))

    async def remember_event_if_new(self, event_id: uuid.UUID, *, now: datetime) -> bool:
        e = schema.webhook_events_seen
        stmt = (
            self._tx.insert(e)
            .values(event_id=event_id, received_at=now)
            .on_conflict_do_nothing(index_elements=[e.c.event_id])
            .returning(e.c.event_id)
        )
        return bool(await self._rows("remember webhook event", stmt))

    async def prune_expired_nonces(self, *, now: datetime, limit: int) -> int:
        n = schema.webhook_nonces
        pick = sa.select(n.c.nonce).where(n.c.expires_at <= now).limit(limit)
        stmt = sa.delete(n).where(n.c.nonce.in_(pick.scalar_subquery()))
        return await self._count("prune webhook nonces", stmt)

    async def prune_events_received_before(self, cutoff: datetime, *, limit: int) -> int:
        e = schema.webhook_events_seen
        pick = sa.select(e.c.event_id).where(e.c.received_at < cutoff).limit(limit)
        stmt = sa.delete(e).where(e.c.event_id.in_(pick.scalar_subquery()))
        return await self._count("prune webhook events", stmt)
