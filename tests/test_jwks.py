"""Keys: JWK thumbprints, the key ring's rotation timeline, the verifier's JWKS
cache, and the lite profile's PEM key directory. Time is a ManualClock."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import uuid
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from trace_core.clock import ManualClock
from trace_core.errors import ConfigurationError, NotFound
from trace_core.security import (
    DatasetInput,
    InvalidCapability,
    JwksCache,
    JwksUnavailable,
    KeyRing,
    KeySchedule,
    KeyState,
    PrivateKeySigner,
    RotationPolicy,
    TokenIssuer,
    TokenVerifier,
    ec_public_jwk,
    jwk_thumbprint,
    parse_jwks,
    public_key_from_jwk,
)
from trace_core.security.b64url import b64url_encode
from trace_lite.keys import STATE_FILE, KeyFileError, LocalKeyStore

pytestmark = pytest.mark.anyio

CACHE = 300
TTL = 3600
POLICY_LEEWAY = 60
POLICY = RotationPolicy(
    verifier_cache_seconds=CACHE, max_token_ttl_seconds=TTL, leeway_seconds=POLICY_LEEWAY
)
RETENTION = TTL + POLICY_LEEWAY + CACHE
ISS, AUD = "trace-dispatcher", "trace-task"
TASK = uuid.UUID("0b5d8f3e-6c1a-4f7e-9a53-2f1c7d9e8a10")
INPUT = DatasetInput(uuid.uuid4(), uuid.uuid4(), "s3://trace-data/in/")
OUT, SCRATCH = "s3://trace-data/out/", "s3://trace-scratch/t/"


class Endpoint:
    """A JWKS endpoint that counts requests; serves ``document`` or fails."""

    def __init__(self, document: Mapping[str, Any] | None = None) -> None:
        self.document: Any = document if document is not None else {"keys": []}
        self.requests = 0
        self.down = False

    async def __call__(self) -> Mapping[str, Any]:
        self.requests += 1
        if self.down:
            raise OSError("connection refused")
        return self.document() if callable(self.document) else self.document


# --- JWK --------------------------------------------------------------------------------


def test_thumbprint_is_rfc7638() -> None:
    # The key whose public point is the P-256 generator G (d = 1).
    key = ec.derive_private_key(1, ec.SECP256R1()).public_key()
    gx = bytes.fromhex("6B17D1F2E12C4247F8BCE6E563A440F277037D812DEB33A0F4A13945D898C296")
    gy = bytes.fromhex("4FE342E2FE1A7F9B8EE7EB4A7C0F9E162BCE33576B315ECECBB6406837BF51F5")
    canonical = f'{{"crv":"P-256","kty":"EC","x":"{b64url_encode(gx)}","y":"{b64url_encode(gy)}"}}'
    expected = b64url_encode(hashlib.sha256(canonical.encode()).digest())
    assert jwk_thumbprint(key) == expected
    assert len(expected) == 43
    assert ec_public_jwk(key) == {
        "kty": "EC",
        "crv": "P-256",
        "x": b64url_encode(gx),
        "y": b64url_encode(gy),
        "kid": expected,
        "use": "sig",
        "alg": "ES256",
    }


def test_jwk_round_trip_and_other_curves() -> None:
    signer = PrivateKeySigner.generate()
    key = public_key_from_jwk(signer.public_jwk())
    assert key.public_numbers() == signer.public_key().public_numbers()
    assert signer.kid == jwk_thumbprint(key)
    with pytest.raises(ValueError, match="P-256"):
        ec_public_jwk(ec.generate_private_key(ec.SECP384R1()).public_key())
    with pytest.raises(ValueError, match="P-256"):
        PrivateKeySigner(ec.generate_private_key(ec.SECP384R1()))


GOOD = PrivateKeySigner.generate().public_jwk()


def _off_curve(jwk: dict[str, str]) -> dict[str, str]:
    y = int.from_bytes(public_key_from_jwk(jwk).public_numbers().y.to_bytes(32, "big"), "big")
    return {**jwk, "y": b64url_encode(((y + 1) % 2**256).to_bytes(32, "big"))}


@pytest.mark.parametrize(
    "entry",
    [
        {**GOOD, "kty": "RSA"},
        {**GOOD, "kty": "oct", "k": "c2VjcmV0"},
        {**GOOD, "crv": "P-384"},
        {**GOOD, "crv": "secp256k1"},
        {**GOOD, "use": "enc"},
        {k: v for k, v in GOOD.items() if k != "use"},
        {**GOOD, "alg": "ES384"},
        {**GOOD, "alg": "HS256"},
        {**GOOD, "alg": "none"},
        {k: v for k, v in GOOD.items() if k != "alg"},
        {k: v for k, v in GOOD.items() if k != "kid"},
        {**GOOD, "kid": ""},
        {**GOOD, "kid": 5},
        {**GOOD, "d": "AAAA"},
        {**GOOD, "x": GOOD["x"][:-2]},
        {**GOOD, "x": GOOD["x"] + "="},
        {**GOOD, "x": 12},
        _off_curve(GOOD),
        "not an object",
    ],
)
def test_jwks_entries_that_are_not_es256_p256_sig_are_ignored(entry: Any) -> None:
    other = PrivateKeySigner.generate().public_jwk()
    keys = parse_jwks({"keys": [entry, other]})
    assert set(keys) == {other["kid"]}


def test_a_kid_listed_twice_is_dropped() -> None:
    first, second = PrivateKeySigner.generate().public_jwk(), PrivateKeySigner.generate()
    impostor = {**second.public_jwk(), "kid": first["kid"]}
    assert parse_jwks({"keys": [first, impostor, first]}) == {}


@pytest.mark.parametrize("document", [[], {"keys": {}}, {"kids": []}, "x", None])
def test_malformed_jwks_documents_are_errors(document: Any) -> None:
    with pytest.raises(ValueError):
        parse_jwks(document)


# --- the key ring ---------------------------------------------------------------------


def test_bootstrap_key_signs_at_once() -> None:
    clock = ManualClock()
    ring = KeyRing(clock, POLICY)
    with pytest.raises(ConfigurationError, match="bootstrap"):
        ring.rotate(PrivateKeySigner.generate())
    with pytest.raises(ConfigurationError, match="no active"):
        ring.active_signer()
    signer = PrivateKeySigner.generate()
    schedule = ring.bootstrap(signer)
    assert schedule.bootstrap and schedule.activated_at == schedule.published_at == clock.now()
    assert ring.active_signer() is signer
    assert ring.jwks() == {"keys": [signer.public_jwk()]}
    with pytest.raises(ConfigurationError, match="empty ring"):
        ring.bootstrap(PrivateKeySigner.generate())
    with pytest.raises(NotFound):
        ring.state("nope")


async def test_rotation_timeline() -> None:
    clock = ManualClock()
    ring = KeyRing(clock, POLICY)
    old, new = PrivateKeySigner.generate(), PrivateKeySigner.generate()
    ring.bootstrap(old)
    clock.advance(100)
    rotated_at = clock.now()
    schedule = ring.rotate(new)
    switch = rotated_at + timedelta(seconds=CACHE)
    assert schedule == KeySchedule(new.kid, published_at=rotated_at, activated_at=switch)

    def listed() -> list[str]:
        return [jwk["kid"] for jwk in ring.jwks()["keys"]]

    # Published: in the JWKS, not signing.
    assert (ring.state(old.kid), ring.state(new.kid)) == (KeyState.ACTIVE, KeyState.PUBLISHED)
    assert listed() == [old.kid, new.kid]
    assert ring.active_signer() is old
    with pytest.raises(ConfigurationError, match="pending"):
        ring.rotate(PrivateKeySigner.generate())
    clock.advance(CACHE - 1)
    assert ring.active_signer() is old
    # The switch: the new key signs, the old one retires but stays listed.
    clock.advance(1)
    assert ring.active_signer() is new
    assert (ring.state(old.kid), ring.state(new.kid)) == (KeyState.RETIRING, KeyState.ACTIVE)
    assert listed() == [old.kid, new.kid]
    clock.advance(RETENTION - 1)
    assert ring.state(old.kid) is KeyState.RETIRING
    assert await ring.public_key(old.kid) is not None
    assert ring.prune() == []
    clock.advance(1)
    assert ring.state(old.kid) is KeyState.REMOVED
    assert listed() == [new.kid]
    assert await ring.public_key(old.kid) is None
    assert ring.prune() == [old.kid]
    assert [s.kid for s in ring.schedules()] == [new.kid]
    # The next rotation is allowed once the previous one completed.
    ring.rotate(PrivateKeySigner.generate())


def test_a_new_key_never_signs_before_its_publish_lead() -> None:
    clock = ManualClock()
    ring = KeyRing(clock, POLICY)
    signers = [PrivateKeySigner.generate()]
    ring.bootstrap(signers[0])
    published: dict[str, Any] = {signers[0].kid: clock.now()}
    for step in range(2000):
        clock.advance(7)
        if step % 150 == 0:
            try:
                signer = PrivateKeySigner.generate()
                ring.rotate(signer)
            except ConfigurationError:
                pass  # a rotation is still pending
            else:
                signers.append(signer)
                published[signer.kid] = clock.now()
        active = [s.kid for s in signers if ring.state(s.kid) is KeyState.ACTIVE]
        assert len(active) == 1  # exactly one signer at every instant
        kid = ring.active_signer().kid
        assert kid == active[0]
        assert kid in {jwk["kid"] for jwk in ring.jwks()["keys"]}
        if kid != signers[0].kid:
            assert clock.now() - published[kid] >= timedelta(seconds=CACHE)
    assert len(signers) > 5


def test_restore_checks_the_whole_ring() -> None:
    clock = ManualClock()
    now = clock.now()
    a, b = PrivateKeySigner.generate(), PrivateKeySigner.generate()
    good_a = KeySchedule(a.kid, now, now, now + timedelta(seconds=CACHE), bootstrap=True)
    good_b = KeySchedule(b.kid, now, now + timedelta(seconds=CACHE))
    bad = [
        # b signs before it was published for the cache lifetime
        [(a, good_a), (b, KeySchedule(b.kid, now, now + timedelta(seconds=CACHE - 1)))],
        # both active at once
        [(a, KeySchedule(a.kid, now, now, bootstrap=True)), (b, good_b)],
        # two bootstrap keys
        [(a, good_a), (b, KeySchedule(b.kid, now, now + timedelta(seconds=CACHE), None, True))],
        # retired before activated
        [(a, KeySchedule(a.kid, now, None, now))],
        # schedule of another key
        [(a, KeySchedule(b.kid, now, now, bootstrap=True))],
        # naive timestamps
        [(a, KeySchedule(a.kid, now.replace(tzinfo=None), bootstrap=True))],
    ]
    ring = KeyRing(clock, POLICY)
    for keys in bad:
        with pytest.raises(ConfigurationError):
            ring.restore(keys)
        assert ring.schedules() == []
    ring.restore([(a, good_a), (b, good_b)])
    assert ring.active_signer() is a
    clock.advance(CACHE)
    assert ring.active_signer() is b


async def test_an_old_tokens_key_stays_until_the_token_expired() -> None:
    clock = ManualClock()
    ring = KeyRing(clock, POLICY)
    old, new = PrivateKeySigner.generate(), PrivateKeySigner.generate()
    ring.bootstrap(old)
    endpoint = Endpoint(ring.jwks)
    # A verifier caching as long as the policy assumes, refreshing on a kid
    # miss no more than once per cache lifetime: only the publish lead can
    # make the new key known in time.
    cache = JwksCache(endpoint, clock, min_refresh_interval_seconds=CACHE, max_age_seconds=CACHE)
    verifier = TokenVerifier(cache, ISS, AUD, clock, leeway_seconds=30)
    issuer = TokenIssuer(ring, ISS, AUD, TTL, clock)

    async def issue() -> str:
        return await issuer.issue(TASK, 1, [INPUT], OUT, SCRATCH)

    await verifier.verify(await issue())  # the verifier caches {old}
    clock.advance(100)
    ring.rotate(new)
    clock.advance(CACHE - 1)
    last_old = await issue()  # the last token the old key signs
    assert (await verifier.verify(last_old)).iat == int(clock.now().timestamp())
    clock.advance(1)
    first_new = await issue()
    assert json.loads(_header(first_new))["kid"] == new.kid
    await verifier.verify(first_new)
    # The old key's last token verifies right up to its expiry (+ verifier leeway).
    clock.advance(TTL + 30 - 2)
    await verifier.verify(last_old)
    clock.advance(1)
    with pytest.raises(InvalidCapability) as caught:
        await verifier.verify(last_old)
    assert caught.value.reason == "expired"
    # ...and its key leaves the JWKS only after expiry + leeway + cache lifetime.
    assert ring.state(old.kid) is KeyState.RETIRING
    clock.advance(RETENTION - TTL - 30 + 1)
    assert ring.state(old.kid) is KeyState.REMOVED
    assert endpoint.requests <= 2 + (TTL + RETENTION) // CACHE


async def test_a_key_ring_is_a_key_source_in_process() -> None:
    clock = ManualClock()
    ring = KeyRing(clock, POLICY)
    ring.bootstrap(PrivateKeySigner.generate())
    token = await TokenIssuer(ring, ISS, AUD, 60, clock).issue(TASK, 3, [INPUT], OUT, SCRATCH)
    assert (await TokenVerifier(ring, ISS, AUD, clock).verify(token)).attempt == 3


def test_rotation_policy_is_validated() -> None:
    for bad in (
        {"verifier_cache_seconds": 0},
        {"max_token_ttl_seconds": -1},
        {"leeway_seconds": 61},
        {"leeway_seconds": -1},
    ):
        with pytest.raises(ConfigurationError):
            RotationPolicy(**bad)
    assert POLICY.retention == timedelta(seconds=RETENTION)


def _header(token: str) -> bytes:
    from trace_core.security.b64url import b64url_decode

    return b64url_decode(token.split(".")[0])


# --- the JWKS cache -------------------------------------------------------------------


async def test_cache_fetches_once_until_max_age() -> None:
    clock = ManualClock()
    signer = PrivateKeySigner.generate()
    endpoint = Endpoint({"keys": [signer.public_jwk()]})
    cache = JwksCache(endpoint, clock, min_refresh_interval_seconds=10, max_age_seconds=60)
    for _ in range(50):
        assert await cache.public_key(signer.kid) is not None
        clock.advance(1)
    assert endpoint.requests == 1
    clock.advance(10)
    await cache.public_key(signer.kid)
    assert endpoint.requests == 2
    assert cache.kids() == {signer.kid}


async def test_kid_miss_refreshes_at_most_once_per_interval() -> None:
    clock = ManualClock()
    first, second = PrivateKeySigner.generate(), PrivateKeySigner.generate()
    endpoint = Endpoint({"keys": [first.public_jwk()]})
    cache = JwksCache(endpoint, clock, min_refresh_interval_seconds=30, max_age_seconds=300)
    assert await cache.public_key(first.kid) is not None
    endpoint.document = {"keys": [first.public_jwk(), second.public_jwk()]}
    # Within the interval of the first fetch: no refetch, the kid is unknown.
    assert await cache.public_key(second.kid) is None
    assert endpoint.requests == 1
    clock.advance(30)
    assert await cache.public_key(second.kid) is not None
    assert endpoint.requests == 2
    # A flood of made-up kids, sequential then concurrent: one fetch per interval.
    clock.advance(30)
    for i in range(500):
        assert await cache.public_key(f"kid-{i}") is None
        clock.advance(0.1)  # 50 s in all: the flood spans two intervals
    assert endpoint.requests == 4

    async def miss(i: int) -> None:
        assert await cache.public_key(f"other-{i}") is None

    clock.advance(30)
    async with anyio.create_task_group() as group:
        for i in range(500):
            group.start_soon(miss, i)
    assert endpoint.requests == 5


async def test_cache_outage_is_not_hammered_and_stale_copy_is_kept() -> None:
    clock = ManualClock()
    signer = PrivateKeySigner.generate()
    endpoint = Endpoint({"keys": [signer.public_jwk()]})
    endpoint.down = True
    cache = JwksCache(endpoint, clock, min_refresh_interval_seconds=30, max_age_seconds=60)
    for _ in range(20):
        with pytest.raises(JwksUnavailable):
            await cache.public_key(signer.kid)
    assert endpoint.requests == 1
    with pytest.raises(JwksUnavailable):
        await cache.refresh()
    endpoint.down = False
    clock.advance(30)
    assert await cache.public_key(signer.kid) is not None
    # Down again once the copy is stale: known kids keep verifying from it...
    endpoint.down = True
    clock.advance(120)
    assert await cache.public_key(signer.kid) is not None
    # ...unknown ones are "try later", not "unknown", after a failed fetch.
    with pytest.raises(JwksUnavailable):
        await cache.public_key("new-kid")
    assert endpoint.requests == 4


async def test_malformed_document_counts_as_a_failed_fetch() -> None:
    clock = ManualClock()
    endpoint = Endpoint({"keys": "all of them"})
    cache = JwksCache(endpoint, clock)
    with pytest.raises(JwksUnavailable):
        await cache.public_key("kid")


def test_cache_settings_are_validated() -> None:
    clock = ManualClock()
    with pytest.raises(ConfigurationError):
        JwksCache(Endpoint(), clock, min_refresh_interval_seconds=0)
    with pytest.raises(ConfigurationError):
        JwksCache(Endpoint(), clock, min_refresh_interval_seconds=60, max_age_seconds=30)


# --- the lite profile's key directory -------------------------------------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _key_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("signing-*.pem"))


def test_first_open_creates_an_owner_only_key(tmp_path: Path) -> None:
    clock = ManualClock()
    directory = tmp_path / "state" / "keys"
    ring = LocalKeyStore(directory, clock, POLICY).open()
    signer = ring.active_signer()
    assert _mode(directory) == 0o700
    [key_file] = _key_files(directory)
    assert key_file.name == f"signing-20260101T000000Z-{signer.kid}.pem"
    assert _mode(key_file) == 0o600
    assert _mode(directory / STATE_FILE) == 0o600
    key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert jwk_thumbprint(key.public_key()) == signer.kid
    state = json.loads((directory / STATE_FILE).read_text())
    assert state["keys"] == [
        {
            "kid": signer.kid,
            "file": key_file.name,
            "published_at": "2026-01-01T00:00:00+00:00",
            "activated_at": "2026-01-01T00:00:00+00:00",
            "retired_at": None,
            "bootstrap": True,
        }
    ]
    # Later opens load the same key.
    clock.advance(3600)
    again = LocalKeyStore(directory, clock, POLICY).open()
    assert again.active_signer().kid == signer.kid
    assert again.jwks() == ring.jwks()
    assert len(_key_files(directory)) == 1


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644])
def test_a_key_readable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    LocalKeyStore(tmp_path / "keys", ManualClock(), POLICY).open()
    [key_file] = _key_files(tmp_path / "keys")
    key_file.chmod(mode)
    with pytest.raises(KeyFileError, match="group or others") as caught:
        LocalKeyStore(tmp_path / "keys", ManualClock(), POLICY).open()
    assert str(key_file) in str(caught.value)
    assert "chmod 600" in str(caught.value)


def test_a_shared_key_directory_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "keys"
    directory.mkdir(mode=0o755)
    directory.chmod(0o755)
    with pytest.raises(KeyFileError, match="chmod 700") as caught:
        LocalKeyStore(directory, ManualClock(), POLICY).open()
    assert str(directory) in str(caught.value)
    assert not _key_files(directory)


def test_a_symlinked_key_file_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "keys"
    LocalKeyStore(directory, ManualClock(), POLICY).open()
    [key_file] = _key_files(directory)
    elsewhere = tmp_path / "elsewhere.pem"
    key_file.rename(elsewhere)
    key_file.symlink_to(elsewhere)
    with pytest.raises(KeyFileError, match="cannot open private key file"):
        LocalKeyStore(directory, ManualClock(), POLICY).open()


def test_a_state_file_cannot_point_outside_the_directory(tmp_path: Path) -> None:
    directory = tmp_path / "keys"
    LocalKeyStore(directory, ManualClock(), POLICY).open()
    state_path = directory / STATE_FILE
    state = json.loads(state_path.read_text())
    state["keys"][0]["file"] = "../" + state["keys"][0]["file"]
    state_path.write_text(json.dumps(state))
    with pytest.raises(KeyFileError, match="bad key file name"):
        LocalKeyStore(directory, ManualClock(), POLICY).open()


def test_a_key_file_swapped_for_another_key_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "keys"
    LocalKeyStore(directory, ManualClock(), POLICY).open()
    [key_file] = _key_files(directory)
    other = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    key_file.write_bytes(other)
    with pytest.raises(KeyFileError, match="does not match its kid"):
        LocalKeyStore(directory, ManualClock(), POLICY).open()


def test_key_files_without_state_are_refused(tmp_path: Path) -> None:
    directory = tmp_path / "keys"
    LocalKeyStore(directory, ManualClock(), POLICY).open()
    (directory / STATE_FILE).unlink()
    with pytest.raises(KeyFileError, match=STATE_FILE):
        LocalKeyStore(directory, ManualClock(), POLICY).open()


async def test_rotate_and_prune_on_disk(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = ManualClock()
    directory = tmp_path / "keys"
    store = LocalKeyStore(directory, clock, POLICY)
    ring = store.open()
    old = ring.active_signer()
    issuer = TokenIssuer(ring, ISS, AUD, TTL, clock)
    verifier = TokenVerifier(ring, ISS, AUD, clock)
    clock.advance(60)
    schedule = store.rotate()
    assert len(_key_files(directory)) == 2
    assert all(_mode(p) == 0o600 for p in _key_files(directory))
    with pytest.raises(ConfigurationError, match="pending"):
        store.rotate()
    assert len(_key_files(directory)) == 2  # nothing written for the refused rotation
    # The same ring object follows the rotation; the old key still signs.
    assert ring.active_signer().kid == old.kid
    assert {jwk["kid"] for jwk in ring.jwks()["keys"]} == {old.kid, schedule.kid}
    old_token = await issuer.issue(TASK, 1, [INPUT], OUT, SCRATCH)
    # Another process loading the directory sees the same schedule.
    reloaded = LocalKeyStore(directory, clock, POLICY).open()
    assert reloaded.schedules() == ring.schedules()
    clock.advance(CACHE)
    assert ring.active_signer().kid == schedule.kid
    assert reloaded.active_signer().kid == schedule.kid
    new_token = await issuer.issue(TASK, 1, [INPUT], OUT, SCRATCH)
    assert json.loads(_header(new_token))["kid"] == schedule.kid
    await verifier.verify(old_token)
    await verifier.verify(new_token)
    # A key file the state does not name (a crash mid-rotation) is ignored.
    stray = directory / f"signing-20260101T000000Z-{'A' * 43}.pem"
    stray.write_bytes(b"junk")
    os.chmod(stray, 0o600)
    with caplog.at_level(logging.WARNING, logger="trace_lite.keys"):
        LocalKeyStore(directory, clock, POLICY).open()
    assert "ignoring key file" in caplog.text
    stray.unlink()
    # Pruning deletes the old key's file once it left the JWKS.
    assert store.prune() == []
    clock.advance(RETENTION)
    assert store.prune() == [old.kid]
    [remaining] = _key_files(directory)
    assert schedule.kid in remaining.name
    assert [s.kid for s in LocalKeyStore(directory, clock, POLICY).open().schedules()] == [
        schedule.kid
    ]
