"""Strict unpadded base64url (RFC 7515 §2), the encoding of every JOSE segment.

Decoding rejects padding, characters outside the URL-safe alphabet and
non-canonical trailing bits, so one byte string has exactly one accepted
text form: a verifier never accepts two spellings of the same signature.
"""

from __future__ import annotations

import base64
import binascii
import re

__all__ = ["b64url_decode", "b64url_encode"]

_ALPHABET = re.compile(r"[A-Za-z0-9_-]*")


def b64url_encode(data: bytes) -> str:
    """Encode ``data`` as base64url without ``=`` padding."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64url_decode(text: str) -> bytes:
    """Decode unpadded base64url; raise ``ValueError`` on any other spelling."""
    if not _ALPHABET.fullmatch(text) or len(text) % 4 == 1:
        raise ValueError("not unpadded base64url")
    try:
        data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except binascii.Error:
        raise ValueError("not unpadded base64url") from None
    # Unused low bits in the last character must be zero (RFC 4648 §3.5);
    # otherwise several texts would decode to the same bytes.
    if b64url_encode(data) != text:
        raise ValueError("non-canonical base64url")
    return data
