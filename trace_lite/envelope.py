"""Envelope encryption with the lite profile's local key-encryption key (KEK).

Stored credentials (Euterpe's connector secrets) are encrypted the way KMS
envelope encryption does it in the aws profile: every value gets a fresh
256-bit data key; the value is sealed with AES-256-GCM under the data key,
and the data key is wrapped with AES-256-GCM under the KEK. Both seals bind
``context`` (for instance ``org:<id>/credential:<name>``) as associated data,
so a ciphertext moved to another record fails to open. Only the wrapped key
and the ciphertext are stored; the KEK stays in ``<data dir>/kek.key``.
"""

from __future__ import annotations

import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from trace_core.errors import ConfigurationError, InvalidInput
from trace_core.security.envelope import Envelope

__all__ = ["Envelope", "LocalKeyEncryption"]

_NONCE = 12
_KEY = 32
_VERSION = b"\x01"


class LocalKeyEncryption:
    """Seals and opens values under a 32-byte KEK (see the module docstring)."""

    def __init__(self, kek: bytes) -> None:
        if len(kek) != _KEY:
            raise ConfigurationError("the key-encryption key must be 32 bytes")
        self._kek = AESGCM(kek)

    def __repr__(self) -> str:
        return "LocalKeyEncryption(kek='<redacted>')"

    def seal(self, plaintext: bytes, context: str) -> Envelope:
        """Encrypt ``plaintext`` under a fresh data key bound to ``context``."""
        data_key = AESGCM.generate_key(bit_length=256)
        aad = _VERSION + context.encode()
        key_nonce, value_nonce = os.urandom(_NONCE), os.urandom(_NONCE)
        wrapped = key_nonce + self._kek.encrypt(key_nonce, data_key, aad)
        sealed = value_nonce + AESGCM(data_key).encrypt(value_nonce, plaintext, aad)
        return Envelope(wrapped, sealed)

    def open(self, envelope: Envelope, context: str) -> bytes:
        """The plaintext; :class:`InvalidInput` if the envelope was tampered with,
        sealed under another KEK or for another ``context``."""
        aad = _VERSION + context.encode()
        try:
            data_key = self._kek.decrypt(
                envelope.wrapped_key[:_NONCE], envelope.wrapped_key[_NONCE:], aad
            )
            return AESGCM(data_key).decrypt(
                envelope.ciphertext[:_NONCE], envelope.ciphertext[_NONCE:], aad
            )
        except (InvalidTag, ValueError):
            raise InvalidInput("envelope", "does not open under this key and context") from None
