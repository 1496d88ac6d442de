"""The checks every compact-JWS verifier of Trace makes, written once.

Capability tokens (:class:`~trace_core.security.verifier.TokenVerifier`) and
people's tokens (:class:`~trace_core.security.people_tokens.PeopleTokenVerifier`)
go through the same pipeline, in this order: a bounded ASCII string of three
parts; strict base64url JSON header and payload (no duplicate members, no
non-finite numbers); the header's ``alg`` and ``typ`` among the accepted
ones, no ``crit``, no member that points at another key (``jwk``, ``jku``,
``x5*``) or changes the payload's encoding (``b64``), a ``kid``; the key
looked up by ``kid`` in the configured source only, and of the type the
header's (configured) ``alg`` needs (ES256: a P-256 key; RS256: an RSA key,
for people's tokens only): the key, not the token, decides the algorithm; a
raw 64-byte ``r||s`` signature in range (ES256) or one the size of the
modulus (RS256); PyJWT's signature, issuer, audience and required-claims
checks on a private PyJWT instance; then ``exp``/``nbf``/``iat`` as integers
against the injected clock with a bounded leeway. Every refusal is an
:class:`~trace_core.security.claims.InvalidCapability` with a stable reason.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any, Protocol

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt import exceptions as jwt_errors

from trace_core.clock import Clock
from trace_core.errors import ConfigurationError
from trace_core.security.b64url import b64url_decode
from trace_core.security.claims import InvalidCapability
from trace_core.security.jwks import MAX_LEEWAY_SECONDS
from trace_core.security.jwks_cache import JwksUnavailable, VerifyingKey
from trace_core.security.signing import MalformedSignature, check_raw_signature

__all__ = ["JwsVerifier", "PublicKeySource"]

# Header members that would take the key from somewhere other than our JWKS,
# or change how the payload is read (RFC 7797 b64): never honoured, refused.
_FORBIDDEN_HEADERS = frozenset({"jwk", "jku", "x5u", "x5c", "x5t", "x5t#S256", "b64"})


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


def _check_key_and_signature(alg: str, key: VerifyingKey, signature: bytes) -> None:
    """The key's type decides what it verifies: a P-256 key ES256, an RSA key
    RS256. A header naming the other (both configured) is refused before any
    signature check, and the signature must have the algorithm's shape."""
    if alg == "RS256" and isinstance(key, rsa.RSAPublicKey):
        if len(signature) != (key.key_size + 7) // 8:
            raise InvalidCapability(
                "malformed_signature", "the signature is not the size of the RSA modulus"
            )
        return
    if alg == "ES256" and isinstance(key, ec.EllipticCurvePublicKey):
        try:
            check_raw_signature(signature)
        except MalformedSignature:
            raise InvalidCapability(
                "malformed_signature", "the signature is not 64 raw bytes r||s in range"
            ) from None
        return
    raise InvalidCapability("unsupported_alg", "the token's alg is not the one its key is for")


class PublicKeySource(Protocol):
    """Looks public keys up by kid: a :class:`JwksCache`, or a :class:`KeyRing` in-process."""

    async def public_key(self, kid: str) -> VerifyingKey | None:
        """The key for ``kid``, or ``None`` if unknown; may raise ``JwksUnavailable``."""
        ...


class JwsVerifier:
    """The pipeline of the module docstring; a subclass turns the payload into its claims.

    ``algorithms`` and ``types`` are the accepted header ``alg`` and ``typ``
    values (``None`` in ``types``: ``typ`` may be absent); ``required``
    claims must be present; ``strict_aud`` demands ``aud`` be exactly the
    audience (not a list holding it).
    """

    def __init__(
        self,
        keys: PublicKeySource,
        *,
        issuer: str,
        audience: str,
        clock: Clock,
        algorithms: Collection[str],
        types: Collection[str | None],
        required: Collection[str],
        strict_aud: bool,
        leeway_seconds: float,
        max_token_bytes: int,
    ) -> None:
        name = type(self).__name__
        # A verifier without an audience would accept tokens minted for any
        # other service by the same issuer.
        if not isinstance(audience, str) or not audience:
            raise ConfigurationError(f"{name}.audience must be a non-empty string")
        if not isinstance(issuer, str) or not issuer:
            raise ConfigurationError(f"{name}.issuer must be a non-empty string")
        if not 0 <= leeway_seconds <= MAX_LEEWAY_SECONDS:
            raise ConfigurationError(
                f"{name}.leeway_seconds must be within 0..{MAX_LEEWAY_SECONDS:g}"
            )
        if not 256 <= max_token_bytes <= 65536:
            raise ConfigurationError(f"{name}.max_token_bytes must be within 256..65536")
        self._keys = keys
        self._issuer = issuer
        self._audience = audience
        self._clock = clock
        self._algorithms = list(algorithms)
        self._types = frozenset(types)
        self._required = list(required)
        self._strict_aud = strict_aud
        self._leeway = leeway_seconds
        self._max_bytes = max_token_bytes
        # A private PyJWT instance: nobody's register_algorithm() reaches it.
        self._jwt = jwt.PyJWT()

    async def _verified_payload(self, token: str) -> dict[str, Any]:
        """The payload of a token that passes every check; :class:`InvalidCapability` otherwise."""
        payload, _, _ = await self._verified_with_key(token)
        return payload

    async def _verified_with_key(self, token: str) -> tuple[dict[str, Any], str, VerifyingKey]:
        """:meth:`_verified_payload`, with the kid and the key that verified it."""
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
        public_key = await self._key_of(kid)
        if public_key is None:
            raise InvalidCapability("unknown_kid", "no published key has the token's kid")
        alg = header["alg"]
        _check_key_and_signature(alg, public_key, signature)
        payload = self._decode(token, public_key, alg)
        self._check_times(payload)
        return payload, kid, public_key

    async def _key_of(self, kid: str) -> VerifyingKey | None:
        """The source's key for ``kid`` now (``None``: unknown); a JWKS that
        cannot be fetched is the ``jwks_unavailable`` refusal."""
        try:
            return await self._keys.public_key(kid)
        except JwksUnavailable:
            raise InvalidCapability("jwks_unavailable", "the JWKS could not be fetched") from None

    def _alg_refusal(self) -> InvalidCapability:
        return InvalidCapability(
            "unsupported_alg", f"only {' or '.join(self._algorithms)} is accepted"
        )

    def _check_header(self, header: dict[str, Any]) -> str:
        if header.get("alg") not in self._algorithms:
            raise self._alg_refusal()
        if "crit" in header:
            # We implement no JWS extension, so every critical one is unknown.
            raise InvalidCapability("unknown_crit", "the header lists critical extensions")
        if header.get("typ") not in self._types:
            named = " or ".join(sorted(t for t in self._types if t is not None))
            raise InvalidCapability("bad_header", f"typ must be {named}")
        if _FORBIDDEN_HEADERS & header.keys():
            raise InvalidCapability("bad_header", "the header references keys or sets b64")
        kid = header.get("kid")
        if not isinstance(kid, str) or not kid:
            raise InvalidCapability("bad_header", "the header has no kid")
        return kid

    def _decode(self, token: str, public_key: VerifyingKey, alg: str) -> dict[str, Any]:
        try:
            return self._jwt.decode(
                token,
                key=public_key,
                # the one algorithm the key is for (checked against the header)
                algorithms=[alg],
                audience=self._audience,
                issuer=self._issuer,
                options={
                    "require": self._required,
                    "strict_aud": self._strict_aud,
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
            raise self._alg_refusal() from None
        except (jwt_errors.InvalidSubjectError, jwt_errors.InvalidJTIError):
            raise InvalidCapability("invalid_claim", "sub and jti must be strings") from None
        except jwt_errors.PyJWTError:
            # PyJWT's own text may quote header values: not repeated here.
            raise InvalidCapability("malformed", "the token could not be decoded") from None

    def _check_times(self, payload: dict[str, Any]) -> None:
        for name in ("exp", "nbf", "iat"):
            if name in payload and type(payload[name]) is not int:
                raise InvalidCapability("invalid_claim", f"claim {name} must be an integer")
        now = self._clock.now().timestamp()
        # PyJWT's semantics: valid while now < exp + leeway. exp and iat are
        # required by every verifier; nbf where ``required`` says so.
        if payload["exp"] <= now - self._leeway:
            raise InvalidCapability("expired", "the token has expired")
        if payload.get("nbf", 0) > now + self._leeway:
            raise InvalidCapability("not_yet_valid", "nbf is in the future")
        if payload["iat"] > now + self._leeway:
            raise InvalidCapability("not_yet_valid", "iat is in the future")
