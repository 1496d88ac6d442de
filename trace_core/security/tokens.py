"""Issuing task capability tokens (ES256 JWS, compact serialization).

We assemble the JWS ourselves (``base64url(header) . base64url(payload)``)
and hand the signing input to a :class:`~trace_core.security.signing.Signer`
instead of calling ``jwt.encode`` with a private key: that way a KMS key,
which never leaves AWS, signs through exactly the same path as a local one.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from trace_core.clock import Clock
from trace_core.errors import ConfigurationError, InvalidInput
from trace_core.security.b64url import b64url_encode
from trace_core.security.claims import CapabilityClaims, DatasetInput, task_subject
from trace_core.security.jwks import KeyRing
from trace_core.security.signing import MalformedSignature, Signer, check_raw_signature

__all__ = ["DEFAULT_MAX_TOKEN_BYTES", "TOKEN_ALG", "TOKEN_TYP", "TokenIssuer", "sign_jws"]

TOKEN_ALG = "ES256"
TOKEN_TYP = "JWT"
DEFAULT_MAX_TOKEN_BYTES = 8192
"""Verifiers refuse longer tokens before parsing; issuers refuse to mint them."""


def _segment(value: Mapping[str, Any]) -> str:
    # ASCII-only compact JSON: the token is pure ASCII end to end.
    return b64url_encode(json.dumps(value, separators=(",", ":"), ensure_ascii=True).encode())


async def sign_jws(signer: Signer, header: Mapping[str, Any], payload: Mapping[str, Any]) -> str:
    """Return the compact JWS of ``payload`` with ``header``, signed by ``signer``.

    Raises :class:`MalformedSignature` if the signer returns anything but a
    raw 64-byte ``r || s`` (for instance DER it forgot to convert), rather
    than minting a token no verifier accepts.
    """
    signing_input = f"{_segment(header)}.{_segment(payload)}"
    signature = await signer.sign(signing_input.encode("ascii"))
    try:
        check_raw_signature(signature)
    except MalformedSignature as exc:
        raise MalformedSignature(f"signer {signer.kid!r} returned a bad signature: {exc}") from exc
    return f"{signing_input}.{b64url_encode(signature)}"


class TokenIssuer:
    """Mints one capability token per task attempt.

    ``signer`` is either a :class:`KeyRing` (the key that is active at issue
    time signs, so rotation needs no restart) or a fixed :class:`Signer`.
    With a key ring, ``ttl_seconds`` may not exceed the ring's
    ``max_token_ttl_seconds``: the ring keeps retired keys that long.
    """

    def __init__(
        self,
        signer: KeyRing | Signer,
        issuer: str,
        audience: str,
        ttl_seconds: int,
        clock: Clock,
        *,
        max_token_bytes: int = DEFAULT_MAX_TOKEN_BYTES,
    ) -> None:
        if not isinstance(issuer, str) or not issuer:
            raise ConfigurationError("TokenIssuer.issuer must be a non-empty string")
        if not isinstance(audience, str) or not audience:
            raise ConfigurationError("TokenIssuer.audience must be a non-empty string")
        if type(ttl_seconds) is not int or ttl_seconds <= 0:
            raise ConfigurationError("TokenIssuer.ttl_seconds must be a positive integer")
        if isinstance(signer, KeyRing) and ttl_seconds > signer.policy.max_token_ttl_seconds:
            raise ConfigurationError(
                "TokenIssuer.ttl_seconds exceeds the key ring's max_token_ttl_seconds "
                f"({signer.policy.max_token_ttl_seconds:g}); retired keys would leave "
                "the JWKS while their tokens are still valid"
            )
        self._signer = signer
        self._issuer = issuer
        self._audience = audience
        self._ttl = ttl_seconds
        self._clock = clock
        self._max_token_bytes = max_token_bytes

    @property
    def clock(self) -> Clock:
        """The clock that stamps ``iat``/``nbf``/``exp``."""
        return self._clock

    @property
    def ttl_seconds(self) -> int:
        """How long a token issued now stays valid."""
        return self._ttl

    def claims(
        self,
        task_id: uuid.UUID,
        attempt: int,
        inputs: Sequence[DatasetInput],
        output_prefix: str | Sequence[str],
        scratch_prefix: str,
    ) -> CapabilityClaims:
        """The claims :meth:`issue` would sign now (validated; ``InvalidInput`` if not).

        ``output_prefix`` is one canonical prefix, or a sequence of them (a task
        with several S3 outputs; empty when every output is a Postgres table).
        """
        outputs = (output_prefix,) if isinstance(output_prefix, str) else tuple(output_prefix)
        # Whole seconds, rounded down: a token is never issued in the future.
        now = math.floor(self._clock.now().timestamp())
        return CapabilityClaims(
            iss=self._issuer,
            aud=self._audience,
            sub=task_subject(task_id, attempt),
            task_id=task_id,
            attempt=attempt,
            exp=now + self._ttl,
            nbf=now,
            iat=now,
            jti=str(uuid.uuid4()),
            inputs=tuple(inputs),
            output_prefixes=outputs,
            scratch_prefix=scratch_prefix,
        )

    async def issue(
        self,
        task_id: uuid.UUID,
        attempt: int,
        inputs: Sequence[DatasetInput],
        output_prefix: str | Sequence[str],
        scratch_prefix: str,
    ) -> str:
        """Return a signed token for ``(task_id, attempt)`` granting exactly these scopes.

        Raises ``InvalidInput`` for a non-canonical prefix or attempt < 1, and
        when the token would exceed ``max_token_bytes`` (too many inputs).
        """
        claims = self.claims(task_id, attempt, inputs, output_prefix, scratch_prefix)
        signer = self._signer.active_signer() if isinstance(self._signer, KeyRing) else self._signer
        header = {"alg": TOKEN_ALG, "typ": TOKEN_TYP, "kid": signer.kid}
        token = await sign_jws(signer, header, claims.to_payload())
        if len(token) > self._max_token_bytes:
            raise InvalidInput(
                "inputs",
                f"the token would be {len(token)} bytes, over the "
                f"{self._max_token_bytes}-byte limit verifiers enforce",
            )
        return token

    async def renew(self, claims: CapabilityClaims) -> str:
        """A new token with the same grants as ``claims`` (same task, attempt,
        inputs, output and scratch prefixes): fresh ``jti``, ``iat``, ``nbf``
        and ``exp``, signed by the key active now."""
        return await self.issue(
            claims.task_id,
            claims.attempt,
            claims.inputs,
            claims.output_prefixes,
            claims.scratch_prefix,
        )
