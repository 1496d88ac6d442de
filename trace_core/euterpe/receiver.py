"""The receiver helper requesters embed (euterpe-contract.md §8, §9).

:meth:`WebhookReceiver.verify_and_record` checks one delivery and records
it, in this order (SECURITY-NOTES "Webhook signing"):

1. strict parse of the four headers (:class:`MalformedWebhook`, 400);
2. the timestamp within ±5 minutes of the injected clock
   (:class:`StaleWebhookTimestamp`, 401);
3. the signature, compared in constant time with each accepted secret
   (:class:`BadWebhookSignature`, 401);
4. the body is a JSON object whose ``event_id`` is the header's (the event
   id is not in the signed string; the signed body binds it);
5. only then the nonce is claimed, atomically, in SQL, until the end of its
   replay window (:class:`ReplayedWebhook`, 409): a delivery that failed
   verification never consumes a nonce;
6. the event id is recorded: the first delivery of an event is new, any
   later one (a deliverer that posted again after losing its answer) is a
   duplicate, to acknowledge with a 2xx and not process again.

Pass the transaction in which you process the event (``tx=``): the nonce,
the event id and your own writes then commit or roll back together, so an
event whose processing failed is processed when it is delivered again,
and one that committed never is. Without ``tx`` the records commit at once.

The replay window: a nonce is kept until ``max(now + nonce_ttl, timestamp +
tolerance)``, at least 600 s by default; a replay after that carries a
timestamp older than the tolerance and is refused by step 2. Event ids are
kept for ``event_retention`` (default 30 days), which must outlast the
deliverers' whole retry horizon; :meth:`WebhookReceiver.prune` removes what
is older, in batches.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from trace_core.clock import Clock, SystemClock
from trace_core.errors import ConfigurationError
from trace_core.security.webhook_signing import (
    DEFAULT_TOLERANCE_SECONDS,
    EVENT_ID_HEADER,
    NONCE_HEADER,
    MalformedWebhook,
    WebhookRejected,
    WebhookVerifier,
)
from trace_core.storage.protocol import Repository, Transaction, within

__all__ = [
    "Accepted",
    "ReceiverConfig",
    "ReplayedWebhook",
    "WebhookReceiver",
    "read_request_body",
]

MAX_BODY_BYTES = 1_048_576


class ReplayedWebhook(WebhookRejected):
    """The nonce was already used inside its replay window."""

    http_status = 409
    code = "replayed"


@dataclass(frozen=True)
class ReceiverConfig:
    """The receiver's windows."""

    tolerance_seconds: int = DEFAULT_TOLERANCE_SECONDS
    """Accepted clock difference in either direction (§8: ±5 minutes)."""
    nonce_ttl_seconds: int = 600
    """How long a nonce is remembered at least (§8: >= 5 minutes)."""
    event_retention: timedelta = timedelta(days=30)
    """How long an event id is remembered for dedupe."""

    def __post_init__(self) -> None:
        if self.tolerance_seconds < 1:
            raise ConfigurationError("ReceiverConfig.tolerance_seconds must be >= 1")
        if self.nonce_ttl_seconds < 300:
            raise ConfigurationError("ReceiverConfig.nonce_ttl_seconds must be >= 300 (§8)")
        if self.event_retention < timedelta(days=1):
            raise ConfigurationError("ReceiverConfig.event_retention must be at least one day")


@dataclass(frozen=True)
class Accepted:
    """A verified delivery: its event, and whether it was processed before."""

    event: Mapping[str, Any]
    """The parsed body (``event_id``, ``event_type``, ``job_id``, ``sequence``, ``status`` …)."""
    event_id: uuid.UUID
    duplicate: bool
    """True: this event was recorded before; acknowledge it, do not process it again."""


async def read_request_body(
    receive: Callable[[], Awaitable[Mapping[str, Any]]],
) -> bytes | None:
    """The whole body of an ASGI HTTP request, or ``None`` if the client left first.

    A deliverer that dies (or times out) between its headers and the end of
    its body leaves the server with an ``http.disconnect`` message and a
    prefix of the body. That prefix is not the delivery: it must be neither
    verified (its signature cannot match, and the refusal would be logged as
    tampering) nor answered. A body over :data:`MAX_BODY_BYTES` stops the
    read early and is returned as it stands, so that
    :meth:`WebhookReceiver.verify_and_record` refuses it by name.
    """
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = bytes(message.get("body", b""))
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_BODY_BYTES or not message.get("more_body", False):
            return b"".join(chunks)


class WebhookReceiver:
    """Verifies deliveries with the requester's secrets and records them in SQL."""

    def __init__(
        self,
        repo: Repository,
        secrets: Sequence[bytes],
        *,
        clock: Clock | None = None,
        config: ReceiverConfig | None = None,
    ) -> None:
        self.repo = repo
        self.clock = clock or SystemClock()
        self.config = config or ReceiverConfig()
        self.verifier = WebhookVerifier(
            secrets, clock=self.clock, tolerance_seconds=self.config.tolerance_seconds
        )

    async def verify_and_record(
        self,
        headers: Mapping[str, str],
        raw_body: bytes,
        *,
        tx: Transaction | None = None,
    ) -> Accepted:
        """Verify one delivery and record its nonce and event id (in ``tx``
        when given); :class:`WebhookRejected` (a subclass naming the header
        and the rule) when it must be refused, with nothing recorded."""
        if len(raw_body) > MAX_BODY_BYTES:
            raise MalformedWebhook("body", f"larger than {MAX_BODY_BYTES} bytes")
        verified = self.verifier.verify(headers, raw_body)
        event = _event(raw_body, verified.event_id)
        now = self.clock.now()
        signed_at = datetime.fromtimestamp(verified.timestamp, UTC)
        expires_at = max(
            now + timedelta(seconds=self.config.nonce_ttl_seconds),
            signed_at + timedelta(seconds=self.config.tolerance_seconds),
        )
        async with within(self.repo, tx) as t:
            receipts = t.webhook_receipts
            if not await receipts.remember_nonce_if_unused(
                verified.nonce, now=now, expires_at=expires_at
            ):
                raise ReplayedWebhook(NONCE_HEADER, "already used inside the replay window")
            new = await receipts.remember_event_if_new(verified.event_id, now=now)
        return Accepted(event, verified.event_id, duplicate=not new)

    async def prune(self, *, limit: int = 1000) -> tuple[int, int]:
        """Remove expired nonces and event ids older than the retention, up to
        ``limit`` of each; how many of each were removed."""
        now = self.clock.now()
        async with self.repo.transaction() as t:
            nonces = await t.webhook_receipts.prune_expired_nonces(now=now, limit=limit)
            events = await t.webhook_receipts.prune_events_received_before(
                now - self.config.event_retention, limit=limit
            )
        return nonces, events


def _event(raw_body: bytes, event_id: uuid.UUID) -> dict[str, Any]:
    """The body as a JSON object whose ``event_id`` is the header's."""
    try:
        event = json.loads(raw_body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MalformedWebhook("body", f"not JSON ({type(exc).__name__})") from None
    if not isinstance(event, dict):
        raise MalformedWebhook("body", "must be a JSON object")
    if event.get("event_id") != str(event_id):
        raise MalformedWebhook("body.event_id", f"must equal the {EVENT_ID_HEADER} header")
    return event
