"""Stored credentials (euterpe-contract.md §10): the vault's AAD binding,
tampering, the KEK window, rotation with re-wrap, and a refresh racing a
re-wrap; the storage parts on both engines, with real AES-GCM keys."""

from __future__ import annotations

import dataclasses
import os
import stat
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

import anyio.from_thread
import pytest

from tests.factories import insert_inbox_job
from trace_core.clock import ManualClock
from trace_core.errors import ConfigurationError, NotFound
from trace_core.euterpe.credentials import (
    CredentialsUnavailable,
    CredentialVault,
    CredentialVersionConflict,
    RetiredKek,
    SealedCredentials,
    StorageCredentials,
    open_job_credentials,
    refresh_credentials,
    rewrap_credentials,
)
from trace_core.security.envelope import Envelope, KeyEncryption
from trace_core.storage.sql import SqlRepository
from trace_lite.envelope import LocalKeyEncryption
from trace_lite.kek_ring import kek_path, load_credential_vault

CREDS = StorageCredentials(
    "AKIDEXAMPLE",
    "s3cr3t-value-0123456789",
    "session-token-abcdef",
    datetime(2030, 1, 1, tzinfo=UTC),
)
NEWER = StorageCredentials("AKIDNEWER", "n3wer-secret-9876543210", "newer-token-xyz")
JOB = uuid.UUID("00000000-0000-4000-8000-000000000001")


def ring(*ids: str) -> dict[str, KeyEncryption]:
    return {kek_id: LocalKeyEncryption(os.urandom(32)) for kek_id in ids}


def bound(job: uuid.UUID = JOB, requester: str = "acme", version: int = 0) -> dict[str, object]:
    return {"job_id": job, "requester_id": requester, "credential_version": version}


# --- the value and the vault (no database) -----------------------------------------


def test_credentials_never_show_their_secrets() -> None:
    for text in (repr(CREDS), str(CREDS), repr(CREDS.as_wire().keys())):
        assert CREDS.secret_access_key not in text
        assert CREDS.session_token not in text
    assert "AKIDEXAMPLE" in repr(CREDS)
    assert StorageCredentials.from_bytes(CREDS.to_bytes()) == CREDS
    assert CREDS.as_wire()["expiration"] == "2030-01-01T00:00:00+00:00"


def test_seal_opens_only_for_the_same_job_requester_and_version() -> None:
    vault = CredentialVault(ring("k1"), active="k1")
    sealed = vault.seal(CREDS, job_id=JOB, requester_id="acme", credential_version=3)
    assert sealed.kek_id == "k1" and sealed.encryption_version == 1
    assert CREDS.secret_access_key.encode() not in sealed.encrypted + sealed.dek_wrapped
    assert vault.open(sealed, job_id=JOB, requester_id="acme", credential_version=3) == CREDS
    for moved in (
        {"job_id": uuid.uuid4(), "requester_id": "acme", "credential_version": 3},
        {"job_id": JOB, "requester_id": "globex", "credential_version": 3},
        {"job_id": JOB, "requester_id": "acme", "credential_version": 4},
    ):
        with pytest.raises(CredentialsUnavailable, match="do not open"):
            vault.open(sealed, **moved)
    # sealing twice gives different ciphertexts (a fresh data key and nonce each time)
    again = vault.seal(CREDS, job_id=JOB, requester_id="acme", credential_version=3)
    assert again.encrypted != sealed.encrypted and again.dek_wrapped != sealed.dek_wrapped


@pytest.mark.parametrize("part", ["encrypted", "dek_wrapped"])
def test_any_flipped_or_cut_byte_fails(part: str) -> None:
    vault = CredentialVault(ring("k1"), active="k1")
    sealed = vault.seal(CREDS, **bound())
    blob: bytes = getattr(sealed, part)
    for position in (0, len(blob) // 2, len(blob) - 1):
        flipped = blob[:position] + bytes([blob[position] ^ 0x01]) + blob[position + 1 :]
        with pytest.raises(CredentialsUnavailable):
            vault.open(dataclasses.replace(sealed, **{part: flipped}), **bound())
    with pytest.raises(CredentialsUnavailable):
        vault.open(dataclasses.replace(sealed, **{part: blob[:-1]}), **bound())


def test_blob_a_presented_as_blob_b_fails() -> None:
    vault = CredentialVault(ring("k1"), active="k1")
    a = vault.seal(CREDS, **bound())
    b = vault.seal(NEWER, **bound(job=uuid.uuid4()))
    with pytest.raises(CredentialsUnavailable):
        vault.open(dataclasses.replace(a, dek_wrapped=b.dek_wrapped), **bound())


def test_relabelled_kek_id_and_unknown_version_fail() -> None:
    keys = ring("k1", "k2")
    vault = CredentialVault(keys, active="k1", accepted=["k2"])
    sealed = vault.seal(CREDS, **bound())
    with pytest.raises(CredentialsUnavailable):
        vault.open(dataclasses.replace(sealed, kek_id="k2"), **bound())
    with pytest.raises(CredentialsUnavailable, match="encryption version 2"):
        vault.open(dataclasses.replace(sealed, encryption_version=2), **bound())


def test_a_retired_kek_id_is_refused_by_name() -> None:
    keys = ring("k1", "k2")
    old = CredentialVault(keys, active="k1").seal(CREDS, **bound())
    retired = CredentialVault(keys, active="k2")  # k1 in the ring, not in the window
    with pytest.raises(RetiredKek, match="'k1'") as caught:
        retired.open(old, **bound())
    assert caught.value.kek_id == "k1"
    unknown = dataclasses.replace(old, kek_id="k9")
    with pytest.raises(RetiredKek, match="'k9'"):
        retired.open(unknown, **bound())


def test_the_window_must_be_in_the_ring() -> None:
    with pytest.raises(ConfigurationError, match="'k2'"):
        CredentialVault(ring("k1"), active="k1", accepted=["k2"])
    with pytest.raises(ConfigurationError, match="active kek_id"):
        CredentialVault(ring("k1"), active="../k1")


def test_rotation_old_blobs_open_then_rewrap_moves_them() -> None:
    keys = ring("k1", "k2")
    old = CredentialVault(keys, active="k1").seal(CREDS, **bound())
    rotated = CredentialVault(keys, active="k2", accepted=["k1"])
    assert rotated.open(old, **bound()) == CREDS
    moved = rotated.rewrap(old, **bound())
    assert moved.kek_id == "k2"
    assert rotated.rewrap(moved, **bound()) is moved  # already active: as is
    after = CredentialVault(keys, active="k2")  # k1 retired
    assert after.open(moved, **bound()) == CREDS


# --- with the database (both engines) --------------------------------------------


async def seed(
    repo: SqlRepository, clock: ManualClock, vault: CredentialVault, count: int
) -> list[uuid.UUID]:
    jobs = sorted(uuid.uuid4() for _ in range(count))
    async with repo.transaction() as tx:
        for job in jobs:
            sealed = vault.seal(CREDS, job_id=job, requester_id="acme", credential_version=0)
            await insert_inbox_job(
                tx, job_id=job, requester_id="acme", now=clock.now(), sealed=sealed
            )
    return jobs


@pytest.mark.anyio
async def test_rewrap_moves_every_blob_in_batches_and_is_idempotent(
    repo: SqlRepository, clock: ManualClock
) -> None:
    keys = ring("k1", "k2")
    jobs = await seed(repo, clock, CredentialVault(keys, active="k1"), 5)
    tampered = jobs[2]
    async with repo.read() as tx:
        stored = await tx.inbox_credentials.read(tampered)
    assert stored is not None and stored.sealed is not None
    async with repo.transaction() as tx:  # a blob that does not open stays as it is
        flipped = stored.sealed.encrypted[:-1] + bytes([stored.sealed.encrypted[-1] ^ 1])
        bad = dataclasses.replace(stored.sealed, encrypted=flipped)
        assert await tx.inbox_credentials.rewrap_if_unchanged(
            tampered, credential_version=0, kek_id="k1", sealed=bad, now=clock.now()
        )

    rotated = CredentialVault(keys, active="k2", accepted=["k1"])
    report = await rewrap_credentials(repo, rotated, batch_size=2, clock=clock)
    assert (report.rewrapped, report.superseded, report.unopenable) == (4, 0, [tampered])
    assert report.remaining == {"k1": True}  # the tampered one
    again = await rewrap_credentials(repo, rotated, batch_size=2, clock=clock)
    assert (again.rewrapped, again.superseded) == (0, 0)

    after = CredentialVault(keys, active="k2")  # k1 retired
    for job in jobs:
        if job != tampered:
            assert await open_job_credentials(repo, after, job) == (0, CREDS)
    with pytest.raises(RetiredKek):
        await open_job_credentials(repo, after, tampered)
    with pytest.raises(RetiredKek, match="'k1'"):
        await rewrap_credentials(repo, after, kek_ids=["k1"], clock=clock)


@pytest.mark.anyio
async def test_refresh_bumps_the_version_and_is_guarded(
    repo: SqlRepository, clock: ManualClock
) -> None:
    vault = CredentialVault(ring("k1"), active="k1")
    [job] = await seed(repo, clock, vault, 1)
    kw = {"job_id": job, "credentials": NEWER, "clock": clock}
    assert (
        await refresh_credentials(repo, vault, requester_id="acme", expected_version=0, **kw) == 1
    )
    assert await open_job_credentials(repo, vault, job) == (1, NEWER)
    with pytest.raises(CredentialVersionConflict, match="version 1, not 0"):
        await refresh_credentials(repo, vault, requester_id="acme", expected_version=0, **kw)
    with pytest.raises(NotFound):  # another requester's job reads as unknown
        await refresh_credentials(repo, vault, requester_id="globex", expected_version=1, **kw)
    with pytest.raises(NotFound):
        await open_job_credentials(repo, vault, uuid.uuid4())


class HookOnOpen:
    """A real local KEK that runs ``hook`` (in the event loop) the first time
    it opens: a credential refresh committed while a re-wrap is mid-flight."""

    def __init__(self, inner: KeyEncryption, hook: Callable[[], Awaitable[object]]) -> None:
        self.inner = inner
        self.hook: Callable[[], Awaitable[object]] | None = hook

    def seal(self, plaintext: bytes, context: str) -> Envelope:
        return self.inner.seal(plaintext, context)

    def open(self, envelope: Envelope, context: str) -> bytes:
        hook, self.hook = self.hook, None
        if hook is not None:
            anyio.from_thread.run(hook)
        return self.inner.open(envelope, context)


@pytest.mark.anyio
async def test_a_refresh_during_a_rewrap_keeps_the_newest_credentials(
    repo: SqlRepository, clock: ManualClock
) -> None:
    keys = ring("k1", "k2")
    [job] = await seed(repo, clock, CredentialVault(keys, active="k1"), 1)
    rotated_keys = dict(keys)
    rotated = CredentialVault(rotated_keys, active="k2", accepted=["k1"])

    async def refresh() -> int:
        return await refresh_credentials(
            repo,
            rotated,
            job_id=job,
            requester_id="acme",
            expected_version=0,
            credentials=NEWER,
            clock=clock,
        )

    rotated_keys["k1"] = HookOnOpen(keys["k1"], refresh)
    rotated = CredentialVault(rotated_keys, active="k2", accepted=["k1"])
    report = await rewrap_credentials(repo, rotated, clock=clock)
    assert (report.rewrapped, report.superseded) == (0, 1)
    assert report.remaining == {"k1": False}
    assert await open_job_credentials(repo, CredentialVault(keys, active="k2"), job) == (1, NEWER)


# --- the lite key ring --------------------------------------------------------------


def test_lite_ring_creates_the_active_key_and_requires_older_ones(tmp_path: Path) -> None:
    vault = load_credential_vault(tmp_path, active="k1")
    path = kek_path(tmp_path, "k1")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(path.read_bytes()) == 32
    sealed = vault.seal(CREDS, **bound())

    with pytest.raises(ConfigurationError, match="k0") as missing:
        load_credential_vault(tmp_path, active="k2", accepted=["k0"])
    assert str(kek_path(tmp_path, "k0")) in str(missing.value)
    assert not kek_path(tmp_path, "k0").exists()

    rotated = load_credential_vault(tmp_path, active="k2", accepted=["k1"])
    assert rotated.open(sealed, **bound()) == CREDS
    moved = rotated.rewrap(sealed, **bound())
    assert load_credential_vault(tmp_path, active="k2").open(moved, **bound()) == CREDS
    with pytest.raises(RetiredKek):
        load_credential_vault(tmp_path, active="k2").open(sealed, **bound())
    with pytest.raises(Exception, match="kek_id"):
        load_credential_vault(tmp_path, active="../escape")


def test_sealed_repr_shows_no_bytes() -> None:
    vault = CredentialVault(ring("k1"), active="k1")
    sealed: SealedCredentials = vault.seal(CREDS, **bound())
    assert "bytes>" in repr(sealed) and "k1" in repr(sealed)
    assert repr(sealed.encrypted) not in repr(sealed)
