"""The signer port and the ES256 signature encodings.

A JWS ES256 signature is the raw 64 bytes ``r || s`` (RFC 7518 §3.4), each
half left-padded to 32 bytes. Signing services (AWS KMS, HSMs, OpenSSL)
return ASN.1 DER instead, so a :class:`Signer` converts with
:func:`der_to_raw` before returning. Both converters validate strictly:
exact DER (no trailing bytes, minimal integers) and ``1 <= r, s < n``.
"""

from __future__ import annotations

from typing import Protocol

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import (
    decode_dss_signature,
    encode_dss_signature,
)

from trace_core.errors import TraceError
from trace_core.security.jwk import ec_public_jwk, jwk_thumbprint

__all__ = [
    "P256_ORDER",
    "RAW_SIGNATURE_BYTES",
    "MalformedSignature",
    "PrivateKeySigner",
    "Signer",
    "check_raw_signature",
    "der_to_raw",
    "raw_to_der",
]

P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
"""The order ``n`` of the P-256 base point; valid scalars are ``1..n-1``."""

RAW_SIGNATURE_BYTES = 64
_HALF = RAW_SIGNATURE_BYTES // 2


class MalformedSignature(TraceError, ValueError):
    """A signature is not a well-formed ES256 signature (wrong encoding or range)."""


class Signer(Protocol):
    """Signs JWS signing inputs with one P-256 key (ES256).

    Implementations: :class:`PrivateKeySigner` (in-process key),
    ``trace_lite.keys`` (PEM files), ``trace_aws`` (KMS ``ECC_NIST_P256``).
    """

    @property
    def kid(self) -> str:
        """The key id put in the JWS header and the JWKS entry; stable per key."""
        ...

    async def sign(self, message: bytes) -> bytes:
        """Return the ES256 signature of ``message``: raw ``r || s``, 64 bytes.

        The signer hashes with SHA-256 itself. A DER-producing backend must
        convert with :func:`der_to_raw`; the issuer rejects anything that is
        not 64 bytes with both scalars in range.
        """
        ...

    def public_jwk(self) -> dict[str, str]:
        """Return the public JWK: kty EC, crv P-256, x, y, kid, use sig, alg ES256."""
        ...


def _scalars(raw: bytes) -> tuple[int, int]:
    if len(raw) != RAW_SIGNATURE_BYTES:
        raise MalformedSignature(
            f"ES256 signature must be {RAW_SIGNATURE_BYTES} raw bytes, got {len(raw)}"
        )
    r = int.from_bytes(raw[:_HALF], "big")
    s = int.from_bytes(raw[_HALF:], "big")
    # r = 0 or s = 0 is the "psychic signature" hole (CVE-2022-21449); values
    # >= n would be reduced mod n by a lax implementation.
    if not (0 < r < P256_ORDER and 0 < s < P256_ORDER):
        raise MalformedSignature("ES256 signature scalars must be within 1..n-1")
    return r, s


def check_raw_signature(raw: bytes) -> None:
    """Raise :class:`MalformedSignature` unless ``raw`` is 64 bytes, r and s in 1..n-1.

    This is the shape check only; it says nothing about whether the
    signature verifies.
    """
    _scalars(raw)


def raw_to_der(raw: bytes) -> bytes:
    """Convert a raw ``r || s`` signature to ASN.1 DER, validating it first."""
    r, s = _scalars(raw)
    return encode_dss_signature(r, s)


def der_to_raw(der: bytes) -> bytes:
    """Convert an ASN.1 DER ECDSA signature to raw ``r || s`` (64 bytes).

    Strict: the DER must be exact (cryptography's parser rejects trailing
    data, non-minimal and negative integers) and both scalars in 1..n-1.
    """
    try:
        r, s = decode_dss_signature(der)
    except ValueError:
        raise MalformedSignature("not a DER ECDSA signature") from None
    if not (0 < r < P256_ORDER and 0 < s < P256_ORDER):
        raise MalformedSignature("ES256 signature scalars must be within 1..n-1")
    return r.to_bytes(_HALF, "big") + s.to_bytes(_HALF, "big")


class PrivateKeySigner:
    """A :class:`Signer` over an in-memory P-256 private key; kid = RFC 7638 thumbprint.

    The in-process implementation of the port: tests use :meth:`generate`;
    ``trace_lite.keys`` wraps keys loaded from PEM files.
    """

    def __init__(self, private_key: ec.EllipticCurvePrivateKey) -> None:
        if not isinstance(private_key.curve, ec.SECP256R1):
            raise ValueError(f"ES256 needs a P-256 key, got curve {private_key.curve.name}")
        self._private_key = private_key
        self._public_key = private_key.public_key()
        self._kid = jwk_thumbprint(self._public_key)

    @classmethod
    def generate(cls) -> PrivateKeySigner:
        """Return a signer over a fresh random P-256 key."""
        return cls(ec.generate_private_key(ec.SECP256R1()))

    @property
    def kid(self) -> str:
        """The RFC 7638 thumbprint of the public key."""
        return self._kid

    def public_key(self) -> ec.EllipticCurvePublicKey:
        """The public half of the key."""
        return self._public_key

    async def sign(self, message: bytes) -> bytes:
        """Sign with ECDSA P-256 / SHA-256 and return raw ``r || s``."""
        # A P-256 signature takes tens of microseconds: cheaper inline than a
        # thread hop.
        der = self._private_key.sign(message, ec.ECDSA(hashes.SHA256()))
        return der_to_raw(der)

    def public_jwk(self) -> dict[str, str]:
        """The public JWK with this signer's kid."""
        return ec_public_jwk(self._public_key, self._kid)

    def __repr__(self) -> str:
        return f"PrivateKeySigner(kid={self._kid!r})"
