"""Counting redeliveries without waiting for a routing.

A redelivered event only bumps its ``deliveries`` and ``last_received_at``.
But on Postgres routing holds the row locks of the events it routes until it
commits, so an accept that bumped a redelivery of one of them in place would
wait for that whole routing (seconds under load: a producer retrying a
request while its first copy is routed). Instead the accept bumps at once the
rows no one holds and leaves the counts of the others
(:meth:`~trace_core.storage.ports.events.EventOps.store_events`) in a
``route_event`` outbox row of its own transaction (:func:`deferred_payload`);
the router applies them after commit (:func:`apply_redeliveries`), waiting
for the lock there, off the request's path. Counts are never lost, only late
for events being routed.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from trace_core.storage.protocol import Transaction

__all__ = ["REDELIVERIES", "apply_redeliveries", "deferred_at", "deferred_payload"]

REDELIVERIES = "redeliveries"
"""Key of a ``route_event`` payload that carries deferred counts, not events to route."""


def deferred_payload(later: Mapping[uuid.UUID, int], now: datetime) -> dict[str, Any]:
    """The ``route_event`` payload that carries the counts an accept left."""
    return {REDELIVERIES: [[str(i), n] for i, n in sorted(later.items())], "at": deferred_at(now)}


def deferred_at(now: datetime) -> str:
    """The ``at`` of a :func:`deferred_payload` made at ``now``."""
    return now.isoformat()


async def apply_redeliveries(tx: Transaction, payload: Mapping[str, Any]) -> None:
    """Apply the counts of a :func:`deferred_payload` (waits for routings holding them)."""
    counts = {uuid.UUID(str(i)): int(n) for i, n in payload[REDELIVERIES]}
    await tx.events.apply_deferred_deliveries(counts, at=datetime.fromisoformat(str(payload["at"])))
