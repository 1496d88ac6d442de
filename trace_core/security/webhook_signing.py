"""Signed webhooks (euterpe-contract.md §8): per-requester secrets, signing, verification.

The wire format, four headers on every delivery:

``x-euterpe-timestamp``
    Integer unix seconds when the delivery was signed (every attempt signs anew).
``x-euterpe-nonce``
    16 to 64 characters of ``[A-Za-z0-9_-]`` (never a ``.``, the separator of
    the signed string); the deliverer sends 32 characters = 192 random bits.
``x-euterpe-event-id``
    The event's stable id (a UUID). It is not in the signed string that the
    contract specifies, so it is bound through the body: the signed body
    carries ``event_id``, and the receiver helper refuses a mismatch.
``x-euterpe-signature``
    One or more space-separated entries ``v1=<64 lowercase hex digits>``:
    ``v1`` is HMAC-SHA256 over ``timestamp + "." + nonce + "." + raw_body``
    (the raw bytes as sent, before any JSON parsing). During a secret
    rotation the deliverer sends one entry per active secret; a verifier
    accepts the delivery when any of its secrets matches any ``v1`` entry,
    and ignores entries of another scheme version. At most
    :data:`MAX_SIGNATURES` entries and :data:`MAX_SIGNATURE_HEADER` characters.

Secrets: one secret shared by all requesters would let requester A, who
must know it to verify, forge deliveries to requester B. So each requester
verifies with its own secret, derived statelessly from a service master
secret: ``HMAC-SHA256(master, "euterpe-webhook-v1:" + requester_id)``
(:func:`derive_requester_secret`). Nothing per requester is stored; the
operator hands a requester its secret once (``requester_secret_hex``).
Rotation is by master versions: configure the new master beside the old one
(the deliverer then signs with both), give each requester its new derived
secret, and drop the old master once all have switched. A verifier may hold
several secrets for the same reason.

Secrets and signatures are never logged: :class:`MasterSecret` hides its
value in ``repr``, and errors name the header and the rule, never its value.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trace_core.clock import Clock, SystemClock
from trace_core.errors import ConfigurationError, TraceError

__all__ = [
    "DEFAULT_TOLERANCE_SECONDS",
    "EVENT_ID_HEADER",
    "MAX_SIGNATURES",
    "MAX_SIGNATURE_HEADER",
    "NONCE_HEADER",
    "SIGNATURE_HEADER",
    "SIGNATURE_SCHEME",
    "TIMESTAMP_HEADER",
    "BadWebhookSignature",
    "MalformedWebhook",
    "MasterSecret",
    "StaleWebhookTimestamp",
    "VerifiedDelivery",
    "WebhookRejected",
    "WebhookSigner",
    "WebhookVerifier",
    "derive_requester_secret",
    "new_nonce",
    "signature_v1",
]

SIGNATURE_HEADER = "x-euterpe-signature"
TIMESTAMP_HEADER = "x-euterpe-timestamp"
NONCE_HEADER = "x-euterpe-nonce"
EVENT_ID_HEADER = "x-euterpe-event-id"
SIGNATURE_SCHEME = "v1"
DEFAULT_TOLERANCE_SECONDS = 300
"""±5 minutes between the signer's timestamp and the verifier's clock (§8)."""
MAX_SIGNATURES = 8
MAX_SIGNATURE_HEADER = 1024
DERIVATION_LABEL = b"euterpe-webhook-v1:"
MIN_MASTER_BYTES = 32

_NONCE = re.compile(r"[A-Za-z0-9_-]{16,64}")
_TIMESTAMP = re.compile(r"[0-9]{1,12}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


class WebhookRejected(TraceError):
    """A delivery failed verification; nothing was recorded.

    ``http_status`` is what a receiver should answer; ``as_json`` its body.
    The message names the header (or the body field) and the rule, never
    a secret or a signature.
    """

    http_status = 400
    code = "webhook_rejected"

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason

    def as_json(self) -> dict[str, Any]:
        """The JSON error body of the receiver's 4xx answer."""
        return {"error": self.code, "field": self.field, "reason": self.reason}


class MalformedWebhook(WebhookRejected):
    """A header is missing or not of its form, or the body does not match it."""

    code = "malformed"


class StaleWebhookTimestamp(WebhookRejected):
    """The timestamp is outside the tolerance around the verifier's clock."""

    http_status = 401
    code = "timestamp_out_of_tolerance"


class BadWebhookSignature(WebhookRejected):
    """No ``v1`` signature matches any accepted secret (tampered, or another secret)."""

    http_status = 401
    code = "bad_signature"


@dataclass(frozen=True)
class MasterSecret:
    """One version of the service's master webhook secret (never printed)."""

    version: str
    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not self.version:
            raise ConfigurationError("MasterSecret.version must not be empty")
        if len(self.secret) < MIN_MASTER_BYTES:
            raise ConfigurationError(
                f"MasterSecret.secret must be at least {MIN_MASTER_BYTES} bytes "
                f"(version {self.version!r})"
            )


def derive_requester_secret(master: bytes, requester_id: str) -> bytes:
    """The secret requester ``requester_id`` verifies with: HMAC-SHA256 of
    ``"euterpe-webhook-v1:" + requester_id`` under the master secret."""
    if not requester_id:
        raise ConfigurationError("requester_id must not be empty")
    return hmac.new(master, DERIVATION_LABEL + requester_id.encode(), hashlib.sha256).digest()


def signature_v1(secret: bytes, timestamp: int, nonce: str, raw_body: bytes) -> str:
    """The ``v1`` signature: lowercase hex HMAC-SHA256 over ``ts.nonce.body``."""
    signed = f"{timestamp}.{nonce}.".encode() + raw_body
    return hmac.new(secret, signed, hashlib.sha256).hexdigest()


def new_nonce() -> str:
    """A fresh nonce: 32 URL-safe characters, 192 random bits."""
    return secrets.token_urlsafe(24)


class WebhookSigner:
    """Signs deliveries for each requester with secrets derived from the masters.

    ``masters`` are the active master versions, the current one first; during
    a rotation both are listed and every delivery carries one signature each.
    """

    def __init__(self, masters: Sequence[MasterSecret]) -> None:
        if not masters:
            raise ConfigurationError("WebhookSigner needs at least one master secret")
        versions = [m.version for m in masters]
        if len(set(versions)) != len(versions):
            raise ConfigurationError(f"WebhookSigner: duplicate master versions {versions}")
        if len(masters) > MAX_SIGNATURES:
            raise ConfigurationError(f"WebhookSigner: at most {MAX_SIGNATURES} master secrets")
        self._masters = tuple(masters)

    def requester_secrets(self, requester_id: str) -> list[bytes]:
        """The secrets of ``requester_id``, one per active master, current first."""
        return [derive_requester_secret(m.secret, requester_id) for m in self._masters]

    def requester_secret_hex(self, requester_id: str, version: str | None = None) -> str:
        """The secret to hand to a requester (hex), under master ``version`` (default: current)."""
        for m in self._masters:
            if version is None or m.version == version:
                return derive_requester_secret(m.secret, requester_id).hex()
        raise ConfigurationError(f"no master secret of version {version!r}")

    def headers(
        self,
        requester_id: str,
        event_id: uuid.UUID,
        raw_body: bytes,
        *,
        timestamp: int,
        nonce: str | None = None,
    ) -> dict[str, str]:
        """The four signed headers of one delivery attempt of ``raw_body``."""
        nonce = nonce if nonce is not None else new_nonce()
        if not _NONCE.fullmatch(nonce):
            raise ConfigurationError("nonce must be 16-64 characters of [A-Za-z0-9_-]")
        entries = [
            f"{SIGNATURE_SCHEME}={signature_v1(secret, timestamp, nonce, raw_body)}"
            for secret in self.requester_secrets(requester_id)
        ]
        return {
            SIGNATURE_HEADER: " ".join(entries),
            TIMESTAMP_HEADER: str(timestamp),
            NONCE_HEADER: nonce,
            EVENT_ID_HEADER: str(event_id),
        }


@dataclass(frozen=True)
class VerifiedDelivery:
    """The headers of a delivery whose signature and timestamp were accepted."""

    event_id: uuid.UUID
    timestamp: int
    nonce: str


class WebhookVerifier:
    """Checks a delivery's headers and signature, in the order of SECURITY-NOTES:
    strict parse, timestamp window, then constant-time signature comparison.

    ``secrets`` are the requester's accepted secrets (several during a rotation).
    It records nothing: replay and duplicate checks are the receiver's
    (:mod:`trace_core.euterpe.receiver`), after this passed.
    """

    def __init__(
        self,
        secrets: Sequence[bytes],
        *,
        clock: Clock | None = None,
        tolerance_seconds: int = DEFAULT_TOLERANCE_SECONDS,
    ) -> None:
        if not secrets:
            raise ConfigurationError("WebhookVerifier needs at least one secret")
        if any(len(s) < 16 for s in secrets):
            raise ConfigurationError("WebhookVerifier: every secret must be at least 16 bytes")
        if tolerance_seconds < 1:
            raise ConfigurationError("WebhookVerifier.tolerance_seconds must be >= 1")
        self._secrets = tuple(secrets)
        self.clock = clock or SystemClock()
        self.tolerance_seconds = tolerance_seconds

    def verify(self, headers: Mapping[str, str], raw_body: bytes) -> VerifiedDelivery:
        """The verified headers, or :class:`WebhookRejected` (a subclass naming why)."""
        lowered = {k.lower(): v for k, v in headers.items()}
        timestamp_text = _header(lowered, TIMESTAMP_HEADER)
        if not _TIMESTAMP.fullmatch(timestamp_text):
            raise MalformedWebhook(TIMESTAMP_HEADER, "must be integer unix seconds")
        nonce = _header(lowered, NONCE_HEADER)
        if not _NONCE.fullmatch(nonce):
            raise MalformedWebhook(NONCE_HEADER, "must be 16-64 characters of [A-Za-z0-9_-]")
        event_text = _header(lowered, EVENT_ID_HEADER)
        if not _UUID.fullmatch(event_text):
            raise MalformedWebhook(EVENT_ID_HEADER, "must be a lowercase UUID")
        offered = _signatures(_header(lowered, SIGNATURE_HEADER))

        timestamp = int(timestamp_text)
        skew = self.clock.now().timestamp() - timestamp
        if abs(skew) > self.tolerance_seconds:
            raise StaleWebhookTimestamp(
                TIMESTAMP_HEADER,
                f"{'behind' if skew > 0 else 'ahead of'} the receiver's clock by "
                f"{abs(int(skew))} s (tolerance {self.tolerance_seconds} s)",
            )
        # Every pair is compared (no early exit), each in constant time.
        matched = False
        for secret in self._secrets:
            expected = signature_v1(secret, timestamp, nonce, raw_body)
            for candidate in offered:
                matched |= hmac.compare_digest(expected, candidate)
        if not matched:
            raise BadWebhookSignature(SIGNATURE_HEADER, "no v1 signature matches")
        return VerifiedDelivery(uuid.UUID(event_text), timestamp, nonce)


def _header(headers: Mapping[str, str], name: str) -> str:
    value = headers.get(name)
    if value is None or not value.strip():
        raise MalformedWebhook(name, "missing")
    return value.strip()


def _signatures(value: str) -> list[str]:
    """The ``v1`` hex digests of a signature header (other schemes ignored)."""
    if len(value) > MAX_SIGNATURE_HEADER:
        raise MalformedWebhook(SIGNATURE_HEADER, f"longer than {MAX_SIGNATURE_HEADER} characters")
    entries = value.split()
    if len(entries) > MAX_SIGNATURES:
        raise MalformedWebhook(SIGNATURE_HEADER, f"more than {MAX_SIGNATURES} entries")
    found: list[str] = []
    for entry in entries:
        scheme, sep, digest = entry.partition("=")
        if not sep or not scheme:
            raise MalformedWebhook(SIGNATURE_HEADER, "entries must be <scheme>=<signature>")
        if scheme != SIGNATURE_SCHEME:
            continue  # a later scheme version this verifier does not know
        if not _HEX64.fullmatch(digest):
            raise MalformedWebhook(SIGNATURE_HEADER, "a v1 signature is 64 lowercase hex digits")
        found.append(digest)
    if not found:
        raise MalformedWebhook(SIGNATURE_HEADER, "no v1 signature")
    return found
