"""The lite profile's local issuer of people's tokens.

Offline, there is no identity provider: ``trace-lite token --user SUB``
signs a short-lived ES256 token with a key of ``<data-dir>/people-keys``
(its own :class:`~trace_lite.keys.LocalKeyStore`, separate from the
capability-token keys of ``<data-dir>/keys``: a person's token can never
pass for a task's, nor the reverse), and ``trace-lite serve`` verifies
people's tokens against the JWKS of that same ring, through the JWKS cache
like any issuer's. Production configures a real OIDC issuer instead
(:class:`~trace_core.security.people_tokens.PeopleTokenSettings`).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trace_core.clock import Clock
from trace_core.errors import ConfigurationError
from trace_core.people import PeopleService
from trace_core.security.jwks import KeyRing
from trace_core.security.jwks_cache import JwksCache
from trace_core.security.people_tokens import (
    PeopleTokenSettings,
    PeopleTokenVerifier,
    http_jwks_fetch,
    people_jwks_cache,
)
from trace_core.security.tokens import TOKEN_ALG, TOKEN_TYP, sign_jws
from trace_core.storage.protocol import Repository
from trace_lite.keys import LocalKeyStore

if TYPE_CHECKING:  # the HTTP stack is the optional `http` extra
    from trace_core.api.people import PeopleApi

__all__ = [
    "LOCAL_AUDIENCE",
    "LOCAL_ISSUER",
    "MAX_TTL_SECONDS",
    "PEOPLE_KEYS_DIR",
    "issue_person_token",
    "open_people_keys",
    "people_api",
]

PEOPLE_KEYS_DIR = "people-keys"
LOCAL_ISSUER = "trace-lite-local"
"""``iss`` of the local issuer's tokens."""
LOCAL_AUDIENCE = "trace-lite"
"""``aud`` of the local issuer's tokens, and what ``trace-lite serve`` expects."""
MAX_TTL_SECONDS = 3600
"""Short-lived: at most the ring's maximum token lifetime (RotationPolicy default)."""


def open_people_keys(data_dir: str | os.PathLike[str], clock: Clock) -> KeyRing:
    """The key ring of ``<data_dir>/people-keys``, created (with a first key) if absent."""
    return LocalKeyStore(Path(data_dir) / PEOPLE_KEYS_DIR, clock).open()


async def issue_person_token(
    ring: KeyRing, subject: str, clock: Clock, *, ttl_seconds: int = 900
) -> str:
    """A token for ``subject`` from the local issuer, valid ``ttl_seconds`` (1..3600)."""
    if not 1 <= ttl_seconds <= MAX_TTL_SECONDS:
        raise ConfigurationError(f"--ttl must be within 1..{MAX_TTL_SECONDS} seconds")
    if not subject or not subject.isprintable():
        raise ConfigurationError("--user must be a non-empty printable subject")
    signer = ring.active_signer()
    now = int(clock.now().timestamp())
    header = {"alg": TOKEN_ALG, "typ": TOKEN_TYP, "kid": signer.kid}
    payload = {
        "iss": LOCAL_ISSUER,
        "aud": LOCAL_AUDIENCE,
        "sub": subject,
        "iat": now,
        "nbf": now,
        "exp": now + ttl_seconds,
        "jti": str(uuid.uuid4()),
    }
    return await sign_jws(signer, header, payload)


def people_api(
    repo: Repository,
    clock: Clock,
    *,
    ring: KeyRing | None,
    environ: Mapping[str, str] | None = None,
) -> PeopleApi:
    """The people routes' verifier and service for ``trace-lite serve``.

    With ``TRACE_PEOPLE_ISSUER`` set, tokens come from that issuer (its JWKS
    over HTTPS); otherwise from the local issuer's ``ring``.
    """
    from trace_core.api.people import PeopleApi

    settings = PeopleTokenSettings.from_env(environ)
    if settings is None:
        if ring is None:
            raise ConfigurationError("no people issuer configured and no local people keys")
        local = ring

        async def local_jwks() -> Mapping[str, Any]:
            return local.jwks()

        cache = JwksCache(local_jwks, clock)
        verifier = PeopleTokenVerifier(
            cache, issuer=LOCAL_ISSUER, audience=LOCAL_AUDIENCE, clock=clock
        )
    else:
        fetch = http_jwks_fetch(settings.effective_jwks_url)
        cache = people_jwks_cache(fetch, clock, settings.algorithms)
        verifier = PeopleTokenVerifier(
            cache,
            issuer=settings.issuer,
            audience=settings.audience,
            clock=clock,
            algorithms=settings.algorithms,
            leeway_seconds=settings.leeway_seconds,
        )
    return PeopleApi(verifier=verifier, service=PeopleService(repo, clock))
