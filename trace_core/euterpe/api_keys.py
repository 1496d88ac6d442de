"""Requester API keys for Euterpe's HTTP API (issue 16, POST /transcode).

A key is ``eut_`` followed by 43 URL-safe characters (256 random bits). It is
shown once, when issued, and stored only as its SHA-256 digest: a fast digest
is enough for a uniformly random 256-bit secret (nothing to brute-force), and
it lets :meth:`ApiKeys.authenticate` find the key with one indexed lookup. The
stored digest is then compared with :func:`hmac.compare_digest`, and an
unknown, revoked or malformed key is refused with the same error and message,
so an answer never tells which of them it was. Keys are never logged; the
key id (a UUID) is what logs and operators use.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
import uuid
from dataclasses import dataclass

from trace_core.clock import Clock, SystemClock
from trace_core.errors import InvalidInput, TraceError
from trace_core.storage.ports.api_keys import ApiKeyRecord
from trace_core.storage.protocol import Repository

__all__ = [
    "KEY_PREFIX",
    "ApiKeyRefused",
    "ApiKeys",
    "IssuedApiKey",
    "check_requester_id",
    "key_digest",
]

_log = logging.getLogger(__name__)

KEY_PREFIX = "eut_"
_KEY_BYTES = 32
# A presented key longer than this is refused before it is hashed.
_MAX_PRESENTED = 128
_MAX_LABEL = 200
_REQUESTER_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}", re.ASCII)


class ApiKeyRefused(TraceError):
    """The presented API key is missing, malformed, unknown or revoked (an
    HTTP 401); the message is the same whichever it was."""

    def __init__(self) -> None:
        super().__init__("API key refused")


@dataclass(frozen=True, repr=False)
class IssuedApiKey:
    """A freshly issued key: ``secret`` is the only copy there will ever be.
    ``repr()`` leaves it out."""

    key_id: uuid.UUID
    requester_id: str
    label: str | None
    secret: str

    def __repr__(self) -> str:
        return (
            f"IssuedApiKey(key_id={self.key_id!r}, requester_id={self.requester_id!r}, "
            f"label={self.label!r}, secret='<redacted>')"
        )


def check_requester_id(requester_id: object, field: str = "requester_id") -> str:
    """``requester_id`` if it is 1-128 characters of letters, digits and
    ``._:@-`` starting with a letter or digit; :class:`InvalidInput` otherwise.
    (It becomes part of idempotency scopes and of the credentials' AAD.)"""
    if not isinstance(requester_id, str) or not _REQUESTER_RE.fullmatch(requester_id):
        raise InvalidInput(
            field, "must be 1-128 letters, digits or ._:@- starting with a letter or digit"
        )
    return requester_id


def key_digest(key: str) -> str:
    """The stored form of ``key``: ``sha256:<hex>``."""
    return "sha256:" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


class ApiKeys:
    """Issues, authenticates, revokes and lists requester API keys."""

    def __init__(self, repo: Repository, *, clock: Clock | None = None) -> None:
        self.repo = repo
        self.clock = clock or SystemClock()

    async def issue(self, requester_id: str, *, label: str | None = None) -> IssuedApiKey:
        """A new key for ``requester_id``; its secret is returned here only."""
        check_requester_id(requester_id)
        if label is not None and (
            not isinstance(label, str) or len(label) > _MAX_LABEL or "\x00" in label
        ):
            raise InvalidInput("label", f"must be text of at most {_MAX_LABEL} characters")
        secret = KEY_PREFIX + secrets.token_urlsafe(_KEY_BYTES)
        key_id = uuid.uuid4()
        async with self.repo.transaction() as tx:
            await tx.api_keys.insert_key(
                key_id,
                requester_id=requester_id,
                key_digest=key_digest(secret),
                label=label,
                now=self.clock.now(),
            )
        _log.info("issued Euterpe API key %s for requester %s", key_id, requester_id)
        return IssuedApiKey(key_id, requester_id, label, secret)

    async def authenticate(self, presented: str | None) -> str:
        """The requester id of an active key; :class:`ApiKeyRefused` otherwise."""
        if (
            not isinstance(presented, str)
            or not presented.startswith(KEY_PREFIX)
            or len(presented) > _MAX_PRESENTED
        ):
            raise ApiKeyRefused()
        digest = key_digest(presented)
        async with self.repo.read() as tx:
            match = await tx.api_keys.find_by_digest(digest)
        # The lookup finds the row; the constant-time comparison of the stored
        # digest is the check that decides, so only an exact match authenticates.
        if (
            match is None
            or not hmac.compare_digest(match.key_digest, digest)
            or match.key.revoked_at is not None
        ):
            raise ApiKeyRefused()
        return match.key.requester_id

    async def revoke(self, key_id: uuid.UUID, *, requester_id: str | None = None) -> bool:
        """Revoke ``key_id`` (only if it is ``requester_id``'s, when given);
        False if it was unknown, someone else's or already revoked."""
        async with self.repo.transaction() as tx:
            revoked = await tx.api_keys.revoke_if_active(
                key_id, requester_id=requester_id, now=self.clock.now()
            )
        if revoked:
            _log.info("revoked Euterpe API key %s", key_id)
        return revoked

    async def list_keys(self, requester_id: str | None = None) -> list[ApiKeyRecord]:
        """Every key (of ``requester_id`` when given), without secrets or digests."""
        async with self.repo.read() as tx:
            return await tx.api_keys.list_keys(requester_id)
