"""EC P-256 public keys as JWKs: export, strict import, RFC 7638 thumbprints.

Only the one key type we sign with exists here: ``kty=EC``, ``crv=P-256``,
``use=sig``, ``alg=ES256``. Anything else is rejected on import, so a JWKS
entry can never make the verifier use another curve or algorithm.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec

from trace_core.security.b64url import b64url_decode, b64url_encode

__all__ = [
    "JWK_ALG",
    "JWK_CRV",
    "JWK_KTY",
    "JWK_USE",
    "ec_public_jwk",
    "jwk_thumbprint",
    "public_key_from_jwk",
]

JWK_KTY = "EC"
JWK_CRV = "P-256"
JWK_USE = "sig"
JWK_ALG = "ES256"
_COORDINATE_BYTES = 32
# Private-key members of RFC 7518 §6.2.2 / §6.3.2: a public JWKS never carries them.
_PRIVATE_MEMBERS = frozenset({"d", "p", "q", "dp", "dq", "qi", "oth", "k"})


def _coordinates(public_key: ec.EllipticCurvePublicKey) -> tuple[str, str]:
    if not isinstance(public_key.curve, ec.SECP256R1):
        raise ValueError(f"expected a P-256 key, got curve {public_key.curve.name}")
    numbers = public_key.public_numbers()
    return (
        b64url_encode(numbers.x.to_bytes(_COORDINATE_BYTES, "big")),
        b64url_encode(numbers.y.to_bytes(_COORDINATE_BYTES, "big")),
    )


def jwk_thumbprint(public_key: ec.EllipticCurvePublicKey) -> str:
    """Return the RFC 7638 JWK thumbprint (base64url SHA-256) of a P-256 key.

    The hash input is the JSON object of the required members only
    (``crv``, ``kty``, ``x``, ``y``) in lexicographic order, without
    whitespace; that makes the kid a pure function of the key.
    """
    x, y = _coordinates(public_key)
    canonical = json.dumps(
        {"crv": JWK_CRV, "kty": JWK_KTY, "x": x, "y": y},
        separators=(",", ":"),
        sort_keys=True,
    )
    return b64url_encode(hashlib.sha256(canonical.encode("ascii")).digest())


def ec_public_jwk(public_key: ec.EllipticCurvePublicKey, kid: str | None = None) -> dict[str, str]:
    """Return the public JWK of a P-256 key (kid defaults to its thumbprint)."""
    x, y = _coordinates(public_key)
    return {
        "kty": JWK_KTY,
        "crv": JWK_CRV,
        "x": x,
        "y": y,
        "kid": kid if kid is not None else jwk_thumbprint(public_key),
        "use": JWK_USE,
        "alg": JWK_ALG,
    }


def public_key_from_jwk(jwk: Mapping[str, Any]) -> ec.EllipticCurvePublicKey:
    """Import a public JWK that is exactly EC / P-256 / sig / ES256 with a kid.

    Raises ``ValueError`` naming the first rule broken: another key type,
    curve, use or alg; a missing or empty kid; private-key members; a
    coordinate that is not 32 bytes of canonical base64url; a point that is
    not on the curve.
    """
    for member, expected in (
        ("kty", JWK_KTY),
        ("crv", JWK_CRV),
        ("use", JWK_USE),
        ("alg", JWK_ALG),
    ):
        if jwk.get(member) != expected:
            raise ValueError(f"JWK {member} must be {expected!r}")
    kid = jwk.get("kid")
    if not isinstance(kid, str) or not kid:
        raise ValueError("JWK kid must be a non-empty string")
    if _PRIVATE_MEMBERS & jwk.keys():
        raise ValueError("JWK carries private key members")
    coordinates: list[int] = []
    for member in ("x", "y"):
        text = jwk.get(member)
        if not isinstance(text, str):
            raise ValueError(f"JWK {member} must be a string")
        raw = b64url_decode(text)
        if len(raw) != _COORDINATE_BYTES:
            raise ValueError(f"JWK {member} must encode {_COORDINATE_BYTES} bytes")
        coordinates.append(int.from_bytes(raw, "big"))
    # cryptography checks that (x, y) lies on the curve (no invalid-curve keys).
    numbers = ec.EllipticCurvePublicNumbers(coordinates[0], coordinates[1], ec.SECP256R1())
    return numbers.public_key()
