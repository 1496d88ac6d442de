"""Capability tokens: issue/verify round trip, every refusal by its reason, Wycheproof.

Each negative test asserts the exact ``reason`` of :class:`InvalidCapability`
and that the error text never contains the token (``refused``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import subprocess
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import jwt
import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import (
    decode_dss_signature,
    encode_dss_signature,
)

import trace_core.security as security
from trace_core.clock import ManualClock
from trace_core.errors import ConfigurationError, InvalidInput
from trace_core.security import (
    REQUIRED_CLAIMS,
    CapabilityClaims,
    DatasetInput,
    InvalidCapability,
    JwksCache,
    KeyRing,
    MalformedSignature,
    PrivateKeySigner,
    RotationPolicy,
    TokenIssuer,
    TokenVerifier,
    check_raw_signature,
    der_to_raw,
    raw_to_der,
    sign_jws,
)
from trace_core.security.b64url import b64url_decode, b64url_encode
from trace_core.security.signing import P256_ORDER

pytestmark = pytest.mark.anyio

ISS = "trace-dispatcher"
AUD = "trace-task"
TTL = 600
LEEWAY = 30
TASK = uuid.UUID("0b5d8f3e-6c1a-4f7e-9a53-2f1c7d9e8a10")
DATASET = uuid.UUID("5f0c6a9e-1b2d-4c3e-8f4a-6b7c8d9e0f1a")
VERSION = uuid.UUID("9a8b7c6d-5e4f-4a3b-9c2d-1e0f9a8b7c6d")
INPUTS = (
    DatasetInput(
        DATASET,
        VERSION,
        f"s3://trace-data/dataset/{DATASET}/version/{VERSION}/",
        "severity = 'critical'",
    ),
)
OUT = "s3://trace-data/out/task-1/"
SCRATCH = "s3://trace-scratch/task-1/"
WYCHEPROOF = (
    Path(__file__).parent / "data" / "wycheproof" / "ecdsa_secp256r1_sha256_p1363_test.json"
)


@dataclass
class Env:
    clock: ManualClock
    signer: PrivateKeySigner
    ring: KeyRing
    issuer: TokenIssuer
    cache: JwksCache
    verifier: TokenVerifier
    jwks: dict[str, Any] = field(default_factory=dict)
    """What the JWKS endpoint serves; empty means "the ring's own document"."""

    async def issue(self, task_id: uuid.UUID = TASK, attempt: int = 1) -> str:
        return await self.issuer.issue(task_id, attempt, INPUTS, OUT, SCRATCH)

    def payload(self, **changes: Any) -> dict[str, Any]:
        """A valid payload issued now, with ``changes`` applied (``None`` deletes)."""
        payload = self.issuer.claims(TASK, 1, INPUTS, OUT, SCRATCH).to_payload()
        for name, value in changes.items():
            if value is None:
                payload.pop(name, None)
            else:
                payload[name] = value
        return payload

    def header(self, **changes: Any) -> dict[str, Any]:
        header: dict[str, Any] = {"alg": "ES256", "typ": "JWT", "kid": self.signer.kid}
        for name, value in changes.items():
            if value is None:
                header.pop(name, None)
            else:
                header[name] = value
        return header


@pytest.fixture
def env() -> Env:
    clock = ManualClock()
    signer = PrivateKeySigner.generate()
    ring = KeyRing(clock, RotationPolicy(verifier_cache_seconds=300, max_token_ttl_seconds=3600))
    ring.bootstrap(signer)
    served: dict[str, Any] = {}

    async def fetch() -> Mapping[str, Any]:
        return served or ring.jwks()

    cache = JwksCache(fetch, clock, min_refresh_interval_seconds=30, max_age_seconds=300)
    verifier = TokenVerifier(cache, ISS, AUD, clock, leeway_seconds=LEEWAY)
    return Env(
        clock, signer, ring, TokenIssuer(ring, ISS, AUD, TTL, clock), cache, verifier, served
    )


class KidSigner:
    """Signs with one key while claiming another key's kid."""

    def __init__(self, inner: PrivateKeySigner, kid: str) -> None:
        self.inner = inner
        self.kid = kid

    async def sign(self, message: bytes) -> bytes:
        return await self.inner.sign(message)

    def public_jwk(self) -> dict[str, str]:
        return {**self.inner.public_jwk(), "kid": self.kid}


def segment(value: Mapping[str, Any]) -> str:
    return b64url_encode(json.dumps(value, separators=(",", ":")).encode())


async def refused(env: Env, token: str, reason: str) -> InvalidCapability:
    with pytest.raises(InvalidCapability) as caught:
        await env.verifier.verify(token)
    error = caught.value
    assert error.reason == reason, str(error)
    text = f"{error} {error!r} {error.detail}"
    assert not token or token not in text
    for part in token.split("."):
        if len(part) >= 8:
            assert part not in text
    assert error.__cause__ is None
    assert error.__context__ is None or error.__suppress_context__
    return error


# --- the round trip -------------------------------------------------------------


async def test_round_trip(env: Env) -> None:
    token = await env.issue()
    claims = await env.verifier.verify(token)
    assert claims.task_id == TASK and claims.attempt == 1
    assert claims.sub == f"task:{TASK}:1"
    assert claims.iss == ISS and claims.aud == AUD
    assert claims.inputs == INPUTS
    assert claims.output_prefixes == (OUT,) and claims.scratch_prefix == SCRATCH
    assert claims.iat == claims.nbf == int(env.clock.now().timestamp())
    assert claims.exp == claims.iat + TTL
    assert claims.expires_at.timestamp() == claims.exp
    assert await env.verifier.verify_for_task(token, TASK, 1) == claims
    header = json.loads(b64url_decode(token.split(".")[0]))
    assert header == {"alg": "ES256", "typ": "JWT", "kid": env.signer.kid}
    assert len(b64url_decode(token.split(".")[2])) == 64
    assert env.cache.fetches == 1


async def test_each_token_has_its_own_jti(env: Env) -> None:
    first, second = await env.issue(), await env.issue()
    assert (await env.verifier.verify(first)).jti != (await env.verifier.verify(second)).jti


async def test_claims_scope_is_what_minting_grants(env: Env) -> None:
    claims = await env.verifier.verify(await env.issue())
    assert claims.scope().as_dict() == {
        "read": sorted([INPUTS[0].location, SCRATCH]),
        "write": sorted([OUT, SCRATCH]),
    }


async def test_several_outputs_and_postgres_inputs_round_trip(env: Env) -> None:
    table = DatasetInput(uuid.uuid4(), uuid.uuid4(), "postgres_table:dataset_0a1b_2c3d", None)
    second = "s3://trace-data/out/task-1-b/"
    token = await env.issuer.issue(TASK, 1, (*INPUTS, table), [OUT, second], SCRATCH)
    claims = await env.verifier.verify(token)
    assert claims.inputs == (*INPUTS, table) and claims.output_prefixes == (OUT, second)
    assert table.postgres_table == "dataset_0a1b_2c3d" and table.s3_prefix is None
    assert INPUTS[0].postgres_table is None and INPUTS[0].s3_prefix is not None
    # The table is an input for the Query Service, never an S3 grant.
    assert claims.scope().as_dict() == {
        "read": sorted([INPUTS[0].location, SCRATCH]),
        "write": sorted([OUT, second, SCRATCH]),
    }


async def test_a_task_writing_only_tables_gets_its_scratch_only(env: Env) -> None:
    claims = await env.verifier.verify(await env.issuer.issue(TASK, 1, [], [], SCRATCH))
    assert claims.output_prefixes == ()
    assert claims.scope().as_dict() == {"read": [SCRATCH], "write": [SCRATCH]}


async def test_pyjwt_accepts_our_tokens_too(env: Env) -> None:
    # Interop: the hand-assembled JWS is a standard one.
    token = await env.issue()
    payload = jwt.decode(
        token,
        key=env.signer.public_key(),
        algorithms=["ES256"],
        audience=AUD,
        issuer=ISS,
        options={"verify_exp": False, "verify_nbf": False, "verify_iat": False},
    )
    assert payload["sub"] == f"task:{TASK}:1"


# --- algorithm confusion -----------------------------------------------------------


async def test_alg_none_is_refused(env: Env) -> None:
    token = f"{segment(env.header(alg='none'))}.{segment(env.payload())}."
    await refused(env, token, "unsupported_alg")


async def test_hs256_signed_with_the_public_key_is_refused(env: Env) -> None:
    public_pem = env.signer.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    for secret in (public_pem, json.dumps(env.signer.public_jwk()).encode()):
        signing_input = f"{segment(env.header(alg='HS256'))}.{segment(env.payload())}"
        mac = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
        await refused(env, f"{signing_input}.{b64url_encode(mac)}", "unsupported_alg")


@pytest.mark.parametrize("alg", ["ES384", "ES512", "RS256", "PS256", "EdDSA", "es256", ""])
async def test_any_other_alg_is_refused(env: Env, alg: str) -> None:
    token = await sign_jws(env.signer, env.header(alg=alg), env.payload())
    await refused(env, token, "unsupported_alg")


async def test_missing_alg_is_refused(env: Env) -> None:
    token = await sign_jws(env.signer, env.header(alg=None), env.payload())
    await refused(env, token, "unsupported_alg")


@pytest.mark.parametrize("entry_alg", ["HS256", "none", "ES384", "RS256", None])
async def test_verifier_pins_es256_whatever_the_jwks_entry_says(
    env: Env, entry_alg: str | None
) -> None:
    entry: dict[str, Any] = {**env.signer.public_jwk()}
    if entry_alg is None:
        del entry["alg"]
    else:
        entry["alg"] = entry_alg
    env.jwks["keys"] = [entry]
    # A genuine ES256 token: its key is only listed under another alg, so it is unknown.
    await refused(env, await env.issue(), "unknown_kid")
    # A token following the entry's alg (HMAC over the entry's key text) is refused first.
    signing_input = f"{segment(env.header(alg=entry_alg or 'HS256'))}.{segment(env.payload())}"
    mac = hmac.new(json.dumps(entry).encode(), signing_input.encode(), hashlib.sha256).digest()
    await refused(env, f"{signing_input}.{b64url_encode(mac)}", "unsupported_alg")


# --- signatures ----------------------------------------------------------------------


async def test_der_signature_is_refused(env: Env) -> None:
    token = await env.issue()
    signing_input, _, raw = token.rpartition(".")
    der = raw_to_der(b64url_decode(raw))
    await refused(env, f"{signing_input}.{b64url_encode(der)}", "malformed_signature")


async def test_all_zero_signature_is_refused(env: Env) -> None:
    signing_input = (await env.issue()).rpartition(".")[0]
    await refused(env, f"{signing_input}.{b64url_encode(bytes(64))}", "malformed_signature")


@pytest.mark.parametrize("length", [0, 32, 63, 65, 96])
async def test_signature_of_wrong_length_is_refused(env: Env, length: int) -> None:
    signing_input = (await env.issue()).rpartition(".")[0]
    forged = b64url_encode(b"\x01" * length)
    await refused(env, f"{signing_input}.{forged}", "malformed_signature")


@pytest.mark.parametrize("bad", [0, P256_ORDER, P256_ORDER + 1, 2**256 - 1])
async def test_scalars_out_of_range_are_refused(env: Env, bad: int) -> None:
    # n + 1 is 1 mod n: a lax verifier reducing mod n would read it as 1.
    signing_input, _, raw = (await env.issue()).rpartition(".")
    sig = b64url_decode(raw)
    for forged in (sig[:32] + bad.to_bytes(32, "big"), bad.to_bytes(32, "big") + sig[32:]):
        await refused(env, f"{signing_input}.{b64url_encode(forged)}", "malformed_signature")


async def test_high_s_twin_verifies_and_keeps_the_jti(env: Env) -> None:
    # ES256 (RFC 7518) does not require low-S: (r, n - s) is valid too. Such a
    # twin carries the same claims, so anything keyed on jti is unaffected.
    token = await env.issue()
    signing_input, _, raw = token.rpartition(".")
    sig = b64url_decode(raw)
    s = int.from_bytes(sig[32:], "big")
    twin = f"{signing_input}.{b64url_encode(sig[:32] + (P256_ORDER - s).to_bytes(32, 'big'))}"
    assert (await env.verifier.verify(twin)).jti == (await env.verifier.verify(token)).jti


async def test_another_key_reusing_the_kid_is_refused(env: Env) -> None:
    impostor = KidSigner(PrivateKeySigner.generate(), env.signer.kid)
    token = await sign_jws(impostor, env.header(), env.payload())
    await refused(env, token, "bad_signature")


async def test_tampered_payload_is_refused(env: Env) -> None:
    header, _, signature = (await env.issue()).split(".")
    widened = env.payload(output_prefixes=["s3://trace-data/"])
    await refused(env, f"{header}.{segment(widened)}.{signature}", "bad_signature")


async def test_tampered_header_is_refused(env: Env) -> None:
    _, payload, signature = (await env.issue()).split(".")
    header = segment({"kid": env.signer.kid, "typ": "JWT", "alg": "ES256"})  # reordered
    await refused(env, f"{header}.{payload}.{signature}", "bad_signature")


# --- a token presented again (the verified-token memory) ----------------------------------


async def test_a_token_presented_again_is_answered_from_its_verified_claims(env: Env) -> None:
    token = await env.issue()
    first = await env.verifier.verify(token)
    assert await env.verifier.verify(token) is first


async def test_a_token_one_character_off_a_verified_one_is_verified_in_full(env: Env) -> None:
    token = await env.issue()
    await env.verifier.verify(token)
    header, payload, signature = token.split(".")
    flipped = ("A" if signature[0] != "A" else "B") + signature[1:]
    await refused(env, f"{header}.{payload}.{flipped}", "bad_signature")
    widened = env.payload(output_prefixes=["s3://trace-data/"])
    await refused(env, f"{header}.{segment(widened)}.{signature}", "bad_signature")


async def test_a_verified_token_still_expires(env: Env) -> None:
    token = await env.issue()
    await env.verifier.verify(token)
    env.clock.advance(TTL + LEEWAY)
    await refused(env, token, "expired")


async def test_a_verified_token_is_refused_once_its_key_leaves_the_jwks(env: Env) -> None:
    token = await env.issue()
    await env.verifier.verify(token)
    other = PrivateKeySigner.generate()
    env.jwks.update({"keys": [other.public_jwk()]})
    env.clock.advance(301)  # past the cache's max age: the JWKS is fetched again
    await refused(env, token, "unknown_kid")


# --- keys ------------------------------------------------------------------------------


async def test_unknown_kid_is_refused(env: Env) -> None:
    stranger = PrivateKeySigner.generate()
    token = await sign_jws(stranger, env.header(kid=stranger.kid), env.payload())
    await refused(env, token, "unknown_kid")


async def test_a_flood_of_unknown_kids_costs_one_fetch_per_interval(env: Env) -> None:
    await env.verifier.verify(await env.issue())
    assert env.cache.fetches == 1
    env.clock.advance(31)
    stranger = PrivateKeySigner.generate()
    tokens = [
        await sign_jws(stranger, env.header(kid=f"made-up-{i}"), env.payload()) for i in range(200)
    ]
    for token in tokens[:100]:
        await refused(env, token, "unknown_kid")
    assert env.cache.fetches == 2

    async def one(token: str) -> None:
        await refused(env, token, "unknown_kid")

    env.clock.advance(31)
    async with anyio.create_task_group() as group:
        for token in tokens[100:]:
            group.start_soon(one, token)
    assert env.cache.fetches == 3
    # The genuine token still verifies, without another fetch.
    await env.verifier.verify(await env.issue())
    assert env.cache.fetches == 3


async def test_jwks_outage_is_its_own_reason(env: Env) -> None:
    async def down() -> Mapping[str, Any]:
        raise OSError("connection refused")

    verifier = TokenVerifier(JwksCache(down, env.clock), ISS, AUD, env.clock)
    with pytest.raises(InvalidCapability) as caught:
        await verifier.verify(await env.issue())
    assert caught.value.reason == "jwks_unavailable"


# --- headers ----------------------------------------------------------------------------


async def test_unknown_crit_header_is_refused(env: Env) -> None:
    token = await sign_jws(env.signer, env.header(crit=["exp"], exp=1), env.payload())
    await refused(env, token, "unknown_crit")
    # Even b64, the one extension PyJWT knows: we implement none.
    token = await sign_jws(env.signer, env.header(crit=["b64"], b64=True), env.payload())
    await refused(env, token, "unknown_crit")


@pytest.mark.parametrize(
    "changes",
    [
        {"typ": None},
        {"typ": "at+jwt"},
        {"kid": None},
        {"kid": ""},
        {"kid": 7},
        {"jwk": {"kty": "EC"}},
        {"jku": "https://attacker.example/jwks"},
        {"x5u": "https://attacker.example/cert"},
        {"b64": False},
    ],
)
async def test_unsafe_headers_are_refused(env: Env, changes: dict[str, Any]) -> None:
    token = await sign_jws(env.signer, env.header(**changes), env.payload())
    await refused(env, token, "bad_header")


# --- shape ------------------------------------------------------------------------------


async def test_oversized_token_is_refused_before_parsing(env: Env) -> None:
    token = await sign_jws(env.signer, env.header(), env.payload(padding="x" * 9000))
    await refused(env, token, "oversized")
    await refused(env, "é" * 9000, "oversized")
    assert env.cache.fetches == 0


@pytest.mark.parametrize(
    "mangle",
    [
        lambda t: t.rpartition(".")[0],  # two segments
        lambda t: t + ".",  # four segments
        lambda t: t.replace(".", "=.", 1),  # padding
        lambda t: "!" + t,  # outside the alphabet
        lambda t: t.replace(".", " .", 1),
        lambda t: "é" + t,
        lambda t: "",
    ],
)
async def test_malformed_tokens_are_refused(env: Env, mangle: Any) -> None:
    await refused(env, mangle(await env.issue()), "malformed")


async def test_non_canonical_base64_is_refused(env: Env) -> None:
    head, payload, signature = (await env.issue()).split(".")
    # 64 bytes take 86 characters: the last one has 2 unused low bits. Setting
    # one gives a second spelling of the same bytes, which must not pass.
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    twin = signature[:-1] + alphabet[alphabet.index(signature[-1]) ^ 1]
    assert base64.urlsafe_b64decode(twin + "==") == base64.urlsafe_b64decode(signature + "==")
    await refused(env, f"{head}.{payload}.{twin}", "malformed")


async def test_duplicate_members_are_refused(env: Env) -> None:
    signing_header = b64url_encode(b'{"alg":"ES256","typ":"JWT","kid":"a","kid":"b"}')
    await refused(env, f"{signing_header}.{segment(env.payload())}.{'A' * 86}", "malformed")
    body = json.dumps(env.payload())[:-1] + f',"aud":"{AUD}"}}'
    signing_input = f"{segment(env.header())}.{b64url_encode(body.encode())}"
    signature = await env.signer.sign(signing_input.encode())
    await refused(env, f"{signing_input}.{b64url_encode(signature)}", "malformed")


async def test_non_object_and_nan_payloads_are_refused(env: Env) -> None:
    for body in (b"[1,2]", b'{"exp": NaN}', b"not json", b"\xff\xfe"):
        signing_input = f"{segment(env.header())}.{b64url_encode(body)}"
        signature = await env.signer.sign(signing_input.encode())
        await refused(env, f"{signing_input}.{b64url_encode(signature)}", "malformed")


# --- claims -----------------------------------------------------------------------------


@pytest.mark.parametrize("claim", REQUIRED_CLAIMS)
async def test_each_required_claim_is_required(env: Env, claim: str) -> None:
    payload = env.payload()
    del payload[claim]
    error = await refused(env, await sign_jws(env.signer, env.header(), payload), "missing_claim")
    assert claim in str(error)
    payload[claim] = None
    await refused(env, await sign_jws(env.signer, env.header(), payload), "missing_claim")


async def test_expired_token_is_refused_after_leeway(env: Env) -> None:
    token = await env.issue()
    env.clock.advance(TTL + LEEWAY - 1)
    await env.verifier.verify(token)
    env.clock.advance(1)
    await refused(env, token, "expired")


async def test_nbf_and_iat_in_the_future_are_refused(env: Env) -> None:
    now = int(env.clock.now().timestamp())
    future = env.payload(nbf=now + LEEWAY + 1)
    await refused(env, await sign_jws(env.signer, env.header(), future), "not_yet_valid")
    within = env.payload(nbf=now + LEEWAY)
    await env.verifier.verify(await sign_jws(env.signer, env.header(), within))
    early = env.payload(iat=now + LEEWAY + 1)
    await refused(env, await sign_jws(env.signer, env.header(), early), "not_yet_valid")


@pytest.mark.parametrize("value", ["1900000000", 1.9e9, True])
async def test_times_must_be_integers(env: Env, value: Any) -> None:
    token = await sign_jws(env.signer, env.header(), env.payload(exp=value))
    await refused(env, token, "invalid_claim")


async def test_wrong_audience_is_refused(env: Env) -> None:
    for aud in ("trace-query", [AUD, "trace-query"], [AUD]):
        token = await sign_jws(env.signer, env.header(), env.payload(aud=aud))
        await refused(env, token, "wrong_audience")


async def test_wrong_issuer_is_refused(env: Env) -> None:
    for iss in ("someone-else", 7):
        token = await sign_jws(env.signer, env.header(), env.payload(iss=iss))
        await refused(env, token, "wrong_issuer")


def test_a_verifier_needs_an_audience_and_an_issuer(env: Env) -> None:
    for audience in ("", None):
        with pytest.raises(ConfigurationError, match="audience"):
            TokenVerifier(env.cache, ISS, audience, env.clock)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="issuer"):
        TokenVerifier(env.cache, "", AUD, env.clock)
    with pytest.raises(ConfigurationError, match="leeway"):
        TokenVerifier(env.cache, ISS, AUD, env.clock, leeway_seconds=61)


async def test_another_tasks_token_is_refused(env: Env) -> None:
    other = await env.issue(uuid.uuid4(), 1)
    with pytest.raises(InvalidCapability) as caught:
        await env.verifier.verify_for_task(other, TASK, 1)
    assert caught.value.reason == "wrong_task"
    retry = await env.issue(TASK, 2)
    with pytest.raises(InvalidCapability) as caught:
        await env.verifier.verify_for_task(retry, TASK, 1)
    assert caught.value.reason == "wrong_task"
    assert (await env.verifier.verify_for_task(retry, TASK, 2)).attempt == 2


async def test_sub_must_name_the_task_attempt(env: Env) -> None:
    for sub in (f"task:{TASK}:2", f"task:{uuid.uuid4()}:1", "task"):
        token = await sign_jws(env.signer, env.header(), env.payload(sub=sub))
        await refused(env, token, "wrong_subject")


@pytest.mark.parametrize(
    "changes",
    [
        {"task_id": TASK.hex},  # not the canonical spelling
        {"task_id": str(TASK).upper()},
        {"attempt": 0},
        {"attempt": "1"},
        {"jti": 5},
        {"sub": 5},
        {"inputs": {}},
        {"output_prefixes": ["s3://trace-data/out/../other/"]},
        {"output_prefixes": ["s3://trace-data/out/*"]},
        {"output_prefixes": ["s3://trace-data/out"]},  # canonical form has the '/'
        {"output_prefixes": "s3://trace-data/out/"},  # a list, not a string
        {"output_prefixes": None},
        {"output_prefixes": [OUT, OUT]},  # one prefix per output, no repeats
        {"output_prefixes": ["postgres_table:dataset_out"]},  # tables are never S3 grants
        {"scratch_prefix": None},
        {"inputs": [{**INPUTS[0].to_json(), "location": "postgres_table:Dataset_out"}]},
        {"inputs": [{**INPUTS[0].to_json(), "location": "postgres_table:"}]},
        {"inputs": [{**INPUTS[0].to_json(), "location": "postgres_table:a;drop table x"}]},
        {"inputs": [{**INPUTS[0].to_json(), "location": "postgres_table:public.t"}]},
        {"inputs": [{**INPUTS[0].to_json(), "location": "postgres_table:" + "a" * 64}]},
        {"inputs": [{**INPUTS[0].to_json(), "location": "postgres:trace-data/out/"}]},
        {"inputs": [{"dataset_uuid": str(DATASET)}]},
        {
            "inputs": [
                {**INPUTS[0].to_json(), "location": "s3://trace-data/"},
            ]
        },
        {"inputs": [{**INPUTS[0].to_json(), "extra": "grant"}]},
        {"inputs": [{**INPUTS[0].to_json(), "where": 1}]},
    ],
)
async def test_trace_claims_are_parsed_strictly(env: Env, changes: dict[str, Any]) -> None:
    token = await sign_jws(env.signer, env.header(), env.payload(**changes))
    error = await refused(env, token, "invalid_claim")
    assert "trace-data/out" not in str(error)


# --- issuing ----------------------------------------------------------------------------


async def test_issuer_refuses_non_canonical_scopes(env: Env) -> None:
    with pytest.raises(InvalidInput):
        await env.issuer.issue(TASK, 1, INPUTS, "s3://trace-data/out", SCRATCH)
    with pytest.raises(InvalidInput):
        await env.issuer.issue(TASK, 0, INPUTS, OUT, SCRATCH)
    with pytest.raises(InvalidInput):
        DatasetInput(DATASET, VERSION, "s3://trace-data/a/../b/")
    with pytest.raises(InvalidInput, match="table-name"):
        DatasetInput(DATASET, VERSION, "postgres_table:Bad-Name")
    with pytest.raises(InvalidInput, match="duplicate"):
        await env.issuer.issue(TASK, 1, INPUTS, [OUT, OUT], SCRATCH)
    with pytest.raises(InvalidInput, match="output_prefixes"):
        await env.issuer.issue(TASK, 1, INPUTS, ["postgres_table:dataset_out"], SCRATCH)


async def test_issuer_refuses_a_token_verifiers_would_call_oversized(env: Env) -> None:
    many = [DatasetInput(uuid.uuid4(), uuid.uuid4(), f"s3://trace-data/d/{i}/") for i in range(80)]
    with pytest.raises(InvalidInput, match="8192"):
        await env.issuer.issue(TASK, 1, many, OUT, SCRATCH)


async def test_issuer_refuses_a_signer_that_returns_der(env: Env) -> None:
    class DerSigner(KidSigner):
        async def sign(self, message: bytes) -> bytes:
            return raw_to_der(await self.inner.sign(message))

    issuer = TokenIssuer(DerSigner(env.signer, env.signer.kid), ISS, AUD, TTL, env.clock)
    with pytest.raises(MalformedSignature, match="bad signature"):
        await issuer.issue(TASK, 1, INPUTS, OUT, SCRATCH)


def test_issuer_ttl_must_fit_the_key_ring(env: Env) -> None:
    with pytest.raises(ConfigurationError, match="max_token_ttl_seconds"):
        TokenIssuer(env.ring, ISS, AUD, 3601, env.clock)
    for ttl in (0, -1, 1.5):
        with pytest.raises(ConfigurationError):
            TokenIssuer(env.ring, ISS, AUD, ttl, env.clock)  # type: ignore[arg-type]


def test_claims_validate_on_construction(env: Env) -> None:
    claims = env.issuer.claims(TASK, 1, INPUTS, OUT, SCRATCH)
    with pytest.raises(InvalidInput, match="sub"):
        CapabilityClaims(**{**claims.__dict__, "sub": f"task:{TASK}:2"})
    with pytest.raises(InvalidInput, match="exp"):
        CapabilityClaims(**{**claims.__dict__, "exp": claims.iat - 1})


# --- signature encodings ----------------------------------------------------------------


def test_der_and_raw_convert_both_ways() -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    der = key.sign(b"message", ec.ECDSA(hashes.SHA256()))
    raw = der_to_raw(der)
    assert len(raw) == 64
    assert raw_to_der(raw) == der
    small = encode_dss_signature(1, 1)  # short integers are left-padded
    assert der_to_raw(small) == (1).to_bytes(32, "big") * 2


@pytest.mark.parametrize(
    ("r", "s"),
    [(0, 1), (1, 0), (0, 0), (P256_ORDER, 1), (1, P256_ORDER), (2**256 - 1, 1)],
)
def test_scalars_outside_1_to_n_minus_1_are_malformed(r: int, s: int) -> None:
    raw = r.to_bytes(32, "big") + s.to_bytes(32, "big")
    with pytest.raises(MalformedSignature):
        check_raw_signature(raw)
    with pytest.raises(MalformedSignature):
        raw_to_der(raw)
    with pytest.raises(MalformedSignature):
        der_to_raw(encode_dss_signature(r, s))


@pytest.mark.parametrize(
    "der",
    [
        encode_dss_signature(5, 7) + b"\x00",  # trailing data
        bytes.fromhex("300602020005020107"),  # non-minimal integer
        bytes.fromhex("30060201050201f9"),  # negative integer
        bytes.fromhex("3007020105020207"),  # truncated
        b"",
        bytes(64),  # raw where DER belongs
    ],
)
def test_der_parsing_is_strict(der: bytes) -> None:
    with pytest.raises(MalformedSignature):
        der_to_raw(der)


@pytest.mark.parametrize("length", [0, 63, 65, 70])
def test_raw_must_be_64_bytes(length: int) -> None:
    with pytest.raises(MalformedSignature, match="64"):
        check_raw_signature(b"\x01" * length)


def test_b64url_is_strict() -> None:
    assert b64url_decode("AQID") == b"\x01\x02\x03"
    for text in ("AQID=", "AQ==", "A", "AQ+/", "AQ I", "AR"):
        with pytest.raises(ValueError):
            b64url_decode(text)


# --- Wycheproof -------------------------------------------------------------------------


def _wycheproof_cases() -> list[tuple[int, str, ec.EllipticCurvePublicKey, bytes, bytes, bool]]:
    document = json.loads(WYCHEPROOF.read_text())
    cases = []
    for group in document["testGroups"]:
        key = serialization.load_der_public_key(bytes.fromhex(group["publicKeyDer"]))
        assert isinstance(key, ec.EllipticCurvePublicKey)
        for test in group["tests"]:
            assert test["result"] in ("valid", "invalid")  # no "acceptable" in this file
            cases.append(
                (
                    test["tcId"],
                    test["comment"],
                    key,
                    bytes.fromhex(test["msg"]),
                    bytes.fromhex(test["sig"]),
                    test["result"] == "valid",
                )
            )
    return cases


def test_wycheproof_p1363_vectors() -> None:
    """Every vector through the verifier's signature path: our shape check, then
    the ES256 algorithm object PyJWT's ``decode(algorithms=["ES256"])`` uses."""
    es256 = jwt.PyJWS().get_algorithm_by_name("ES256")
    cases = _wycheproof_cases()
    assert len(cases) == 262
    wrong, by_shape, by_math = [], 0, 0
    for tc_id, comment, key, msg, sig, valid in cases:
        try:
            check_raw_signature(sig)
        except MalformedSignature:
            accepted = False
            by_shape += 1
        else:
            accepted = es256.verify(msg, key, sig)
            by_math += not accepted
        if accepted != valid:
            wrong.append((tc_id, comment))
    assert wrong == []
    # Both layers are exercised: sizes and ranges by the shape check, the rest
    # (modified r/s in range, wrong points) by the arithmetic.
    assert by_shape == 71 and by_math == 18


def test_wycheproof_valid_vectors_survive_der_round_trip() -> None:
    for _, _, key, msg, sig, valid in _wycheproof_cases():
        if valid:
            der = raw_to_der(sig)
            key.verify(der, msg, ec.ECDSA(hashes.SHA256()))
            assert der_to_raw(der) == sig
            assert decode_dss_signature(der) == (
                int.from_bytes(sig[:32], "big"),
                int.from_bytes(sig[32:], "big"),
            )


def test_vendored_wycheproof_file_is_the_upstream_one() -> None:
    digest = hashlib.sha256(WYCHEPROOF.read_bytes()).hexdigest()
    assert digest == "c60de693930e386c3a5472d08081623ef8504decc54b38ac01ec6b2a2575c986"


# --- public API -------------------------------------------------------------------------


def test_public_api_is_what_we_export() -> None:
    assert set(security.__all__) == {
        "CAPABILITY_FAILURES",
        "DEFAULT_MAX_TOKEN_BYTES",
        "REQUIRED_CLAIMS",
        "CapabilityClaims",
        "CapabilityFailure",
        "DatasetInput",
        "InvalidCapability",
        "JwksCache",
        "JwksFetch",
        "JwksUnavailable",
        "KeyRing",
        "KeySchedule",
        "KeyState",
        "MalformedSignature",
        "PrivateKeySigner",
        "PublicKeySource",
        "RotationPolicy",
        "Signer",
        "TokenIssuer",
        "TokenVerifier",
        "check_raw_signature",
        "der_to_raw",
        "ec_public_jwk",
        "jwk_thumbprint",
        "parse_jwks",
        "public_key_from_jwk",
        "raw_to_der",
        "sign_jws",
        "task_subject",
        "InvalidScope",
        "S3Prefix",
        "Scope",
        "parse_object_uri",
        "session_policy",
        "packed_policy",
        "PolicyTooLarge",
        "PolicyEvaluator",
        "UnsupportedPolicy",
        "validate_duration_seconds",
        "MAX_PACKED_POLICY_CHARS",
        "MIN_DURATION_SECONDS",
        "MAX_DURATION_SECONDS",
        "CredentialMinter",
        "MintedCredentials",
        "LocalCredentialMinter",
        "validate_session_name",
    }
    assert len(set(security.__all__)) == len(security.__all__)
    for name in security.__all__:
        assert hasattr(security, name), name
    assert set(security.CAPABILITY_FAILURES) >= {
        "expired",
        "bad_signature",
        "unknown_kid",
        "wrong_audience",
    }


def test_core_import_does_not_load_crypto() -> None:
    code = (
        "import sys, trace_core; "
        "print([m for m in ('jwt', 'cryptography', 'trace_core.security') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_reasons_cover_every_reason_the_code_raises() -> None:
    source = "\n".join(
        (Path(security.__file__).parent / name).read_text()
        for name in ("verifier.py", "jws_verifier.py", "claims.py")
    )
    raised = set(re.findall(r'InvalidCapability\(\s*"([a-z_]+)"', source))
    assert len(raised) >= 15
    assert raised <= security.CAPABILITY_FAILURES
