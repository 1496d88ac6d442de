"""Envelope encryption under a KMS key: the aws profile's ``LocalKeyEncryption``.

Same interface and the same sealed shape as
``trace_lite.envelope.LocalKeyEncryption``: ``seal(plaintext, context)``
returns an :class:`Envelope` (``wrapped_key``, ``ciphertext``) and
``open(envelope, context)`` returns the plaintext or raises
:class:`~trace_core.errors.InvalidInput` (field ``envelope``).

Every value gets a fresh 256-bit data key from ``GenerateDataKey``; the value
is sealed with AES-256-GCM under it, with ``context`` as associated data. KMS
binds the same ``context`` to the wrapped data key as its encryption context,
so an envelope moved to another record opens neither the data key nor the
value. The data key never leaves this process unwrapped.

``wrapped_key`` names its KMS key::

    0x01 | len(key ARN) (2 bytes, big-endian) | key ARN | KMS ciphertext blob

so rotation works: new values are sealed under the current key, ``open``
accepts any key configured as current or previous (``Decrypt`` is called
with that ``KeyId``, so KMS refuses a blob of any other key), and
:meth:`KmsKeyEncryption.rewrap` moves an envelope to the current key with
``ReEncrypt`` (the data key stays inside KMS; the value is untouched), after
which the old key can be dropped from the configuration.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from functools import partial
from typing import TYPE_CHECKING, Final, TypeVar

import anyio.to_thread
from botocore.exceptions import ClientError
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from trace_aws.errors import error_code
from trace_aws.kms_errors import KmsKeyUnusable, kms_call
from trace_core.errors import ConfigurationError, InvalidInput
from trace_core.security.envelope import Envelope

if TYPE_CHECKING:
    from collections.abc import Callable

    from mypy_boto3_kms import KMSClient

__all__ = ["Envelope", "KmsKeyEncryption"]

_VERSION: Final = b"\x01"
_NONCE: Final = 12
_ARN_LENGTH_BYTES: Final = 2
_CONTEXT_KEY: Final = "trace:context"
# Errors that mean "this blob does not open under that key and context".
_UNOPENABLE_CODES: Final = frozenset({"InvalidCiphertextException", "IncorrectKeyException"})

_T = TypeVar("_T")


def _unopenable() -> InvalidInput:
    return InvalidInput("envelope", "does not open under this key and context")


def _encryption_context(context: str) -> dict[str, str]:
    if not isinstance(context, str) or not context:
        raise InvalidInput("context", "must be a non-empty string")
    return {_CONTEXT_KEY: context}


def _aad(context: str) -> bytes:
    return _VERSION + context.encode()


def _wrap(key_arn: str, blob: bytes) -> bytes:
    arn = key_arn.encode()
    return _VERSION + len(arn).to_bytes(_ARN_LENGTH_BYTES, "big") + arn + blob


def _unwrap(wrapped_key: bytes) -> tuple[str, bytes]:
    """The key ARN and the KMS blob of a wrapped key; InvalidInput if malformed."""
    head = 1 + _ARN_LENGTH_BYTES
    if len(wrapped_key) <= head or wrapped_key[:1] != _VERSION:
        raise _unopenable()
    end = head + int.from_bytes(wrapped_key[1:head], "big")
    if end >= len(wrapped_key):
        raise _unopenable()
    try:
        return wrapped_key[head:end].decode(), wrapped_key[end:]
    except UnicodeDecodeError:
        raise _unopenable() from None


def _describe(client: KMSClient, key_id: str) -> str:
    """The ARN of a usable symmetric encryption key; ConfigurationError otherwise."""
    if not isinstance(key_id, str) or not key_id:
        raise ConfigurationError("kms encryption key id must be a non-empty string")
    with kms_call("DescribeKey", key_id):
        meta = client.describe_key(KeyId=key_id)["KeyMetadata"]
    if meta.get("KeyUsage") != "ENCRYPT_DECRYPT" or meta.get("KeySpec") != "SYMMETRIC_DEFAULT":
        raise ConfigurationError(
            f"KMS key {key_id} must be a SYMMETRIC_DEFAULT ENCRYPT_DECRYPT key for envelopes"
        )
    if meta.get("KeyState") != "Enabled":
        raise KmsKeyUnusable("DescribeKey", key_id, f"KeyState {meta.get('KeyState')}")
    return meta["Arn"]


class KmsKeyEncryption:
    """Seals and opens values under KMS keys (see the module docstring).

    ``seal``/``open``/``rewrap`` block on KMS (one round trip each), like the
    lite class's interface; async callers use the ``a``-prefixed twins, which
    run them off the event loop.
    """

    def __init__(
        self, client: KMSClient, key_arn: str, previous_key_arns: Iterable[str] = ()
    ) -> None:
        self._client = client
        self._current = key_arn
        self._allowed = frozenset({key_arn, *previous_key_arns})

    @classmethod
    def load(
        cls, client: KMSClient, key_id: str, previous_key_ids: Iterable[str] = ()
    ) -> KmsKeyEncryption:
        """Resolve and check the current key and the previous ones (blocking; start-up).

        Every key must be an enabled ``SYMMETRIC_DEFAULT`` key: a previous key
        stays needed until :meth:`rewrap` has moved every envelope off it.
        """
        previous = [_describe(client, k) for k in previous_key_ids]
        return cls(client, _describe(client, key_id), previous)

    @property
    def key_arn(self) -> str:
        """The KMS key new values are sealed under."""
        return self._current

    def __repr__(self) -> str:
        return f"KmsKeyEncryption(key={self._current!r}, keys={len(self._allowed)})"

    @staticmethod
    def key_of(envelope: Envelope) -> str:
        """The ARN of the KMS key an envelope's data key is wrapped under."""
        return _unwrap(envelope.wrapped_key)[0]

    def seal(self, plaintext: bytes, context: str) -> Envelope:
        """Encrypt ``plaintext`` under a fresh data key bound to ``context``."""
        encryption_context = _encryption_context(context)
        with kms_call("GenerateDataKey", self._current):
            response = self._client.generate_data_key(
                KeyId=self._current, KeySpec="AES_256", EncryptionContext=encryption_context
            )
        nonce = os.urandom(_NONCE)
        sealed = nonce + AESGCM(response["Plaintext"]).encrypt(nonce, plaintext, _aad(context))
        return Envelope(_wrap(self._current, response["CiphertextBlob"]), sealed)

    def open(self, envelope: Envelope, context: str) -> bytes:
        """The plaintext; :class:`InvalidInput` if the envelope was tampered with,
        sealed under a key not configured here, or for another ``context``."""
        encryption_context = _encryption_context(context)
        key_arn, blob = _unwrap(envelope.wrapped_key)
        if key_arn not in self._allowed:
            raise InvalidInput("envelope", f"sealed under KMS key {key_arn}, not configured here")
        with kms_call("Decrypt", key_arn):
            try:
                response = self._client.decrypt(
                    CiphertextBlob=blob, KeyId=key_arn, EncryptionContext=encryption_context
                )
            except ClientError as exc:
                if error_code(exc) in _UNOPENABLE_CODES:
                    raise _unopenable() from None
                raise
        if len(envelope.ciphertext) <= _NONCE:
            raise _unopenable()
        try:
            return AESGCM(response["Plaintext"]).decrypt(
                envelope.ciphertext[:_NONCE], envelope.ciphertext[_NONCE:], _aad(context)
            )
        except (InvalidTag, ValueError):
            raise _unopenable() from None

    def rewrap(self, envelope: Envelope, context: str) -> Envelope:
        """The same envelope with its data key wrapped under the current key.

        ``ReEncrypt`` decrypts and re-encrypts inside KMS (the data key is
        never in this process); the ciphertext is unchanged. An envelope
        already under the current key is returned as is.
        """
        encryption_context = _encryption_context(context)
        key_arn, blob = _unwrap(envelope.wrapped_key)
        if key_arn == self._current:
            return envelope
        if key_arn not in self._allowed:
            raise InvalidInput("envelope", f"sealed under KMS key {key_arn}, not configured here")
        with kms_call("ReEncrypt", key_arn):
            try:
                response = self._client.re_encrypt(
                    CiphertextBlob=blob,
                    SourceKeyId=key_arn,
                    SourceEncryptionContext=encryption_context,
                    DestinationKeyId=self._current,
                    DestinationEncryptionContext=encryption_context,
                )
            except ClientError as exc:
                if error_code(exc) in _UNOPENABLE_CODES:
                    raise _unopenable() from None
                raise
        return Envelope(_wrap(self._current, response["CiphertextBlob"]), envelope.ciphertext)

    async def aseal(self, plaintext: bytes, context: str) -> Envelope:
        """:meth:`seal` off the event loop."""
        return await _off_loop(partial(self.seal, plaintext, context))

    async def aopen(self, envelope: Envelope, context: str) -> bytes:
        """:meth:`open` off the event loop."""
        return await _off_loop(partial(self.open, envelope, context))

    async def arewrap(self, envelope: Envelope, context: str) -> Envelope:
        """:meth:`rewrap` off the event loop."""
        return await _off_loop(partial(self.rewrap, envelope, context))


async def _off_loop(call: Callable[[], _T]) -> _T:
    return await anyio.to_thread.run_sync(call)
