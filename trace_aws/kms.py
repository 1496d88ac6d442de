"""The KMS signer of capability tokens: ES256 with an ``ECC_NIST_P256`` key.

:class:`KmsSigner` implements :class:`~trace_core.security.signing.Signer`:
``Sign`` with ``ECDSA_SHA_256`` returns an ASN.1 DER signature, which it
converts to the raw ``r || s`` a JWS carries (``der_to_raw``, strict).

Signing is on the claim path, so everything that can be cached is fetched
once, when the signer is loaded (``DescribeKey`` checks spec, usage and
state; ``GetPublicKey``): the public key, the kid
(its RFC 7638 thumbprint, as in the lite profile, so the kid is a function of
the key), the public JWK, and the key ARN. The ARN is what ``Sign`` is
called with: an alias moved to another key later cannot make this signer
produce signatures its published JWK does not verify. Each signature is then
one KMS round trip, made off the event loop.

Rotation follows :class:`~trace_core.security.jwks.KeyRing`: a new KMS key
becomes a new signer, ``ring.rotate(signer)`` publishes it at once and lets
it sign one verifier-cache lifetime later; :func:`kms_key_ring` rebuilds a
ring from recorded schedules at start-up. KMS's own automatic rotation does
not exist for asymmetric keys (and would change the key behind a kid).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Final, Literal

import anyio.to_thread
import boto3.session
from botocore.config import Config
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from trace_aws.kms_errors import KmsKeyUnusable, KmsRequestFailed, kms_call
from trace_core.clock import Clock
from trace_core.errors import ConfigurationError
from trace_core.security import (
    KeyRing,
    KeySchedule,
    RotationPolicy,
    der_to_raw,
    ec_public_jwk,
    jwk_thumbprint,
)

if TYPE_CHECKING:
    from mypy_boto3_kms import KMSClient

__all__ = ["RAW_MESSAGE_LIMIT", "KmsKey", "KmsSigner", "kms_client", "kms_key_ring"]

RAW_MESSAGE_LIMIT = 4096
"""KMS ``Sign`` takes at most 4096 bytes with ``MessageType=RAW``; longer
signing inputs are hashed here and sent as ``DIGEST``."""

_KEY_SPEC: Final = "ECC_NIST_P256"
_ALGORITHM: Final = "ECDSA_SHA_256"

_DEFAULT_CONFIG = Config(
    # Signing is on the claim path: fail fast, let the caller's retry decide.
    connect_timeout=2,
    read_timeout=5,
    retries={"mode": "standard", "total_max_attempts": 3},
    # As many pooled connections as anyio's default worker threads, so that
    # concurrent claims do not queue on (or churn) the connection pool.
    max_pool_connections=40,
)


def kms_client(
    region: str, endpoint_url: str | None = None, *, config: Config | None = None
) -> KMSClient:
    """Create the one KMS client an adapter uses (thread-safe; share it).

    ``region`` is required (never guessed from the environment);
    ``endpoint_url`` points at moto or LocalStack.
    """
    if not isinstance(region, str) or not region:
        raise ConfigurationError("kms region must be a non-empty string (e.g. 'us-east-1')")
    # A session of its own: boto3's default session caches the credentials it
    # found first for the life of the process, whoever created it.
    session = boto3.session.Session(region_name=region)
    client: KMSClient = session.client(
        "kms", endpoint_url=endpoint_url, config=config or _DEFAULT_CONFIG
    )
    return client


class KmsSigner:
    """A :class:`~trace_core.security.signing.Signer` over one KMS ``ECC_NIST_P256`` key.

    Build it with :meth:`load` (``DescribeKey`` and ``GetPublicKey``, once, at start-up).
    """

    def __init__(self, client: KMSClient, key_arn: str, public_key: ec.EllipticCurvePublicKey):
        self._client = client
        self._key_arn = key_arn
        self._public_key = public_key
        self._kid = jwk_thumbprint(public_key)
        self._jwk = ec_public_jwk(public_key, self._kid)

    @classmethod
    def load(cls, client: KMSClient, key_id: str) -> KmsSigner:
        """Fetch and check the public key of ``key_id`` (id, ARN or alias); blocking.

        Raises :class:`~trace_core.errors.ConfigurationError` naming the key
        when it is not an ES256 signing key, and the errors of
        :mod:`trace_aws.kms_errors` when KMS refuses or cannot be reached.
        """
        if not isinstance(key_id, str) or not key_id:
            raise ConfigurationError("kms signing key id must be a non-empty string")
        with kms_call("DescribeKey", key_id):
            meta = client.describe_key(KeyId=key_id)["KeyMetadata"]
        key_arn = meta["Arn"]
        spec = meta.get("KeySpec")
        if spec != _KEY_SPEC:
            raise ConfigurationError(
                f"KMS key {key_id} has key spec {spec}; ES256 needs {_KEY_SPEC}"
            )
        if meta.get("KeyUsage") != "SIGN_VERIFY":
            raise ConfigurationError(f"KMS key {key_id} is not a SIGN_VERIFY key")
        if _ALGORITHM not in meta.get("SigningAlgorithms", []):
            raise ConfigurationError(f"KMS key {key_id} does not offer {_ALGORITHM}")
        state = meta.get("KeyState")
        if state != "Enabled":
            # Refused here, at start-up, rather than on the first claim.
            raise KmsKeyUnusable("DescribeKey", key_id, f"KeyState {state}")
        with kms_call("GetPublicKey", key_arn):
            response = client.get_public_key(KeyId=key_arn)
        public_key = serialization.load_der_public_key(response["PublicKey"])
        if not isinstance(public_key, ec.EllipticCurvePublicKey) or not isinstance(
            public_key.curve, ec.SECP256R1
        ):
            raise ConfigurationError(f"KMS key {key_id} did not return a P-256 public key")
        return cls(client, key_arn, public_key)

    @property
    def kid(self) -> str:
        """The RFC 7638 thumbprint of the KMS key's public key."""
        return self._kid

    @property
    def key_arn(self) -> str:
        """The ARN of the KMS key (what ``Sign`` is called with)."""
        return self._key_arn

    def public_key(self) -> ec.EllipticCurvePublicKey:
        """The public half of the KMS key (cached from ``GetPublicKey``)."""
        return self._public_key

    def public_jwk(self) -> dict[str, str]:
        """The public JWK with this signer's kid."""
        return dict(self._jwk)

    async def sign(self, message: bytes) -> bytes:
        """KMS ``Sign`` (ECDSA P-256 / SHA-256), returned as raw ``r || s``."""
        return await anyio.to_thread.run_sync(partial(self.sign_blocking, message))

    def sign_blocking(self, message: bytes) -> bytes:
        """:meth:`sign` for synchronous callers (a thread of their own)."""
        message_type: Literal["RAW", "DIGEST"] = "RAW"
        payload = message
        if len(message) > RAW_MESSAGE_LIMIT:
            # KMS hashes RAW input itself; past its size limit we hash and say so.
            payload, message_type = hashlib.sha256(message).digest(), "DIGEST"
        with kms_call("Sign", self._key_arn):
            response = self._client.sign(
                KeyId=self._key_arn,
                Message=payload,
                MessageType=message_type,
                SigningAlgorithm=_ALGORITHM,
            )
        if response.get("KeyId") != self._key_arn:
            # Never publish a token that the JWK we serve would not verify.
            raise KmsRequestFailed("Sign", self._key_arn, "UnexpectedKeyId")
        return der_to_raw(response["Signature"])

    def __repr__(self) -> str:
        return f"KmsSigner(kid={self._kid!r}, key={self._key_arn!r})"


@dataclass(frozen=True)
class KmsKey:
    """One KMS key of a ring and its recorded schedule (what settings persist).

    The kid is not recorded: it is the thumbprint of the key, read from KMS.
    """

    key_id: str
    published_at: datetime
    activated_at: datetime | None = None
    retired_at: datetime | None = None
    bootstrap: bool = False


def kms_key_ring(
    client: KMSClient,
    keys: Iterable[KmsKey],
    clock: Clock,
    policy: RotationPolicy | None = None,
) -> KeyRing:
    """A :class:`KeyRing` of KMS signers with their recorded schedules (blocking).

    The ring checks the schedules as a whole (publish lead, no overlapping
    active periods) and raises :class:`~trace_core.errors.ConfigurationError`
    if they break its rules.
    """
    ring = KeyRing(clock, policy)
    entries: list[tuple[KmsSigner, KeySchedule]] = []
    for key in keys:
        signer = KmsSigner.load(client, key.key_id)
        schedule = KeySchedule(
            signer.kid,
            published_at=key.published_at,
            activated_at=key.activated_at,
            retired_at=key.retired_at,
            bootstrap=key.bootstrap,
        )
        entries.append((signer, schedule))
    if not entries:
        raise ConfigurationError("a KMS key ring needs at least one key")
    ring.restore(entries)
    return ring
