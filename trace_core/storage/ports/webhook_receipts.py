"""The webhook receipts area of the repository port: what a receiver remembers.

Reached as ``tx.webhook_receipts``. The receiver helper
(:mod:`trace_core.euterpe.receiver`) records, inside the requester's own
transaction, the nonce of each verified delivery until it expires (a second
use inside the window is a replay) and the id of each event processed (a
second delivery of it is a duplicate: acknowledged, not processed again,
euterpe-contract.md §9). Pruning keeps both tables small.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Protocol

__all__ = ["WebhookReceiptOps"]


class WebhookReceiptOps(Protocol):
    """Nonces and event ids seen by a webhook receiver, inside one transaction."""

    async def remember_nonce_if_unused(
        self, nonce: str, *, now: datetime, expires_at: datetime
    ) -> bool:
        """Record ``nonce`` until ``expires_at``; True if it was not in use.

        One atomic statement: of concurrent callers with the same nonce,
        exactly one gets True (the others wait for its transaction on
        Postgres, for the write lock on SQLite). A nonce whose earlier record
        expired (``expires_at <= now``) and was not pruned yet counts as unused
        and is recorded again with the new expiry.
        """
        ...

    async def remember_event_if_new(self, event_id: uuid.UUID, *, now: datetime) -> bool:
        """Record that ``event_id`` was received at ``now``; True the first time.

        One atomic statement, like :meth:`remember_nonce_if_unused`: of
        concurrent deliveries of one event exactly one is new, and it stays
        the only one as long as its record is kept. If the caller's
        transaction rolls back, so does the record (the event was not
        processed, and its next delivery is new).
        """
        ...

    async def prune_expired_nonces(self, *, now: datetime, limit: int) -> int:
        """Delete up to ``limit`` nonces with ``expires_at <= now``; how many."""
        ...

    async def prune_events_received_before(self, cutoff: datetime, *, limit: int) -> int:
        """Delete up to ``limit`` event records received before ``cutoff``; how many.

        After that a redelivery of such an event is new again, so ``cutoff``
        must lie further back than any deliverer still retries.
        """
        ...
