"""RSA public keys of an identity provider's JWKS, for people's RS256 tokens.

Many identity providers sign with RS256 only. A JWKS cache imports RSA
entries only when its verifier is configured with ``RS256``
(:class:`~trace_core.security.jwks_cache.JwksCache`'s ``algorithms``); the
capability-token path never is. The import is strict: ``kty=RSA``, ``use``
``sig`` (or absent: some providers leave it out), ``alg`` ``RS256`` (or
absent: the key is then used for RS256 only), a kid, no private members, a
canonical base64url modulus of 2048..8192 bits and an odd public exponent.
Which algorithm a key verifies is decided by its type (EC P-256: ES256,
RSA: RS256), never by a token's header (:mod:`trace_core.security.jws_verifier`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cryptography.hazmat.primitives.asymmetric import rsa

from trace_core.security.b64url import b64url_decode

__all__ = ["MAX_RSA_BITS", "MIN_RSA_BITS", "RSA_ALG", "rsa_public_key_from_jwk"]

RSA_ALG = "RS256"
MIN_RSA_BITS = 2048
"""Smaller moduli are refused (NIST SP 800-131A; RFC 7518 §3.3 requires 2048)."""
MAX_RSA_BITS = 8192
"""Larger moduli are refused: a verification with a huge key costs CPU for nothing."""
_MAX_EXPONENT_BYTES = 8
# Private-key members of RFC 7518 §6.3.2 (and oct's k): a public JWKS never carries them.
_PRIVATE_MEMBERS = frozenset({"d", "p", "q", "dp", "dq", "qi", "oth", "k"})


def rsa_public_key_from_jwk(jwk: Mapping[str, Any]) -> rsa.RSAPublicKey:
    """Import a public RSA JWK for RS256 signatures.

    Raises ``ValueError`` naming the first rule broken: another key type,
    use or alg; a missing or empty kid; private-key members; ``n`` or ``e``
    that are not canonical base64url of a minimal big-endian integer; a
    modulus outside 2048..8192 bits; an exponent cryptography refuses.
    """
    if jwk.get("kty") != "RSA":
        raise ValueError("JWK kty must be 'RSA'")
    if jwk.get("use", "sig") != "sig":
        raise ValueError("JWK use must be 'sig'")
    if jwk.get("alg", RSA_ALG) != RSA_ALG:
        raise ValueError(f"JWK alg must be {RSA_ALG!r} (or absent)")
    kid = jwk.get("kid")
    if not isinstance(kid, str) or not kid:
        raise ValueError("JWK kid must be a non-empty string")
    if _PRIVATE_MEMBERS & jwk.keys():
        raise ValueError("JWK carries private key members")
    modulus = _unsigned(jwk, "n")
    if not MIN_RSA_BITS <= modulus.bit_length() <= MAX_RSA_BITS:
        raise ValueError(f"JWK n must be a {MIN_RSA_BITS}..{MAX_RSA_BITS}-bit modulus")
    exponent = _unsigned(jwk, "e", max_bytes=_MAX_EXPONENT_BYTES)
    # cryptography checks 3 <= e < n, e odd and n odd.
    return rsa.RSAPublicNumbers(exponent, modulus).public_key()


def _unsigned(jwk: Mapping[str, Any], member: str, *, max_bytes: int | None = None) -> int:
    text = jwk.get(member)
    if not isinstance(text, str):
        raise ValueError(f"JWK {member} must be a string")
    raw = b64url_decode(text)
    # RFC 7518 §6.3.1: the minimal octets, so one key has one spelling.
    if not raw or raw[0] == 0:
        raise ValueError(f"JWK {member} must be a minimal big-endian integer")
    if max_bytes is not None and len(raw) > max_bytes:
        raise ValueError(f"JWK {member} must be at most {max_bytes} bytes")
    return int.from_bytes(raw, "big")
