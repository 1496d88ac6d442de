"""A verifier's cached copy of the issuer's JWKS.

The document is refetched when it is older than ``max_age_seconds`` and on
a kid miss, but never more than once per ``min_refresh_interval_seconds``:
a flood of tokens with made-up kids costs at most one fetch per interval
(SECURITY-NOTES "Capability tokens"). Failed fetches count too, so an
outage of the JWKS endpoint is not hammered either.

Entries are imported strictly (EC, P-256, ``use=sig``, ``alg=ES256``, a kid,
no private members, a point on the curve); anything else is ignored, and a
kid listed twice is dropped altogether rather than guessed at. A cache
configured with ``RS256`` among its ``algorithms`` (people's tokens from an
identity provider that signs with RSA) also imports RSA entries of 2048 bits
or more (:mod:`trace_core.security.jwks_rsa`); by default, and always for
capability tokens, it imports P-256 keys only.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from datetime import datetime, timedelta
from typing import Any

import anyio
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from trace_core.clock import Clock
from trace_core.errors import ConfigurationError, TraceError
from trace_core.security.jwk import JWK_ALG, public_key_from_jwk
from trace_core.security.jwks_rsa import RSA_ALG, rsa_public_key_from_jwk

__all__ = [
    "JWKS_ALGORITHMS",
    "JwksCache",
    "JwksFetch",
    "JwksUnavailable",
    "VerifyingKey",
    "parse_jwks",
]

VerifyingKey = ec.EllipticCurvePublicKey | rsa.RSAPublicKey
"""A public key a JWKS yields: P-256 (verifies ES256) or RSA (verifies RS256)."""

JWKS_ALGORITHMS = frozenset({JWK_ALG, RSA_ALG})
"""The algorithms whose keys a JWKS cache can import."""

log = logging.getLogger(__name__)

JwksFetch = Callable[[], Awaitable[Mapping[str, Any]]]
"""Returns the JWKS document (``GET /internal/jwks/task``); raises on failure.

It must bound its own time (an HTTP timeout): callers with a kid miss wait
for it.
"""


class JwksUnavailable(TraceError):
    """No JWKS document could be obtained to look a kid up (retry later)."""


def parse_jwks(
    document: object, *, algorithms: Collection[str] = (JWK_ALG,)
) -> dict[str, VerifyingKey]:
    """Return ``{kid: public key}`` for the usable entries of a JWKS document:
    P-256 keys where ``algorithms`` holds ES256, RSA keys where it holds RS256.

    Raises ``ValueError`` if the document itself is malformed (not an object
    with a ``keys`` list); unusable entries are skipped and logged.
    """
    if not isinstance(document, Mapping) or not isinstance(document.get("keys"), list):
        raise ValueError("a JWKS document is an object with a 'keys' list")
    keys: dict[str, VerifyingKey] = {}
    duplicated: set[str] = set()
    for index, entry in enumerate(document["keys"]):
        if not isinstance(entry, Mapping):
            log.warning("JWKS entry %d ignored: not an object", index)
            continue
        try:
            key = _import(entry, algorithms)
        except ValueError as exc:
            log.warning("JWKS entry %d ignored: %s", index, exc)
            continue
        kid = entry["kid"]
        if kid in keys or kid in duplicated:
            duplicated.add(kid)
            keys.pop(kid, None)
            continue
        keys[kid] = key
    if duplicated:
        log.warning("JWKS kids listed more than once, ignored: %d", len(duplicated))
    return keys


def _import(entry: Mapping[str, Any], algorithms: Collection[str]) -> VerifyingKey:
    # The entry's kty picks the importer; the configuration decides whether
    # that kind of key is wanted at all.
    if entry.get("kty") == "RSA" and RSA_ALG in algorithms:
        return rsa_public_key_from_jwk(entry)
    if JWK_ALG not in algorithms:
        raise ValueError(f"only {RSA_ALG} keys are configured")
    return public_key_from_jwk(entry)


class JwksCache:
    """Caches the JWKS and serves public keys by kid (a verifier's key source)."""

    def __init__(
        self,
        fetch: JwksFetch,
        clock: Clock,
        *,
        min_refresh_interval_seconds: float = 30.0,
        max_age_seconds: float = 300.0,
        algorithms: Collection[str] = (JWK_ALG,),
    ) -> None:
        if not min_refresh_interval_seconds > 0:
            raise ConfigurationError("JwksCache.min_refresh_interval_seconds must be > 0")
        if not max_age_seconds >= min_refresh_interval_seconds:
            raise ConfigurationError(
                "JwksCache.max_age_seconds must be >= min_refresh_interval_seconds"
            )
        unknown = set(algorithms) - JWKS_ALGORITHMS
        if not algorithms or unknown:
            raise ConfigurationError(
                f"JwksCache.algorithms must be among {', '.join(sorted(JWKS_ALGORITHMS))}"
            )
        self._algorithms = frozenset(algorithms)
        self._fetch = fetch
        self._clock = clock
        self._min_interval = timedelta(seconds=min_refresh_interval_seconds)
        self._max_age = timedelta(seconds=max_age_seconds)
        self._keys: dict[str, VerifyingKey] | None = None
        self._fetched_at: datetime | None = None
        self._attempted_at: datetime | None = None
        self._fetches = 0
        self._last_fetch_ok = False
        # One refresh at a time: tasks that miss together wait for the same fetch.
        self._lock = anyio.Lock()

    @property
    def algorithms(self) -> frozenset[str]:
        """The algorithms whose keys this cache imports."""
        return self._algorithms

    @property
    def fetches(self) -> int:
        """How many fetches were attempted (successful or not)."""
        return self._fetches

    def kids(self) -> frozenset[str]:
        """The kids of the cached document (empty before the first fetch)."""
        return frozenset(self._keys or ())

    async def public_key(self, kid: str) -> VerifyingKey | None:
        """The key for ``kid``, refreshing if the copy is stale or misses the kid.

        Returns ``None`` for a kid the (possibly refreshed) document lacks.
        Raises :class:`JwksUnavailable` when there is no document at all, or
        when the kid is missing and the latest fetch failed.
        """
        if self._is_stale():
            await self._refresh(kid=None)
        key = self._lookup(kid)
        if key is None:
            await self._refresh(kid=kid)
            key = self._lookup(kid)
        # "Unknown kid" is only said on the word of a document just fetched
        # successfully; after a failed fetch the answer is "try again later".
        if key is None and (self._keys is None or not self._last_fetch_ok):
            raise JwksUnavailable("the task JWKS could not be fetched")
        return key

    async def refresh(self) -> None:
        """Fetch now, ignoring the interval; raise :class:`JwksUnavailable` on failure."""
        async with self._lock:
            if not await self._fetch_now():
                raise JwksUnavailable("the task JWKS could not be fetched")

    def _lookup(self, kid: str) -> VerifyingKey | None:
        return None if self._keys is None else self._keys.get(kid)

    def _is_stale(self) -> bool:
        if self._fetched_at is None:
            return True
        return self._clock.now() - self._fetched_at >= self._max_age

    async def _refresh(self, *, kid: str | None) -> None:
        """Fetch unless rate-limited or another task's fetch already answered."""
        async with self._lock:
            # Another task may have refreshed while this one waited.
            if kid is None and not self._is_stale():
                return
            if kid is not None and self._lookup(kid) is not None:
                return
            now = self._clock.now()
            if self._attempted_at is not None and now - self._attempted_at < self._min_interval:
                return
            await self._fetch_now()

    async def _fetch_now(self) -> bool:
        self._attempted_at = self._clock.now()
        self._fetches += 1
        try:
            keys = parse_jwks(await self._fetch(), algorithms=self._algorithms)
        except Exception:
            # Transport errors come in any type (httpx, OSError, ...); keep the
            # copy we have: it only lists keys that were valid recently.
            log.warning("task JWKS fetch failed; keeping the cached copy", exc_info=True)
            self._last_fetch_ok = False
            return False
        self._last_fetch_ok = True
        self._keys = keys
        self._fetched_at = self._clock.now()
        return True
