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
"""

from __future__ import annotations

import uuid

from trace_core.clock import Clock
from trace_core.security.claims import CapabilityClaims, InvalidCapability
from trace_core.security.jws_verifier import JwsVerifier, PublicKeySource
from trace_core.security.tokens import DEFAULT_MAX_TOKEN_BYTES, TOKEN_ALG, TOKEN_TYP

__all__ = ["REQUIRED_CLAIMS", "PublicKeySource", "TokenVerifier"]

REQUIRED_CLAIMS = ("exp", "nbf", "iat", "aud", "iss", "sub", "jti")


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

    async def verify(self, token: str) -> CapabilityClaims:
        """Return the claims of a valid token; raise :class:`InvalidCapability`."""
        return CapabilityClaims.from_payload(await self._verified_payload(token))

    async def verify_for_task(
        self, token: str, task_id: uuid.UUID, attempt: int
    ) -> CapabilityClaims:
        """Like :meth:`verify`, and refuse (``wrong_task``) a token of another attempt."""
        claims = await self.verify(token)
        if claims.task_id != task_id or claims.attempt != attempt:
            raise InvalidCapability("wrong_task", "the token was issued for another task attempt")
        return claims
