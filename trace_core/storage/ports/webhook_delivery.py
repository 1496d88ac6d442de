"""The webhook delivery area of the repository port: what the deliverer needs
beyond the generic ownership protocol on ``job_outbox_events``.

Reached as ``tx.webhook_delivery``. Heartbeats, completion, failure and
reclaim are the generic protocol's (:class:`~trace_core.leasing.LeaseQueue`
on :data:`~trace_core.model.JOB_OUTBOX_EVENTS`); this area adds the claim
that keeps one job's webhooks in stage order, and where each event goes.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from trace_core.model import Lease

__all__ = ["WebhookDeliveryOps", "WebhookTarget"]


@dataclass(frozen=True)
class WebhookTarget:
    """Where one event is delivered, and whose secret signs it."""

    event_id: uuid.UUID
    job_id: uuid.UUID
    requester_id: str
    url: str | None
    """The job's ``status_webhook_url``; ``None`` when the requester only polls."""


class WebhookDeliveryOps(Protocol):
    """Claims and routing reads of webhook events, inside one transaction."""

    async def claim_in_stage_order(
        self, *, worker_id: str, lease_seconds: float, now: datetime, limit: int
    ) -> list[Lease]:
        """Lease up to ``limit`` ready events (``pending``, ``available_at <= now``)
        whose earlier events (same job, lower ``sequence``) are all
        ``delivered`` or ``dead_letter``: at most one event per job is ever
        leased or waiting ahead of the others, so a job's webhooks go out in
        the order of its stages.

        The claim is the generic one (one atomic statement; the same lease
        columns, fresh lease token, ``claim_version`` and ``attempts`` + 1;
        concurrent claimers never get the same event) with that one extra
        condition. ``Lease.data`` holds ``job_id``, ``event_type`` and
        ``payload``.
        """
        ...

    async def targets(self, event_ids: Collection[uuid.UUID]) -> Mapping[uuid.UUID, WebhookTarget]:
        """The target of each of ``event_ids`` that exists (from its job's row).
        Empty for empty ``event_ids`` (no statement runs)."""
        ...
