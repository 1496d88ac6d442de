"""The webhook delivery area (:mod:`trace_core.storage.ports.webhook_delivery`) in SQL.

The ordered claim is the generic claim statement of
:class:`~trace_core.storage.sql_leasing.LeaseStatements` with one gate,
:func:`earlier_events_finished`, so the lease columns, the fresh token and
the Postgres ``FOR UPDATE SKIP LOCKED`` pick stay written once.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from trace_core.model import JOB_OUTBOX_EVENTS, Lease
from trace_core.storage import schema
from trace_core.storage.ports.webhook_delivery import WebhookTarget
from trace_core.storage.queue_tables import QueueTable
from trace_core.storage.sql_area import SqlArea, SqlStatements
from trace_core.storage.sql_leasing import ClaimGate, status_in

__all__ = ["SqlWebhookDeliveryOps", "earlier_events_finished"]

Claim = Callable[..., Awaitable[list[Lease]]]
"""``SqlTransaction.claim``: the generic claim, which takes a ``gate``."""


def earlier_events_finished(qt: QueueTable) -> sa.ColumnElement[bool]:
    """No event of the same job with a lower ``sequence`` is still unfinished
    (pending, or leased by a deliverer). Found through the job_id index."""
    c = qt.c
    earlier = schema.job_outbox_events.alias("earlier")
    return ~sa.exists().where(
        earlier.c.job_id == c.job_id,
        earlier.c.sequence < c.sequence,
        ~status_in(earlier.c.status, JOB_OUTBOX_EVENTS.lifecycle.terminal),
    )


_GATE: ClaimGate = earlier_events_finished


class SqlWebhookDeliveryOps(SqlArea):
    """The port's ``WebhookDeliveryOps`` on a SQL transaction."""

    def __init__(self, tx: SqlStatements, claim: Claim) -> None:
        super().__init__(tx)
        self._claim = claim

    async def claim_in_stage_order(
        self, *, worker_id: str, lease_seconds: float, now: datetime, limit: int
    ) -> list[Lease]:
        return await self._claim(
            JOB_OUTBOX_EVENTS,
            worker_id=worker_id,
            lease_seconds=lease_seconds,
            now=now,
            limit=limit,
            gate=_GATE,
        )

    async def targets(self, event_ids: Collection[uuid.UUID]) -> Mapping[uuid.UUID, WebhookTarget]:
        if not event_ids:
            return {}
        e, j = schema.job_outbox_events, schema.inbox_jobs
        stmt: sa.Select[Any] = (
            sa.select(e.c.id, j.c.id, j.c.requester_id, j.c.status_webhook_url)
            .select_from(e.join(j, j.c.id == e.c.job_id))
            .where(e.c.id.in_(list(event_ids)))
        )
        rows = await self._rows("webhook targets", stmt)
        return {r[0]: WebhookTarget(r[0], r[1], str(r[2]), r[3]) for r in rows}
