"""Verifying people's bearer tokens: JWTs from an identity provider.

The capability-token rules apply (:mod:`trace_core.security.verifier`):
size cap, strict compact-JWS parsing (no duplicate members), the algorithm
pinned by configuration and checked in the header before any key is looked
up, no ``crit``, no embedded or remote key references, the key by kid from a
:class:`~trace_core.security.jwks_cache.JwksCache` (one fetch per interval
however many unknown kids), the raw ``r||s`` signature shape, then PyJWT
with explicit issuer and audience and its algorithm list pinned, then the
time claims against the injected clock with a bounded leeway. Every refusal
is :class:`~trace_core.security.claims.InvalidCapability` with a ``reason``
(the same vocabulary; its text never quotes the token).

Differences from capability tokens, because an IdP mints these: ``typ`` may
be absent, ``JWT`` or ``at+jwt`` (RFC 9068); ``nbf`` and ``jti`` are optional
(``nbf`` is checked when present); ``RS256`` may be configured besides (or
instead of) ``ES256``, as many identity providers sign with RSA only. The
configuration decides, never the token: a header ``alg`` outside the
configured list is refused, the JWKS cache imports RSA keys (2048 bits or
more) only for a verifier configured with ``RS256``
(:func:`people_jwks_cache`), and a key verifies only its own algorithm
(P-256: ES256, RSA: RS256), so a token cannot switch one for the other.
``none`` and ``HS*`` are refused at configuration time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from trace_core.clock import Clock
from trace_core.errors import ConfigurationError
from trace_core.security.claims import InvalidCapability
from trace_core.security.jwks import MAX_LEEWAY_SECONDS
from trace_core.security.jwks_cache import JwksCache, JwksFetch
from trace_core.security.jws_verifier import JwsVerifier, PublicKeySource
from trace_core.security.tokens import DEFAULT_MAX_TOKEN_BYTES

__all__ = [
    "PEOPLE_ALGORITHMS",
    "PEOPLE_REQUIRED_CLAIMS",
    "PeopleTokenSettings",
    "PeopleTokenVerifier",
    "PersonClaims",
    "http_jwks_fetch",
    "people_jwks_cache",
]

PEOPLE_ALGORITHMS = frozenset({"ES256", "RS256"})
"""Algorithms a people-token verifier may be configured with (never none/HS*)."""
PEOPLE_REQUIRED_CLAIMS = ("exp", "iat", "aud", "iss", "sub")
_TYPES = (None, "JWT", "at+jwt")


@dataclass(frozen=True)
class PersonClaims:
    """What a verified people token says: who, for whom, until when."""

    subject: str
    issuer: str
    expires_at: datetime


@dataclass(frozen=True)
class PeopleTokenSettings:
    """Where people's tokens come from: the IdP issuer, this API's audience, its JWKS.

    ``from_env`` reads ``TRACE_PEOPLE_ISSUER``, ``TRACE_PEOPLE_AUDIENCE``,
    ``TRACE_PEOPLE_JWKS_URL`` (default ``<issuer>/.well-known/jwks.json``),
    ``TRACE_PEOPLE_ALGORITHMS`` (comma-separated, default ``ES256``) and
    ``TRACE_PEOPLE_LEEWAY_SECONDS`` (default 30).
    """

    issuer: str
    audience: str
    jwks_url: str | None = None
    algorithms: tuple[str, ...] = ("ES256",)
    leeway_seconds: float = 30.0

    def __post_init__(self) -> None:
        for name in ("issuer", "audience"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigurationError(f"PeopleTokenSettings.{name} must be a non-empty string")
        check_algorithms(self.algorithms)
        if not 0 <= self.leeway_seconds <= MAX_LEEWAY_SECONDS:
            raise ConfigurationError(
                f"PeopleTokenSettings.leeway_seconds must be within 0..{MAX_LEEWAY_SECONDS:g}"
            )
        if self.jwks_url is not None and not self.jwks_url.startswith("https://"):
            raise ConfigurationError("PeopleTokenSettings.jwks_url must be an https:// URL")

    @property
    def effective_jwks_url(self) -> str:
        """The JWKS location: configured, else the issuer's well-known path."""
        return self.jwks_url or self.issuer.rstrip("/") + "/.well-known/jwks.json"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PeopleTokenSettings | None:
        """The settings in the environment, or None when no issuer is configured."""
        env = os.environ if environ is None else environ
        issuer = env.get("TRACE_PEOPLE_ISSUER")
        if not issuer:
            return None
        audience = env.get("TRACE_PEOPLE_AUDIENCE", "")
        if not audience:
            raise ConfigurationError("TRACE_PEOPLE_AUDIENCE must be set with TRACE_PEOPLE_ISSUER")
        algorithms = tuple(
            a.strip() for a in env.get("TRACE_PEOPLE_ALGORITHMS", "ES256").split(",") if a.strip()
        )
        try:
            leeway = float(env.get("TRACE_PEOPLE_LEEWAY_SECONDS", "30"))
        except ValueError:
            raise ConfigurationError("TRACE_PEOPLE_LEEWAY_SECONDS must be a number") from None
        return cls(issuer, audience, env.get("TRACE_PEOPLE_JWKS_URL") or None, algorithms, leeway)


def check_algorithms(algorithms: Sequence[str]) -> tuple[str, ...]:
    """Validate a configured algorithm list; raise naming the first bad one."""
    if not algorithms:
        raise ConfigurationError("people token algorithms: at least one is required")
    for alg in algorithms:
        if alg not in PEOPLE_ALGORITHMS:
            raise ConfigurationError(
                f"people token algorithm {alg!r} is refused: only "
                f"{', '.join(sorted(PEOPLE_ALGORITHMS))} (never none or HS*)"
            )
    return tuple(algorithms)


def people_jwks_cache(fetch: JwksFetch, clock: Clock, algorithms: Sequence[str]) -> JwksCache:
    """A JWKS cache for a people-token verifier of ``algorithms``: it imports
    RSA keys only where they include ``RS256``."""
    return JwksCache(fetch, clock, algorithms=check_algorithms(algorithms))


def http_jwks_fetch(url: str, *, timeout_seconds: float = 5.0) -> JwksFetch:
    """A :data:`JwksFetch` reading ``url`` over HTTPS with a bounded time (httpx, lazily)."""

    async def fetch() -> Mapping[str, Any]:
        import httpx  # optional dependency: only deployments with an IdP need it

        async with httpx.AsyncClient(timeout=timeout_seconds, follow_redirects=False) as client:
            response = await client.get(url, headers={"Accept": "application/json"})
            response.raise_for_status()
            document: Mapping[str, Any] = response.json()
            return document

    return fetch


class PeopleTokenVerifier(JwsVerifier):
    """Verifies people's bearer JWTs against one issuer, audience and key source."""

    def __init__(
        self,
        keys: PublicKeySource,
        *,
        issuer: str,
        audience: str,
        clock: Clock,
        algorithms: Sequence[str] = ("ES256",),
        leeway_seconds: float = 30.0,
        max_token_bytes: int = DEFAULT_MAX_TOKEN_BYTES,
    ) -> None:
        pinned = check_algorithms(algorithms)
        if isinstance(keys, JwksCache) and not set(pinned) <= keys.algorithms:
            # it would drop the keys of the others: every token would be an unknown kid
            raise ConfigurationError(
                f"people token algorithms {', '.join(pinned)} need a JWKS cache that imports "
                "their keys (people_jwks_cache)"
            )
        super().__init__(
            keys,
            issuer=issuer,
            audience=audience,
            clock=clock,
            algorithms=pinned,
            types=_TYPES,
            required=PEOPLE_REQUIRED_CLAIMS,
            # An identity provider may send aud as a list holding the audience.
            strict_aud=False,
            leeway_seconds=leeway_seconds,
            max_token_bytes=max_token_bytes,
        )

    async def verify(self, token: str) -> PersonClaims:
        """The claims of a valid token; raise :class:`InvalidCapability` otherwise."""
        payload = await self._verified_payload(token)
        subject = payload["sub"]
        if not isinstance(subject, str) or not subject:
            raise InvalidCapability("invalid_claim", "sub must be a non-empty string")
        return PersonClaims(subject, self._issuer, datetime.fromtimestamp(payload["exp"], UTC))
