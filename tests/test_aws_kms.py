"""trace_aws.kms against moto (in-process ``mock_aws``), and botocore's Stubber
where moto does not behave like KMS.

moto's known differences that matter here: it signs with real P-256 keys and
returns real DER (so DER -> raw and verification are shown for real), but it
ignores ``MessageType=DIGEST`` (it hashes the digest again) and never refuses
a disabled or pending-deletion key. Those paths are tested with the Stubber.
"""

from __future__ import annotations

import hashlib
import json
import socket
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from botocore.config import Config
from botocore.stub import Stubber
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from moto import mock_aws
from moto.server import ThreadedMotoServer

from trace_aws.kms import RAW_MESSAGE_LIMIT, KmsKey, KmsSigner, kms_client, kms_key_ring
from trace_aws.kms_envelope import Envelope, KmsKeyEncryption
from trace_aws.kms_errors import KmsKeyUnusable, KmsRequestFailed, KmsUnavailable
from trace_core.clock import ManualClock
from trace_core.errors import ConfigurationError, InvalidInput
from trace_core.security import (
    DatasetInput,
    InvalidCapability,
    JwksCache,
    KeyRing,
    KeyState,
    MalformedSignature,
    RotationPolicy,
    TokenIssuer,
    TokenVerifier,
    raw_to_der,
)
from trace_core.security.b64url import b64url_decode, b64url_encode

if TYPE_CHECKING:
    from mypy_boto3_kms import KMSClient

pytestmark = pytest.mark.anyio

REGION = "us-east-1"
ISS, AUD = "trace-dispatcher", "trace-task"
TTL = 600
CACHE = 300.0
POLICY = RotationPolicy(verifier_cache_seconds=CACHE, max_token_ttl_seconds=TTL, leeway_seconds=30)
TASK = uuid.UUID("00000000-0000-0000-0000-00000000abcd")
INPUT = DatasetInput(uuid.uuid4(), uuid.uuid4(), "s3://trace-data/t1/in/")
OUT, SCRATCH = "s3://trace-data/t1/out/", "s3://trace-scratch/t1/task/"


# --- shared AWS fixtures (a later session factors them out) -----------------


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake credentials and an explicit region: never real ones."""
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": REGION,
    }.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_KMS"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def kms(aws_env: None) -> Iterator[KMSClient]:
    """A KMS client inside moto's in-process mock."""
    with mock_aws():
        yield kms_client(REGION)


def _signing_key(client: KMSClient, spec: str = "ECC_NIST_P256") -> str:
    meta = client.create_key(KeyUsage="SIGN_VERIFY", KeySpec=spec)["KeyMetadata"]  # type: ignore[arg-type]
    return meta["Arn"]


def _calls(client: KMSClient) -> list[str]:
    """Record the name of every KMS operation the client sends."""
    seen: list[str] = []

    def record(model: Any, **_: Any) -> None:
        seen.append(model.name)

    client.meta.events.register("before-call.kms", record)
    return seen


def _jwks_endpoint(ring: KeyRing) -> Any:
    async def fetch() -> Mapping[str, Any]:
        # Through JSON, as GET /internal/jwks/task serves it.
        document: Mapping[str, Any] = json.loads(json.dumps(ring.jwks()))
        return document

    return fetch


def _verifier(ring: KeyRing, clock: ManualClock) -> TokenVerifier:
    cache = JwksCache(
        _jwks_endpoint(ring), clock, min_refresh_interval_seconds=CACHE, max_age_seconds=CACHE
    )
    return TokenVerifier(cache, ISS, AUD, clock, leeway_seconds=30)


def _header(token: str) -> dict[str, Any]:
    return dict(json.loads(b64url_decode(token.split(".")[0])))


# --- the signer -----------------------------------------------------------------


async def test_kms_signed_tokens_verify_with_the_verifier_and_the_published_jwks(
    kms: KMSClient,
) -> None:
    clock = ManualClock()
    signer = KmsSigner.load(kms, _signing_key(kms))
    ring = KeyRing(clock, POLICY)
    ring.bootstrap(signer)
    token = await TokenIssuer(ring, ISS, AUD, TTL, clock).issue(TASK, 2, [INPUT], OUT, SCRATCH)
    assert (_header(token)["kid"], _header(token)["alg"]) == (signer.kid, "ES256")
    claims = await _verifier(ring, clock).verify(token)
    assert (claims.task_id, claims.attempt, claims.output_prefixes) == (TASK, 2, (OUT,))
    assert ring.jwks() == {"keys": [signer.public_jwk()]}
    # The JWK is KMS's key: the kid is the thumbprint of what GetPublicKey returns.
    der = kms.get_public_key(KeyId=signer.key_arn)["PublicKey"]
    assert (
        signer.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        == der
    )


async def test_the_der_kms_returns_becomes_raw_r_s_and_der_never_passes_as_a_jws(
    kms: KMSClient,
) -> None:
    clock = ManualClock()
    signer = KmsSigner.load(kms, _signing_key(kms))
    message = b"header.payload"
    der = kms.sign(
        KeyId=signer.key_arn, Message=message, MessageType="RAW", SigningAlgorithm="ECDSA_SHA_256"
    )["Signature"]
    assert der[0] == 0x30 and len(der) != 64  # KMS (and moto) answer ASN.1 DER
    raw = await signer.sign(message)
    assert len(raw) == 64
    signer.public_key().verify(raw_to_der(raw), message, ec.ECDSA(hashes.SHA256()))

    ring = KeyRing(clock, POLICY)
    ring.bootstrap(signer)
    token = await TokenIssuer(ring, ISS, AUD, TTL, clock).issue(TASK, 1, [INPUT], OUT, SCRATCH)
    signing_input = token.rsplit(".", 1)[0]
    der_of_input = kms.sign(
        KeyId=signer.key_arn,
        Message=signing_input.encode(),
        MessageType="RAW",
        SigningAlgorithm="ECDSA_SHA_256",
    )["Signature"]
    with pytest.raises(InvalidCapability):
        await _verifier(ring, clock).verify(f"{signing_input}.{b64url_encode(der_of_input)}")


async def test_the_public_key_is_fetched_once_and_each_token_costs_one_sign_call(
    kms: KMSClient,
) -> None:
    key = _signing_key(kms)
    calls = _calls(kms)
    signer = KmsSigner.load(kms, key)
    ring = KeyRing(ManualClock(), POLICY)
    ring.bootstrap(signer)
    issuer = TokenIssuer(ring, ISS, AUD, TTL, ManualClock())
    for attempt in range(1, 6):
        await issuer.issue(TASK, attempt, [INPUT], OUT, SCRATCH)
        ring.jwks()
    assert calls == ["DescribeKey", "GetPublicKey"] + ["Sign"] * 5


async def test_an_alias_is_resolved_once_so_moving_it_cannot_change_the_signing_key(
    kms: KMSClient,
) -> None:
    first, second = _signing_key(kms), _signing_key(kms)
    kms.create_alias(AliasName="alias/trace-signing", TargetKeyId=first)
    signer = KmsSigner.load(kms, "alias/trace-signing")
    assert signer.key_arn == first
    kms.update_alias(AliasName="alias/trace-signing", TargetKeyId=second)
    raw = await signer.sign(b"m")
    signer.public_key().verify(raw_to_der(raw), b"m", ec.ECDSA(hashes.SHA256()))


@pytest.mark.parametrize(
    ("usage", "spec", "match"),
    [
        ("SIGN_VERIFY", "ECC_NIST_P384", "key spec ECC_NIST_P384"),
        ("SIGN_VERIFY", "RSA_2048", "key spec RSA_2048"),
        ("SIGN_VERIFY", "ECC_SECG_P256K1", "key spec ECC_SECG_P256K1"),
    ],
)
def test_a_key_that_cannot_do_es256_is_refused_at_load(
    kms: KMSClient, usage: str, spec: str, match: str
) -> None:
    arn = kms.create_key(KeyUsage=usage, KeySpec=spec)["KeyMetadata"]["Arn"]  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=match) as caught:
        KmsSigner.load(kms, arn)
    assert arn in str(caught.value)


def test_a_missing_key_is_a_clear_error_naming_the_operation_and_key(kms: KMSClient) -> None:
    missing = str(uuid.uuid4())
    with pytest.raises(KmsKeyUnusable, match=f"DescribeKey refused by key {missing} .NotFound"):
        KmsSigner.load(kms, missing)
    with pytest.raises(ConfigurationError, match="region"):
        kms_client("")


def test_a_disabled_key_is_refused_at_load(kms: KMSClient) -> None:
    # moto records the key state (DescribeKey) though its Sign ignores it.
    arn = _signing_key(kms)
    kms.disable_key(KeyId=arn.rsplit("/", 1)[1])  # moto's DisableKey takes the bare id only
    with pytest.raises(
        KmsKeyUnusable, match=f"DescribeKey refused by key {arn} .KeyState Disabled"
    ):
        KmsSigner.load(kms, arn)


async def test_rotation_publishes_the_new_kms_key_before_it_signs(kms: KMSClient) -> None:
    clock = ManualClock()
    old = KmsSigner.load(kms, _signing_key(kms))
    new = KmsSigner.load(kms, _signing_key(kms))
    ring = KeyRing(clock, POLICY)
    bootstrap = ring.bootstrap(old)
    issuer = TokenIssuer(ring, ISS, AUD, TTL, clock)
    verifier = _verifier(ring, clock)
    await verifier.verify(await issuer.issue(TASK, 1, [INPUT], OUT, SCRATCH))  # caches {old}
    clock.advance(100)
    schedule = ring.rotate(new)
    assert [k["kid"] for k in ring.jwks()["keys"]] == [old.kid, new.kid]  # published now
    assert ring.state(new.kid) is KeyState.PUBLISHED
    clock.advance(CACHE - 1)
    last_old = await issuer.issue(TASK, 1, [INPUT], OUT, SCRATCH)
    assert _header(last_old)["kid"] == old.kid  # the new key does not sign yet
    clock.advance(1)
    first_new = await issuer.issue(TASK, 1, [INPUT], OUT, SCRATCH)
    assert _header(first_new)["kid"] == new.kid
    await verifier.verify(first_new)
    await verifier.verify(last_old)  # the retiring key still verifies its tokens

    # Another replica rebuilds the same ring from the recorded schedules.
    replica = kms_key_ring(
        kms,
        [
            KmsKey(
                old.key_arn,
                bootstrap.published_at,
                bootstrap.activated_at,
                schedule.activated_at,
                bootstrap=True,
            ),
            KmsKey(new.key_arn, schedule.published_at, schedule.activated_at),
        ],
        clock,
        POLICY,
    )
    assert replica.jwks() == ring.jwks()
    assert replica.active_signer().kid == new.kid
    await verifier.verify(
        await TokenIssuer(replica, ISS, AUD, TTL, clock).issue(TASK, 3, [INPUT], OUT, SCRATCH)
    )
    with pytest.raises(ConfigurationError, match="both be active"):
        kms_key_ring(
            kms,
            [
                KmsKey(old.key_arn, bootstrap.published_at, bootstrap.activated_at, bootstrap=True),
                KmsKey(new.key_arn, schedule.published_at, schedule.activated_at),
            ],
            clock,
            POLICY,
        )


# --- what moto does not do: the Stubber --------------------------------------------


@pytest.fixture
def stubbed(aws_env: None) -> Iterator[tuple[KmsSigner, Stubber, ec.EllipticCurvePrivateKey]]:
    """A signer over a botocore Stubber (no moto): the private key stands in for KMS."""
    client = kms_client(REGION)
    private = ec.generate_private_key(ec.SECP256R1())
    arn = "arn:aws:kms:us-east-1:123456789012:key/11111111-2222-3333-4444-555555555555"
    signer = KmsSigner(client, arn, private.public_key())
    with Stubber(client) as stub:
        yield signer, stub, private
        stub.assert_no_pending_responses()


async def test_a_signing_input_past_the_raw_limit_is_sent_as_its_digest(
    stubbed: tuple[KmsSigner, Stubber, ec.EllipticCurvePrivateKey],
) -> None:
    # moto ignores MessageType=DIGEST (it would hash the digest again): Stubber.
    signer, stub, private = stubbed
    message = b"x" * (RAW_MESSAGE_LIMIT + 1)
    der = private.sign(message, ec.ECDSA(hashes.SHA256()))
    stub.add_response(
        "sign",
        {"KeyId": signer.key_arn, "Signature": der, "SigningAlgorithm": "ECDSA_SHA_256"},
        {
            "KeyId": signer.key_arn,
            "Message": hashlib.sha256(message).digest(),
            "MessageType": "DIGEST",
            "SigningAlgorithm": "ECDSA_SHA_256",
        },
    )
    raw = await signer.sign(message)
    signer.public_key().verify(raw_to_der(raw), message, ec.ECDSA(hashes.SHA256()))


@pytest.mark.parametrize(
    ("code", "status", "error"),
    [
        # moto never refuses a disabled or pending-deletion key: Stubber.
        ("DisabledException", 400, KmsKeyUnusable),
        ("KMSInvalidStateException", 400, KmsKeyUnusable),
        ("AccessDeniedException", 400, KmsKeyUnusable),
        ("ThrottlingException", 400, KmsUnavailable),
        ("KMSInternalException", 500, KmsUnavailable),
        ("ValidationException", 400, KmsRequestFailed),
    ],
)
async def test_kms_refusals_become_trace_errors_without_the_aws_message(
    stubbed: tuple[KmsSigner, Stubber, ec.EllipticCurvePrivateKey],
    code: str,
    status: int,
    error: type[Exception],
) -> None:
    signer, stub, _ = stubbed
    stub.add_client_error(
        "sign", service_error_code=code, service_message="echo: sekrit", http_status_code=status
    )
    with pytest.raises(error) as caught:
        await signer.sign(b"header.payload")
    text = str(caught.value)
    assert "KMS Sign" in text and signer.key_arn in text and code in text
    assert "sekrit" not in text and caught.value.__cause__ is None


async def test_an_unreachable_endpoint_is_transient(aws_env: None) -> None:
    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = kms_client(
        REGION,
        f"http://127.0.0.1:{port}",
        config=Config(connect_timeout=1, retries={"total_max_attempts": 1}),
    )
    signer = KmsSigner(
        client,
        "arn:aws:kms:us-east-1:1:key/x",
        ec.generate_private_key(ec.SECP256R1()).public_key(),
    )
    with pytest.raises(KmsUnavailable, match="KMS Sign on key arn:aws:kms:us-east-1:1:key/x"):
        await signer.sign(b"m")


# --- key encryption ------------------------------------------------------------


def _encryption_key(client: KMSClient) -> str:
    return client.create_key(KeyUsage="ENCRYPT_DECRYPT")["KeyMetadata"]["Arn"]


CTX = "org:1/credential:warehouse"


def test_envelopes_open_only_under_their_key_and_context(kms: KMSClient) -> None:
    key = _encryption_key(kms)
    kek = KmsKeyEncryption.load(kms, key)
    sealed = kek.seal(b"db password", CTX)
    assert kek.open(sealed, CTX) == b"db password"
    assert KmsKeyEncryption.key_of(sealed) == key  # the wrapped key names its KMS key
    assert b"db password" not in sealed.ciphertext + sealed.wrapped_key
    assert (
        "db password" not in repr(sealed) and repr(kek) == f"KmsKeyEncryption(key={key!r}, keys=1)"
    )
    again = kek.seal(b"db password", CTX)
    assert again.ciphertext != sealed.ciphertext and again.wrapped_key != sealed.wrapped_key
    other = kek.seal(b"other", "org:2/credential:warehouse")
    for envelope, context in (
        (sealed, "org:2/credential:warehouse"),  # moved to another record
        (Envelope(other.wrapped_key, sealed.ciphertext), CTX),  # blob A presented as blob B
        (Envelope(sealed.wrapped_key, other.ciphertext), "org:2/credential:warehouse"),
    ):
        with pytest.raises(InvalidInput, match="envelope: does not open"):
            kek.open(envelope, context)
    with pytest.raises(InvalidInput, match="context"):
        kek.seal(b"x", "")


def test_any_byte_flip_or_truncation_fails(kms: KMSClient) -> None:
    kek = KmsKeyEncryption.load(kms, _encryption_key(kms))
    sealed = kek.seal(b"secret", CTX)
    arn_end = 3 + len(kek.key_arn)
    tampered = []
    # Every byte of the ciphertext; of the wrapped key the version, an ARN byte
    # (names a key not configured) and the KMS blob past moto's own key id
    # (moto answers AccessDenied for a blob naming another key, where KMS
    # answers InvalidCiphertext or IncorrectKey).
    moto_key_id = 36
    for i in range(len(sealed.ciphertext)):
        flipped = bytearray(sealed.ciphertext)
        flipped[i] ^= 0x01
        tampered.append(Envelope(sealed.wrapped_key, bytes(flipped)))
    blob = range(arn_end + moto_key_id, len(sealed.wrapped_key), 3)
    for i in [0, arn_end - 1, *blob, len(sealed.wrapped_key) - 1]:
        flipped = bytearray(sealed.wrapped_key)
        flipped[i] ^= 0x01
        tampered.append(Envelope(bytes(flipped), sealed.ciphertext))
    tampered += [
        Envelope(sealed.wrapped_key, sealed.ciphertext[:-1]),
        Envelope(sealed.wrapped_key, b""),
        Envelope(sealed.wrapped_key[:-1], sealed.ciphertext),
        Envelope(sealed.wrapped_key[:arn_end], sealed.ciphertext),
        Envelope(b"", sealed.ciphertext),
    ]
    for envelope in tampered:
        with pytest.raises(InvalidInput, match="envelope"):
            kek.open(envelope, CTX)


def test_rotation_old_envelopes_open_until_rewrapped_then_the_old_key_can_go(
    kms: KMSClient,
) -> None:
    old_key, new_key = _encryption_key(kms), _encryption_key(kms)
    before = KmsKeyEncryption.load(kms, old_key).seal(b"v1", CTX)
    rotated = KmsKeyEncryption.load(kms, new_key, previous_key_ids=[old_key])
    assert rotated.open(before, CTX) == b"v1"  # old blobs decrypt after rotation
    fresh = rotated.seal(b"v2", CTX)
    assert KmsKeyEncryption.key_of(fresh) == new_key  # new writes use the current key
    moved = rotated.rewrap(before, CTX)
    assert KmsKeyEncryption.key_of(moved) == new_key and moved.ciphertext == before.ciphertext
    assert rotated.rewrap(moved, CTX) is moved
    with pytest.raises(InvalidInput, match="envelope: does not open"):
        rotated.rewrap(before, "org:2/credential:warehouse")

    only_new = KmsKeyEncryption.load(kms, new_key)  # the old key dropped after the re-wrap job
    assert only_new.open(moved, CTX) == b"v1" and only_new.open(fresh, CTX) == b"v2"
    with pytest.raises(InvalidInput, match=f"sealed under KMS key {old_key}, not configured"):
        only_new.open(before, CTX)  # unknown kek id fails
    # An ARN in the header swapped for a configured key's: KMS refuses the blob.
    swapped = Envelope(moved.wrapped_key.replace(new_key.encode(), old_key.encode()), b"x" * 40)
    with pytest.raises((InvalidInput, KmsKeyUnusable)):
        rotated.open(swapped, CTX)


async def test_the_async_twins_run_off_the_event_loop(kms: KMSClient) -> None:
    kek = KmsKeyEncryption.load(kms, _encryption_key(kms))
    sealed = await kek.aseal(b"secret", CTX)
    assert await kek.aopen(sealed, CTX) == b"secret"
    assert await kek.arewrap(sealed, CTX) is sealed


def test_only_an_enabled_symmetric_key_seals(kms: KMSClient) -> None:
    signing = _signing_key(kms)
    with pytest.raises(ConfigurationError, match=f"KMS key {signing} must be a SYMMETRIC_DEFAULT"):
        KmsKeyEncryption.load(kms, signing)
    key = _encryption_key(kms)
    kms.disable_key(KeyId=key.rsplit("/", 1)[1])  # moto's DisableKey takes the bare id only
    with pytest.raises(KmsKeyUnusable, match="KeyState Disabled"):
        KmsKeyEncryption.load(kms, key, previous_key_ids=[])
    with pytest.raises(KmsKeyUnusable, match="KeyState Disabled"):
        KmsKeyEncryption.load(kms, _encryption_key(kms), previous_key_ids=[key])


@pytest.mark.parametrize(
    ("operation", "code", "error"),
    [
        # moto decrypts under a disabled or pending-deletion key: Stubber.
        ("decrypt", "DisabledException", KmsKeyUnusable),
        ("decrypt", "KMSInvalidStateException", KmsKeyUnusable),
        ("decrypt", "ThrottlingException", KmsUnavailable),
        ("decrypt", "IncorrectKeyException", InvalidInput),
        ("generate_data_key", "DisabledException", KmsKeyUnusable),
        ("generate_data_key", "ThrottlingException", KmsUnavailable),
    ],
)
def test_kms_refusals_of_key_encryption_become_trace_errors(
    aws_env: None, operation: str, code: str, error: type[Exception]
) -> None:
    client = kms_client(REGION)
    arn = "arn:aws:kms:us-east-1:123456789012:key/22222222-2222-3333-4444-555555555555"
    kek = KmsKeyEncryption(client, arn)
    envelope = Envelope(b"\x01" + len(arn).to_bytes(2, "big") + arn.encode() + b"blob", b"c" * 40)
    with Stubber(client) as stub:
        stub.add_client_error(operation, service_error_code=code, service_message="echo: sekrit")
        with pytest.raises(error) as caught:
            if operation == "decrypt":
                kek.open(envelope, CTX)
            else:
                kek.seal(b"plaintext", CTX)
        stub.assert_no_pending_responses()
    assert "sekrit" not in str(caught.value) and "plaintext" not in str(caught.value)
    if error is not InvalidInput:
        assert arn in str(caught.value) and code in str(caught.value)


async def test_a_client_without_credentials_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup
    arn = "arn:aws:kms:us-east-1:1:key/x"
    public = ec.generate_private_key(ec.SECP256R1()).public_key()
    signer = KmsSigner(kms_client(REGION), arn, public)
    with pytest.raises(ConfigurationError, match=f"KMS Sign on key {arn}: no AWS credentials"):
        await signer.sign(b"m")


def _sign_response(signer: KmsSigner, signature: bytes, key_id: str | None = None) -> Any:
    return {
        "KeyId": key_id or signer.key_arn,
        "Signature": signature,
        "SigningAlgorithm": "ECDSA_SHA_256",
    }


async def test_a_short_der_scalar_is_left_padded_to_32_bytes(
    stubbed: tuple[KmsSigner, Stubber, ec.EllipticCurvePrivateKey],
) -> None:
    # About one signature in 256 has r < 2**248: its DER integer is shorter.
    signer, stub, private = stubbed
    message = b"header.payload"
    while True:
        der = private.sign(message, ec.ECDSA(hashes.SHA256()))
        r, _ = decode_dss_signature(der)
        if r < 2**248:
            break
    stub.add_response("sign", _sign_response(signer, der))
    raw = await signer.sign(message)
    assert len(raw) == 64 and raw[0] == 0
    signer.public_key().verify(raw_to_der(raw), message, ec.ECDSA(hashes.SHA256()))


async def test_a_malformed_kms_answer_never_becomes_a_signature(
    stubbed: tuple[KmsSigner, Stubber, ec.EllipticCurvePrivateKey],
) -> None:
    signer, stub, private = stubbed
    der = private.sign(b"m", ec.ECDSA(hashes.SHA256()))
    stub.add_response("sign", _sign_response(signer, der + b"\x00"))  # trailing byte
    with pytest.raises(MalformedSignature):
        await signer.sign(b"m")
    other = "arn:aws:kms:us-east-1:123456789012:key/99999999-2222-3333-4444-555555555555"
    stub.add_response("sign", _sign_response(signer, der, key_id=other))
    with pytest.raises(KmsRequestFailed, match="UnexpectedKeyId"):
        await signer.sign(b"m")


async def test_concurrent_claims_sign_in_parallel_and_every_token_verifies(
    kms: KMSClient,
) -> None:
    clock = ManualClock()
    ring = KeyRing(clock, POLICY)
    ring.bootstrap(KmsSigner.load(kms, _signing_key(kms)))
    issuer = TokenIssuer(ring, ISS, AUD, TTL, clock)
    tokens: list[str] = []

    async def claim(attempt: int) -> None:
        tokens.append(await issuer.issue(TASK, attempt, [INPUT], OUT, SCRATCH))

    async with anyio.create_task_group() as group:
        for attempt in range(1, 21):
            group.start_soon(claim, attempt)
    verifier = _verifier(ring, clock)
    attempts = sorted([(await verifier.verify(t)).attempt for t in tokens])
    assert attempts == list(range(1, 21))


async def test_the_endpoint_url_reaches_a_moto_server_on_loopback(aws_env: None) -> None:
    # What `./dev run --aws` will do: talk HTTP to a moto server, not mock_aws.
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        client = kms_client(REGION, f"http://{host}:{port}")
        signing = client.create_key(KeyUsage="SIGN_VERIFY", KeySpec="ECC_NIST_P256")
        signer = KmsSigner.load(client, signing["KeyMetadata"]["Arn"])
        clock = ManualClock()
        ring = KeyRing(clock, POLICY)
        ring.bootstrap(signer)
        token = await TokenIssuer(ring, ISS, AUD, TTL, clock).issue(TASK, 1, [INPUT], OUT, SCRATCH)
        assert (await _verifier(ring, clock).verify(token)).attempt == 1
        kek = KmsKeyEncryption.load(client, _encryption_key(client))
        assert await kek.aopen(await kek.aseal(b"secret", CTX), CTX) == b"secret"
    finally:
        server.stop()
