"""Envelope encryption, the port: a value sealed under a data key that a key
encryption key wraps (euterpe-contract.md, encrypted credentials).

The lite profile seals with a local key (``trace_lite.envelope``), the AWS
profile with KMS (``trace_aws.kms_envelope``); both take and return the same
:class:`Envelope`, so what is stored does not depend on the profile's code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["Envelope", "KeyEncryption"]


@dataclass(frozen=True, repr=False)
class Envelope:
    """A sealed value: the wrapped data key and the ciphertext. ``repr()``
    shows their sizes only."""

    wrapped_key: bytes
    ciphertext: bytes

    def __repr__(self) -> str:
        sizes = f"wrapped_key=<{len(self.wrapped_key)} bytes>, ciphertext=<{len(self.ciphertext)}"
        return f"Envelope({sizes} bytes>)"


class KeyEncryption(Protocol):
    """Seals values under a fresh data key; ``context`` is bound as associated data."""

    def seal(self, plaintext: bytes, context: str) -> Envelope:
        """``plaintext`` sealed for ``context``."""
        ...

    def open(self, envelope: Envelope, context: str) -> bytes:
        """The plaintext of ``envelope`` sealed for ``context``;
        :class:`~trace_core.errors.InvalidInput` naming ``envelope`` if it does
        not open (another context, another key, tampered)."""
        ...
