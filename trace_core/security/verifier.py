"""Verifying task capability tokens, strictly, with one error type.

Order of checks (cheap and unauthenticated first, never an oracle on claims
before the signature): size cap; compact-JWS shape with strict base64url and
strict JSON (no duplicate members, no NaN); header (``alg`` exactly ES256, no
``crit``, ``typ`` JWT, a kid, no embedded or remote key references); key by
kid from the JWKS source; signature shape (64 raw bytes, scalars in range);
then ``jwt.decode`` with ``algorithms=["ES256"]``, explicit issuer and
audience and every registered claim required (SECURITY-NOTES "Capability
tokens"); then the time claims against the injected clock, then the Trace
claims. Every failure is :class:`InvalidCapability` with a ``reason``. The
pipeline is :class:`~trace_core.security.jws_verifier.JwsVerifier`'s, shared
with people's tokens; this class fixes its parameters and reads the claims.

PyJWT reads the wall clock for ``exp``/``nbf``/``iat``, so those three
checks are switched off in its options and made here against the injected
clock, with the same semantics and an integer-only type rule.

A worker presents the same token on every call of its attempt, so the
claims of a token that passed every check are remembered, keyed by the
SHA-256 digest of its exact text (the token itself is not kept, and no
comparison ever runs over its bytes). A token not seen before always takes
the whole pipeline, signature included. A remembered token is accepted
again only while its kid still resolves, in the key source, to the very
key object that verified it (a key removed or rotated out of the JWKS
sends it through the whole pipeline again), and its time claims are
checked against the clock on every call. What the caller checks per
request (the attempt's fence, ``superseded``) is not the verifier's and
still runs every time.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from typing import Any

from trace_core.clock import Clock
from trace_core.security.claims import CapabilityClaims, InvalidCapability
from trace_core.security.jwks_cache import VerifyingKey
from trace_core.security.jws_verifier import JwsVerifier, PublicKeySource
from trace_core.security.tokens import DEFAULT_MAX_TOKEN_BYTES, TOKEN_ALG, TOKEN_TYP

__all__ = ["REQUIRED_CLAIMS", "PublicKeySource", "TokenVerifier"]

REQUIRED_CLAIMS = ("exp", "nbf", "iat", "aud", "iss", "sub", "jti")

VERIFIED_TOKENS = 4096
"""Tokens whose verified claims are remembered (about one per running attempt);
when full, the memory starts over (every token is then verified in full once more)."""


@dataclass(frozen=True, slots=True)
class _Verified:
    """A token that passed every check: what its next presentation needs."""

    kid: str
    key: VerifyingKey
    payload: dict[str, Any]
    claims: CapabilityClaims


class TokenVerifier(JwsVerifier):
    """Verifies capability tokens against one issuer, audience and key source."""

    def __init__(
        self,
        jwks_source: PublicKeySource,
        issuer: str,
        audience: str,
        clock: Clock,
        *,
        leeway_seconds: float = 30.0,
        max_token_bytes: int = DEFAULT_MAX_TOKEN_BYTES,
    ) -> None:
        super().__init__(
            jwks_source,
            issuer=issuer,
            audience=audience,
            clock=clock,
            algorithms=(TOKEN_ALG,),
            types=(TOKEN_TYP,),
            required=REQUIRED_CLAIMS,
            strict_aud=True,
            leeway_seconds=leeway_seconds,
            max_token_bytes=max_token_bytes,
        )
        self._verified: dict[bytes, _Verified] = {}

    async def verify(self, token: str) -> CapabilityClaims:
        """Return the claims of a valid token; raise :class:`InvalidCapability`.

        A token verified before is accepted on its remembered claims while its
        key is still the source's and its times hold (module docstring).
        """
        # Only an ASCII string can have passed before: anything else takes
        # the pipeline, which refuses it with its reason.
        digest = None
        if isinstance(token, str) and token.isascii():
            digest = hashlib.sha256(token.encode("ascii")).digest()
            seen = self._verified.get(digest)
            if seen is not None and await self._key_of(seen.kid) is seen.key:
                self._check_times(seen.payload)
                return seen.claims
        payload, kid, key = await self._verified_with_key(token)
        claims = CapabilityClaims.from_payload(payload)
        if digest is not None:
            if len(self._verified) >= VERIFIED_TOKENS:
                self._verified.clear()
            self._verified[digest] = _Verified(kid, key, payload, claims)
        return claims

    async def verify_for_task(
        self, token: str, task_id: uuid.UUID, attempt: int
    ) -> CapabilityClaims:
        """Like :meth:`verify`, and refuse (``wrong_task``) a token of another attempt."""
        claims = await self.verify(token)
        if claims.task_id != task_id or claims.attempt != attempt:
            raise InvalidCapability("wrong_task", "the token was issued for another task attempt")
        return claims
