"""Verifying task capability tokens, strictly, with one error type.

Order of checks (cheap and unauthenticated first, never an oracle on claims
before the signature): size cap; compact-JWS shape with strict base64url and
strict JSON (no duplicate members, no NaN); header (``alg`` exactly ES256, no
``crit``, ``typ`` JWT, a kid, no embedded or remote key references); key by
kid from the JWKS source; signature shape (64 raw bytes, scalars in range);
then ``jwt.decode`` with ``algorithms=["ES256"]``, explicit issuer and
audience and every registered claim required (SECURITY-NOTES "Capability
tokens"); then the time claims against the injected clock, then the Trace
claims. Every failure is :class:`InvalidCapability` with a ``reason``.

PyJWT reads the wall clock for ``exp``/``nbf``/``iat``, so those three
checks are switched off in its options and made here against the injected
clock, with the same semantics and an integer-only type rule.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Protocol

import jwt
from cryptography.hazmat.primitives.asymmetric import ec
from jwt import exceptions as jwt_errors

from trace_core.clock import Clock
from trace_core.errors import ConfigurationError
from trace_core.security.b64url import b64url_decode
from trace_core.security.claims import CapabilityClaims, InvalidCapability
from trace_core.security.jwks import MAX_LEEWAY_SECONDS
from trace_core.security.jwks_cache import JwksUnavailable
from trace_core.security.signing import MalformedSignature, check_raw_signature
from trace_core.security.tokens import DEFAULT_MAX_TOKEN_BYTES, TOKEN_ALG, TOKEN_TYP

__all__ = ["REQUIRED_CLAIMS", "PublicKeySource", "TokenVerifier"]

REQUIRED_CLAIMS = ("exp", "nbf", "iat", "aud", "iss", "sub", "jti")
# Header members that would take the key from somewhere other than our JWKS,
# or change how the payload is read (RFC 7797 b64): never honoured, refused.
_FORBIDDEN_HEADERS = frozenset({"jwk", "jku", "x5u", "x5c", "x5t", "x5t#S256", "b64"})


class PublicKeySource(Protocol):
    """Looks public keys up by kid: a :class:`JwksCache`, or a :class:`KeyRing` in-process."""

    async def public_key(self, kid: str) -> ec.EllipticCurvePublicKey | None:
        """The key for ``kid``, or ``None`` if unknown; may raise ``JwksUnavailable``."""
        ...


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Two parsers that pick different duplicates is how claims get smuggled.
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError("duplicate member")
        result[key] = value
    return result


def _no_constants(name: str) -> Any:
    raise ValueError("non-finite number")


def _json_object(segment: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(
            b64url_decode(segment),
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constants,
        )
    except (ValueError, RecursionError):
        raise InvalidCapability("malformed", f"the {what} is not strict base64url JSON") from None
    if not isinstance(value, dict):
        raise InvalidCapability("malformed", f"the {what} is not a JSON object")
    return value


class TokenVerifier:
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
        # A verifier without an audience would accept tokens minted for any
        # other service by the same issuer.
        if not isinstance(audience, str) or not audience:
            raise ConfigurationError("TokenVerifier.audience must be a non-empty string")
        if not isinstance(issuer, str) or not issuer:
            raise ConfigurationError("TokenVerifier.issuer must be a non-empty string")
        if not 0 <= leeway_seconds <= MAX_LEEWAY_SECONDS:
            raise ConfigurationError(
                f"TokenVerifier.leeway_seconds must be within 0..{MAX_LEEWAY_SECONDS:g}"
            )
        if not 256 <= max_token_bytes <= 65536:
            raise ConfigurationError("TokenVerifier.max_token_bytes must be within 256..65536")
        self._keys = jwks_source
        self._issuer = issuer
        self._audience = audience
        self._clock = clock
        self._leeway = leeway_seconds
        self._max_bytes = max_token_bytes
        # A private PyJWT instance: nobody's register_algorithm() reaches it.
        self._jwt = jwt.PyJWT()

    async def verify(self, token: str) -> CapabilityClaims:
        """Return the claims of a valid token; raise :class:`InvalidCapability`."""
        if not isinstance(token, str):
            raise InvalidCapability("malformed", "the token is not a string")
        if len(token) > self._max_bytes:
            raise InvalidCapability("oversized", f"the token exceeds {self._max_bytes} bytes")
        if not token.isascii():
            raise InvalidCapability("malformed", "the token is not ASCII")
        parts = token.split(".")
        if len(parts) != 3:
            raise InvalidCapability("malformed", "the token is not a compact JWS")
        header = _json_object(parts[0], "header")
        _json_object(parts[1], "payload")
        try:
            signature = b64url_decode(parts[2])
        except ValueError:
            raise InvalidCapability("malformed", "the signature is not base64url") from None
        kid = self._check_header(header)
        try:
            public_key = await self._keys.public_key(kid)
        except JwksUnavailable:
            raise InvalidCapability("jwks_unavailable", "the JWKS could not be fetched") from None
        if public_key is None:
            raise InvalidCapability("unknown_kid", "no published key has the token's kid")
        try:
            check_raw_signature(signature)
        except MalformedSignature:
            raise InvalidCapability(
                "malformed_signature", "the signature is not 64 raw bytes r||s in range"
            ) from None
        payload = self._decode(token, public_key)
        self._check_times(payload)
        return CapabilityClaims.from_payload(payload)

    async def verify_for_task(
        self, token: str, task_id: uuid.UUID, attempt: int
    ) -> CapabilityClaims:
        """Like :meth:`verify`, and refuse (``wrong_task``) a token of another attempt."""
        claims = await self.verify(token)
        if claims.task_id != task_id or claims.attempt != attempt:
            raise InvalidCapability("wrong_task", "the token was issued for another task attempt")
        return claims

    def _check_header(self, header: dict[str, Any]) -> str:
        if header.get("alg") != TOKEN_ALG:
            raise InvalidCapability("unsupported_alg", f"only {TOKEN_ALG} is accepted")
        if "crit" in header:
            # We implement no JWS extension, so every critical one is unknown.
            raise InvalidCapability("unknown_crit", "the header lists critical extensions")
        if header.get("typ") != TOKEN_TYP:
            raise InvalidCapability("bad_header", f"typ must be {TOKEN_TYP}")
        if _FORBIDDEN_HEADERS & header.keys():
            raise InvalidCapability("bad_header", "the header references keys or sets b64")
        kid = header.get("kid")
        if not isinstance(kid, str) or not kid:
            raise InvalidCapability("bad_header", "the header has no kid")
        return kid

    def _decode(self, token: str, public_key: ec.EllipticCurvePublicKey) -> dict[str, Any]:
        try:
            return self._jwt.decode(
                token,
                key=public_key,
                algorithms=[TOKEN_ALG],
                audience=self._audience,
                issuer=self._issuer,
                options={
                    "require": list(REQUIRED_CLAIMS),
                    "strict_aud": True,
                    # Checked against the injected clock in _check_times.
                    "verify_exp": False,
                    "verify_nbf": False,
                    "verify_iat": False,
                },
            )
        except jwt_errors.InvalidSignatureError:
            raise InvalidCapability("bad_signature", "the signature does not verify") from None
        except jwt_errors.MissingRequiredClaimError as exc:
            raise InvalidCapability("missing_claim", f"claim {exc.claim} is missing") from None
        except jwt_errors.InvalidAudienceError:
            raise InvalidCapability("wrong_audience", "aud is not this verifier's") from None
        except jwt_errors.InvalidIssuerError:
            raise InvalidCapability("wrong_issuer", "iss is not the expected issuer") from None
        except jwt_errors.InvalidAlgorithmError:
            raise InvalidCapability("unsupported_alg", f"only {TOKEN_ALG} is accepted") from None
        except (jwt_errors.InvalidSubjectError, jwt_errors.InvalidJTIError):
            raise InvalidCapability("invalid_claim", "sub and jti must be strings") from None
        except jwt_errors.PyJWTError:
            # PyJWT's own text may quote header values: not repeated here.
            raise InvalidCapability("malformed", "the token could not be decoded") from None

    def _check_times(self, payload: dict[str, Any]) -> None:
        for name in ("exp", "nbf", "iat"):
            if type(payload[name]) is not int:
                raise InvalidCapability("invalid_claim", f"claim {name} must be an integer")
        now = self._clock.now().timestamp()
        # PyJWT's semantics: valid while now < exp + leeway.
        if payload["exp"] <= now - self._leeway:
            raise InvalidCapability("expired", "the token has expired")
        if payload["nbf"] > now + self._leeway:
            raise InvalidCapability("not_yet_valid", "nbf is in the future")
        if payload["iat"] > now + self._leeway:
            raise InvalidCapability("not_yet_valid", "iat is in the future")
