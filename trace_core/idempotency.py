"""Idempotency keys (euterpe-contract.md §9, SECURITY-NOTES "Idempotency keys").

``(scope, key)`` maps to the canonical hash of the first request, its stored
response and an expiry. The key is claimed with one atomic insert (never
select-then-insert): the same key with the same hash replays the stored
response, with another hash is a conflict, and while the first request is
still running it is reported in flight. Expired keys are taken over as new
and swept in batches.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from trace_core.clock import Clock, SystemClock
from trace_core.errors import ConfigurationError, IdempotencyConflict, IdempotencyInFlight
from trace_core.storage.protocol import Repository, Transaction, within

__all__ = ["IdempotencyStore", "Replay", "request_fingerprint"]

_MAX_KEY = 255


def request_fingerprint(method: str, route: str, body: Any) -> str:
    """``sha256`` over method, route and the canonical JSON of the body."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    digest = hashlib.sha256(f"{method.upper()}\n{route}\n{canonical}".encode()).hexdigest()
    return f"sha256:{digest}"


@dataclass(frozen=True)
class Replay:
    """The outcome of :meth:`IdempotencyStore.begin`.

    ``first`` is True when the caller owns the key and must perform the
    request, then :meth:`~IdempotencyStore.complete` (or
    :meth:`~IdempotencyStore.release` if it failed before any effect).
    Otherwise ``response`` is the stored result to return as a replay.
    """

    first: bool
    response: Any = None


class IdempotencyStore:
    """Claims, completes, replays and sweeps idempotency keys."""

    def __init__(
        self,
        repo: Repository,
        *,
        clock: Clock | None = None,
        ttl: timedelta = timedelta(hours=24),
    ) -> None:
        if ttl <= timedelta(0):
            raise ConfigurationError("IdempotencyStore.ttl must be positive")
        self.repo = repo
        self.clock = clock or SystemClock()
        self.ttl = ttl

    @staticmethod
    def validate_key(key: str) -> None:
        """Keys are 1-255 printable ASCII characters."""
        if not 1 <= len(key) <= _MAX_KEY:
            raise ConfigurationError(
                f"idempotency key must be 1..{_MAX_KEY} characters, got {len(key)}"
            )
        if not all(" " <= ch <= "~" for ch in key):
            raise ConfigurationError("idempotency key must be printable ASCII")

    async def begin(
        self, scope: str, key: str, request_hash: str, *, tx: Transaction | None = None
    ) -> Replay:
        """Claim ``(scope, key)`` for ``request_hash``, or replay its stored response.

        Raises :class:`IdempotencyConflict` for another hash and
        :class:`IdempotencyInFlight` while the first request runs.
        """
        self.validate_key(key)
        if not scope:
            raise ConfigurationError("idempotency scope must not be empty")
        now = self.clock.now()
        async with within(self.repo, tx) as t:
            record = await t.idempotency_claim(
                scope, key, request_hash, now=now, expires_at=now + self.ttl
            )
        if record.claimed:
            return Replay(first=True)
        if record.request_hash != request_hash:
            raise IdempotencyConflict(
                f"idempotency key {key!r} in scope {scope!r} was used with another request"
            )
        if record.status == "in_flight":
            raise IdempotencyInFlight(
                f"idempotency key {key!r} in scope {scope!r}: the first request is still running"
            )
        return Replay(first=False, response=record.response)

    async def complete(
        self,
        scope: str,
        key: str,
        request_hash: str,
        response: Any,
        *,
        tx: Transaction | None = None,
    ) -> bool:
        """Store the response; pass the request's own ``tx`` to commit both at once."""
        now = self.clock.now()
        async with within(self.repo, tx) as t:
            return await t.idempotency_complete(scope, key, request_hash, response, now=now)

    async def release(self, scope: str, key: str, request_hash: str) -> bool:
        """Forget an in-flight key whose request failed before any effect."""
        async with self.repo.transaction() as t:
            return await t.idempotency_release(scope, key, request_hash)

    async def sweep(self, *, limit: int = 1000) -> int:
        """Delete up to ``limit`` expired keys."""
        async with self.repo.transaction() as t:
            return await t.idempotency_sweep(now=self.clock.now(), limit=limit)
