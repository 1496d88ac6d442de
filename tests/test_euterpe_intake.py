"""Enqueueing a transcode (issue 16 §6, §9, §10): API keys, request
validation, idempotency and sealing, on both engines."""

from __future__ import annotations

import copy
import ipaddress
import logging
import os
import uuid
from datetime import timedelta
from typing import Any

import anyio
import pytest
import sqlalchemy as sa

from trace_core.clock import ManualClock
from trace_core.errors import IdempotencyConflict, IdempotencyInFlight, InvalidInput
from trace_core.euterpe.api_keys import ApiKeyRefused, ApiKeys, key_digest
from trace_core.euterpe.credentials import (
    CredentialVault,
    StorageCredentials,
    open_job_credentials,
)
from trace_core.euterpe.intake import EnqueueResult, Intake, enqueue_scope
from trace_core.euterpe.jobs import InboxJobs
from trace_core.euterpe.requests import UrlPolicy, parse_transcode_request, request_hash
from trace_core.idempotency import IdempotencyStore
from trace_core.storage import schema
from trace_core.storage.sql import SqlRepository
from trace_lite.envelope import LocalKeyEncryption

pytestmark = pytest.mark.anyio

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"
TOKEN = "FwoGZXIvYXdzEXAMPLE-session-token-value"
BODY: dict[str, Any] = {
    "source": "s3://media-in/clips/a.mov",
    "output_prefix": "s3://media-out/jobs/a",
    "presets": ["mp4-h264-360p", "audio-aac-128k"],
    "status_webhook_url": "https://hooks.example.com/euterpe",
    "refresh_url": "https://hooks.example.com/refresh",
    "storage_credentials": {
        "access_key_id": "AKIDEXAMPLE",
        "secret_access_key": SECRET,
        "session_token": TOKEN,
        "expiration": "2026-01-01T06:00:00Z",
    },
}


def body(**changes: Any) -> dict[str, Any]:
    """BODY with ``changes``; ``storage_credentials__x`` changes a credential field."""
    out = copy.deepcopy(BODY)
    for name, value in changes.items():
        target, _, key = name.partition("__")
        where = out[target] if key else out
        key = key or target
        if value is _DROP:
            where.pop(key)
        else:
            where[key] = value
    return out


_DROP = object()


@pytest.fixture
def keys(repo: SqlRepository, clock: ManualClock) -> ApiKeys:
    return ApiKeys(repo, clock=clock)


@pytest.fixture
def vault() -> CredentialVault:
    return CredentialVault({"k1": LocalKeyEncryption(os.urandom(32))}, active="k1")


@pytest.fixture
def intake(
    repo: SqlRepository, clock: ManualClock, keys: ApiKeys, vault: CredentialVault
) -> Intake:
    return Intake(
        repo,
        keys=keys,
        vault=vault,
        enqueuer=InboxJobs(repo, clock=clock),
        idempotency=IdempotencyStore(repo, clock=clock),
        url_policy=UrlPolicy(),
        clock=clock,
    )


async def dump(repo: SqlRepository, table: sa.Table) -> list[tuple[Any, ...]]:
    async with repo.transaction() as tx:
        return [tuple(row) for row in (await tx.connection.execute(sa.select(table))).all()]


def text_of(rows: list[tuple[Any, ...]]) -> str:
    """Every value of ``rows`` as text, bytes decoded leniently (a plaintext
    stored anywhere, in any column type, shows up here)."""
    parts = []
    for row in rows:
        for value in row:
            parts.append(value.decode("latin-1") if isinstance(value, bytes) else repr(value))
    return "\n".join(parts)


# --- API keys ----------------------------------------------------------------------


async def test_keys_are_issued_once_and_stored_as_digests(
    repo: SqlRepository, keys: ApiKeys, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    issued = await keys.issue("acme", label="ci")
    assert issued.secret.startswith("eut_") and len(issued.secret) == 4 + 43
    assert issued.secret not in repr(issued)
    assert await keys.authenticate(issued.secret) == "acme"

    rows = await dump(repo, schema.euterpe_api_keys)
    assert [row[2] for row in rows] == [key_digest(issued.secret)]
    assert issued.secret not in text_of(rows)
    assert issued.secret not in caplog.text
    listed = await keys.list_keys("acme")
    assert [(k.key_id, k.label, k.revoked_at) for k in listed] == [(issued.key_id, "ci", None)]
    assert issued.secret not in repr(listed) and key_digest(issued.secret) not in repr(listed)


async def test_unknown_malformed_and_revoked_keys_are_refused_alike(keys: ApiKeys) -> None:
    issued = await keys.issue("acme")
    other = await keys.issue("globex")
    refused = [None, "", "eut_", "eut_" + "x" * 43, issued.secret + "x", "x" * 10_000]
    refused.append(issued.secret[4:])  # without the prefix
    for presented in refused:
        with pytest.raises(ApiKeyRefused) as caught:
            await keys.authenticate(presented)
        assert str(caught.value) == "API key refused"
    assert not await keys.revoke(issued.key_id, requester_id="globex")  # not theirs
    assert await keys.authenticate(issued.secret) == "acme"
    assert await keys.revoke(issued.key_id, requester_id="acme")
    assert not await keys.revoke(issued.key_id)  # already revoked
    with pytest.raises(ApiKeyRefused, match=r"^API key refused$"):
        await keys.authenticate(issued.secret)
    assert await keys.authenticate(other.secret) == "globex"
    [revoked] = await keys.list_keys("acme")
    assert revoked.revoked_at is not None


async def test_requester_ids_and_labels_are_checked(keys: ApiKeys) -> None:
    for bad in ("", " acme", "a/b", "x" * 129, "acme\x00"):
        with pytest.raises(InvalidInput, match=r"^requester_id:"):
            await keys.issue(bad)
    with pytest.raises(InvalidInput, match=r"^label:"):
        await keys.issue("acme", label="x" * 201)


# --- the request ------------------------------------------------------------------

INVALID = [
    (body(source=_DROP), "source"),
    (body(source="http://media-in/a.mov"), "source"),
    (body(source="s3://media-in/../etc/passwd"), "source"),
    (body(source="s3://media-in/" + "k" * 1100), "source"),
    (body(source=42), "source"),
    (body(output_prefix="s3://media-out/"), "output_prefix"),
    (body(output_prefix="s3://media-out/a*/"), "output_prefix"),
    (body(presets=[]), "presets"),
    (body(presets="mp4-h264-360p"), "presets"),
    (body(presets=["mp4-h264-360p", "nope"]), "presets[1]"),
    (body(presets=["mp4-h264-360p", "mp4-h264-360p"]), "presets"),
    (body(presets=["mp4-h264-360p"] * 9), "presets"),
    (body(status_webhook_url="ftp://hooks.example.com/x"), "status_webhook_url"),
    (body(status_webhook_url="https://user:pw@hooks.example.com/x"), "status_webhook_url"),
    (body(status_webhook_url="https://hooks.example.com/" + "a" * 2048), "status_webhook_url"),
    (body(status_webhook_url="http://127.0.0.1:8080/hook"), "status_webhook_url"),
    (body(status_webhook_url="http://169.254.169.254/latest/meta-data"), "status_webhook_url"),
    (body(refresh_url="http://10.0.0.5/refresh"), "refresh_url"),
    (body(refresh_url="http://localhost/refresh"), "refresh_url"),
    (body(refresh_url="https://hooks.example.com/a b"), "refresh_url"),
    (body(storage_credentials=_DROP), "storage_credentials"),
    (body(storage_credentials__access_key_id=""), "storage_credentials.access_key_id"),
    (body(storage_credentials__secret_access_key=_DROP), "storage_credentials.secret_access_key"),
    (body(storage_credentials__secret_access_key=""), "storage_credentials.secret_access_key"),
    (body(storage_credentials__session_token="t" * 9000), "storage_credentials.session_token"),
    (body(storage_credentials__session_token="a\x00b"), "storage_credentials.session_token"),
    (body(storage_credentials__expiration="2026-01-01T06:00:00"), "storage_credentials.expiration"),
    (body(storage_credentials__region="eu-west-1"), "storage_credentials.region"),
    (body(callback="https://x.example.com"), "callback"),
]


@pytest.mark.parametrize(("bad", "field"), INVALID, ids=[f for _, f in INVALID])
def test_each_malformed_field_is_named(bad: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        parse_transcode_request(bad, policy=UrlPolicy())
    assert caught.value.field == field
    # nothing submitted is echoed back (in particular no secret)
    assert SECRET not in str(caught.value) and "passwd" not in str(caught.value)


def test_a_request_parses_to_canonical_locations_and_a_credential_free_hash() -> None:
    request = parse_transcode_request(BODY, policy=UrlPolicy())
    assert request.output_prefix == "s3://media-out/jobs/a/"
    assert SECRET not in repr(request) and TOKEN not in repr(request)
    stored = request.job_request()
    assert "storage_credentials" not in stored
    assert stored["presets"] == ["mp4-h264-360p", "audio-aac-128k"]
    fresh = body(
        storage_credentials__secret_access_key="rotated", storage_credentials__session_token="t2"
    )
    assert request_hash(parse_transcode_request(fresh, policy=UrlPolicy())) == request_hash(request)
    other = body(presets=["mp4-h264-720p"])
    assert request_hash(parse_transcode_request(other, policy=UrlPolicy())) != request_hash(request)
    raw = parse_transcode_request(__import__("json").dumps(BODY).encode(), policy=UrlPolicy())
    assert raw == request


def test_url_policy() -> None:
    listed = UrlPolicy(allowed_hosts=frozenset({"hooks.example.com", "*.acme.test"}))
    listed.check("https://hooks.example.com/x", "u")
    listed.check("https://a.b.acme.test/x", "u")
    for url in ("https://evil.example.com/x", "https://acme.test.evil.com/", "https://xacme.test/"):
        with pytest.raises(InvalidInput, match=r"^u: host is not in the allowed"):
            listed.check(url, "u")
    dev = UrlPolicy(allow_loopback=True)
    dev.check("http://127.0.0.1:9000/hook", "u")
    dev.check("http://localhost:9000/hook", "u")
    dev.check("http://[::1]:9000/hook", "u")
    with pytest.raises(InvalidInput):
        dev.check("http://192.168.1.4/hook", "u")
    UrlPolicy(allow_private=True).check("http://192.168.1.4/hook", "u")
    for legacy in (
        "http://2130706433/",
        "http://127.1/",
        "http://0x7f.0.0.1/",
        "http://0251.0376.0251.0376/",
    ):
        with pytest.raises(InvalidInput, match="address range"):
            UrlPolicy().check(legacy, "u")
    UrlPolicy().check("https://123.example.com/", "u")  # a name that starts with digits
    for address in ("169.254.169.254", "0.0.0.0", "224.0.0.1", "::ffff:127.0.0.1", "fe80::1"):
        assert not UrlPolicy(allow_private=True).address_allowed(ipaddress.ip_address(address))
    assert UrlPolicy().address_allowed(ipaddress.ip_address("93.184.216.34"))
    assert UrlPolicy(allow_loopback=True).address_allowed(ipaddress.ip_address("::ffff:127.0.0.1"))


# --- enqueue -----------------------------------------------------------------------


async def stored_counts(repo: SqlRepository) -> tuple[int, int]:
    return len(await dump(repo, schema.inbox_jobs)), len(await dump(repo, schema.idempotency_keys))


async def test_enqueue_seals_the_credentials_and_stores_no_plaintext(
    repo: SqlRepository,
    keys: ApiKeys,
    intake: Intake,
    vault: CredentialVault,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    key = await keys.issue("acme")
    result = await intake.enqueue(api_key=key.secret, idempotency_key="order-1", body=BODY)
    assert result == EnqueueResult(result.job_id, "acme", False)

    version, opened = await open_job_credentials(repo, vault, result.job_id)
    assert version == 0
    assert opened == StorageCredentials(
        "AKIDEXAMPLE",
        SECRET,
        TOKEN,
        parse_transcode_request(BODY, policy=UrlPolicy()).storage_credentials.expiration,
    )
    [row] = await dump(repo, schema.inbox_jobs)
    job = dict(zip(schema.inbox_jobs.c.keys(), row, strict=True))
    assert job["requester_id"] == "acme" and job["status"] == "queued"
    assert job["request"]["presets"] == ["mp4-h264-360p", "audio-aac-128k"]
    assert "storage_credentials" not in job["request"]
    assert job["status_webhook_url"] == BODY["status_webhook_url"]
    assert job["storage_creds_kek_id"] == "k1" and job["storage_creds_encryption_version"] == 1

    everything = ""
    for table in (schema.inbox_jobs, schema.idempotency_keys, schema.euterpe_api_keys):
        everything += text_of(await dump(repo, table))
    for secret in (SECRET, TOKEN, key.secret):
        assert secret not in everything
        assert secret not in caplog.text


async def test_same_key_and_request_return_the_same_job(
    repo: SqlRepository, keys: ApiKeys, intake: Intake
) -> None:
    key = await keys.issue("acme")
    first = await intake.enqueue(api_key=key.secret, idempotency_key="k-1", body=BODY)
    again = await intake.enqueue(api_key=key.secret, idempotency_key="k-1", body=BODY)
    assert again == EnqueueResult(first.job_id, "acme", True)
    # a retry with freshly minted credentials is the same request
    fresh = body(
        storage_credentials__secret_access_key="re-minted", storage_credentials__session_token="t2"
    )
    retried = await intake.enqueue(api_key=key.secret, idempotency_key="k-1", body=fresh)
    assert retried.job_id == first.job_id and retried.replayed
    assert await stored_counts(repo) == (1, 1)

    with pytest.raises(IdempotencyConflict):
        await intake.enqueue(
            api_key=key.secret, idempotency_key="k-1", body=body(presets=["webm-vp9-360p"])
        )
    # the scope is per requester: another requester's same key is its own job
    other = await keys.issue("globex")
    theirs = await intake.enqueue(api_key=other.secret, idempotency_key="k-1", body=BODY)
    assert theirs.job_id != first.job_id and not theirs.replayed
    assert await stored_counts(repo) == (2, 2)


async def test_a_key_still_in_flight_says_so(
    repo: SqlRepository, clock: ManualClock, keys: ApiKeys, intake: Intake
) -> None:
    key = await keys.issue("acme")
    request = parse_transcode_request(BODY, policy=UrlPolicy())
    store = IdempotencyStore(repo, clock=clock)
    assert (await store.begin(enqueue_scope("acme"), "busy", request_hash(request))).first
    with pytest.raises(IdempotencyInFlight):
        await intake.enqueue(api_key=key.secret, idempotency_key="busy", body=BODY)
    assert await stored_counts(repo) == (0, 1)


async def test_concurrent_identical_requests_make_one_job(
    repo: SqlRepository, keys: ApiKeys, intake: Intake
) -> None:
    key = await keys.issue("acme")
    outcomes: list[object] = []

    async def post() -> None:
        try:
            outcomes.append(
                (await intake.enqueue(api_key=key.secret, idempotency_key="same", body=BODY)).job_id
            )
        except IdempotencyInFlight as exc:
            outcomes.append(exc)

    async with anyio.create_task_group() as group:
        for _ in range(8):
            group.start_soon(post)
    job_ids = {o for o in outcomes if isinstance(o, uuid.UUID)}
    assert len(outcomes) == 8 and len(job_ids) == 1
    assert await stored_counts(repo) == (1, 1)


async def test_malformed_input_stores_nothing(
    repo: SqlRepository, clock: ManualClock, keys: ApiKeys, intake: Intake
) -> None:
    key = await keys.issue("acme")
    with pytest.raises(ApiKeyRefused):
        await intake.enqueue(api_key="eut_wrong", idempotency_key="a", body=BODY)
    with pytest.raises(InvalidInput, match=r"^Idempotency-Key: is required"):
        await intake.enqueue(api_key=key.secret, idempotency_key=None, body=BODY)
    for bad_key in ("", "x" * 256, "tab\there", "é"):
        with pytest.raises(InvalidInput) as caught:
            await intake.enqueue(api_key=key.secret, idempotency_key=bad_key, body=BODY)
        assert caught.value.field == "Idempotency-Key"
    for bad, field in INVALID[:6]:
        with pytest.raises(InvalidInput) as caught:
            await intake.enqueue(api_key=key.secret, idempotency_key="a", body=bad)
        assert caught.value.field == field
    with pytest.raises(InvalidInput, match=r"^body:"):
        await intake.enqueue(api_key=key.secret, idempotency_key="a", body=b"{not json")
    expired = body(storage_credentials__expiration=(clock.now() - timedelta(seconds=1)).isoformat())
    with pytest.raises(InvalidInput, match=r"^storage_credentials.expiration: is in the past"):
        await intake.enqueue(api_key=key.secret, idempotency_key="a", body=expired)
    assert await stored_counts(repo) == (0, 0)


class FailingEnqueuer:
    def __init__(self) -> None:
        self.calls = 0

    async def enqueue(self, tx: Any, **_: Any) -> None:
        self.calls += 1
        raise RuntimeError("inbox insert failed")


async def test_a_failed_insert_releases_the_key_for_the_retry(
    repo: SqlRepository, clock: ManualClock, keys: ApiKeys, intake: Intake
) -> None:
    key = await keys.issue("acme")
    working = intake.enqueuer
    intake.enqueuer = FailingEnqueuer()
    with pytest.raises(RuntimeError, match="inbox insert failed"):
        await intake.enqueue(api_key=key.secret, idempotency_key="retry-me", body=BODY)
    assert await stored_counts(repo) == (0, 0)
    intake.enqueuer = working
    result = await intake.enqueue(api_key=key.secret, idempotency_key="retry-me", body=BODY)
    assert not result.replayed and await stored_counts(repo) == (1, 1)
