"""Euterpe's HTTP API (issue 16 §6, §7, §9): every answer of ``POST
/transcode``, ``GET /transcode/status`` and ``PUT /transcode/{id}/credentials``,
idempotency over HTTP, nothing stored on a refused request, another
requester's job invisible, 410 after pruning, and the OpenAPI document; on
both engines, through the real app and the real job lifecycle."""

from __future__ import annotations

import copy
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import anyio
import httpx
import pytest
import sqlalchemy as sa

from tests.factories import wait_until
from trace_core.api.transcode import (
    REPLAYED_HEADER,
    TranscodeApi,
    create_transcode_app,
)
from trace_core.api.transcode_models import JobStatusBody, TranscodeAccepted
from trace_core.clock import ManualClock
from trace_core.euterpe.api_keys import ApiKeys
from trace_core.euterpe.credentials import CredentialVault, open_job_credentials
from trace_core.euterpe.events import NormalizedError
from trace_core.euterpe.intake import Intake, enqueue_scope
from trace_core.euterpe.job_maintenance import InboxMaintenance
from trace_core.euterpe.jobs import InboxJobs, JobsConfig
from trace_core.euterpe.pruner import EuterpeMaintenance, MaintenanceConfig
from trace_core.euterpe.receiver import WebhookReceiver
from trace_core.euterpe.requests import UrlPolicy, parse_transcode_request, request_hash
from trace_core.idempotency import IdempotencyStore
from trace_core.security.webhook_signing import MasterSecret, WebhookSigner
from trace_core.storage import schema
from trace_core.storage.sql import SqlRepository
from trace_lite.envelope import LocalKeyEncryption

pytestmark = pytest.mark.anyio

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"
TOKEN = "FwoGZXIvYXdzEXAMPLE-session-token-value"
NEW_SECRET = "second-secret-value-QmFzZTY0IGZvciB0ZXN0"
BODY: dict[str, Any] = {
    "source": "s3://media-in/clips/a.mov",
    "output_prefix": "s3://media-out/jobs/a/",
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
    out = copy.deepcopy(BODY)
    out.update(changes)
    return out


@dataclass
class World:
    repo: SqlRepository
    clock: ManualClock
    jobs: InboxJobs
    keys: ApiKeys
    vault: CredentialVault
    idempotency: IdempotencyStore
    http: httpx.AsyncClient
    acme: dict[str, str]
    """Authorization header of requester ``acme``."""
    other: dict[str, str]
    """Authorization header of requester ``globex``."""

    async def post(
        self, document: Any = None, *, key: str | None = "k-1", auth: Any = None, **kw: Any
    ) -> httpx.Response:
        headers = dict(self.acme if auth is None else auth)
        if key is not None:
            headers["Idempotency-Key"] = key
        if "content" not in kw:
            kw["json"] = BODY if document is None else document
        return await self.http.post("/transcode", headers=headers, **kw)

    async def status(self, job_id: Any, auth: dict[str, str] | None = None) -> httpx.Response:
        return await self.http.get(
            "/transcode/status", params={"job_id": str(job_id)}, headers=auth or self.acme
        )

    async def rows(self, table: sa.Table) -> int:
        async with self.repo.transaction() as tx:
            count = await tx.connection.scalar(sa.select(sa.func.count()).select_from(table))
        return int(count or 0)


@pytest.fixture
async def world(repo: SqlRepository, clock: ManualClock) -> AsyncIterator[World]:
    jobs = InboxJobs(repo, clock=clock, config=JobsConfig(lease_seconds=30))
    keys = ApiKeys(repo, clock=clock)
    vault = CredentialVault({"k1": LocalKeyEncryption(os.urandom(32))}, active="k1")
    idempotency = IdempotencyStore(repo, clock=clock)
    intake = Intake(
        repo,
        keys=keys,
        vault=vault,
        enqueuer=jobs,
        idempotency=idempotency,
        url_policy=UrlPolicy(),
        clock=clock,
    )
    app = create_transcode_app(TranscodeApi(intake, jobs, vault))
    acme = (await keys.issue("acme")).secret
    globex = (await keys.issue("globex")).secret
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://euterpe"
    ) as http:
        yield World(
            repo,
            clock,
            jobs,
            keys,
            vault,
            idempotency,
            http,
            {"Authorization": f"Bearer {acme}"},
            {"Authorization": f"Bearer {globex}"},
        )


async def drive_to(world: World, job_id: uuid.UUID, final: str) -> None:
    """Take a job through the lifecycle to ``succeeded`` or ``dead_letter``."""
    lease = (await world.jobs.claim(job_id, "w1")).lease
    assert lease is not None
    if final == "dead_letter":
        error = NormalizedError("source_missing", "no such object", False)
        await world.jobs.fail(lease.fence, error)
        return
    for stage in ("fetching", "processing", "uploading"):
        await world.jobs.advance(lease.fence, stage)
    output = {"key": "s3://media-out/jobs/a/x.mp4", "preset": "mp4-h264-360p"}
    await world.jobs.succeed(lease.fence, [{**output, "size": 12, "sha256": "ab" * 32}])


# --- POST /transcode ----------------------------------------------------------------


async def test_post_enqueues_a_job_the_status_reads(world: World) -> None:
    answer = await world.post()
    assert answer.status_code == 202, answer.text
    accepted = answer.json()
    job_id = uuid.UUID(accepted["job_id"])
    assert accepted["replayed"] is False
    assert accepted["status_url"] == f"/transcode/status?job_id={job_id}"
    assert answer.headers["location"] == accepted["status_url"]
    assert REPLAYED_HEADER.lower() not in answer.headers

    status = await world.http.get(accepted["status_url"], headers=world.acme)
    assert status.status_code == 200
    document = status.json()
    assert document["job_id"] == str(job_id) and document["status"] == "queued"
    assert (document["attempt_count"], document["max_attempts"]) == (0, 5)
    assert document["credential_refresh_count"] == 0
    assert document["created_at"] == world.clock.now().isoformat()
    assert [(h["from"], h["to"]) for h in document["history"]] == [(None, "queued")]
    assert [(w["event_type"], w["status"]) for w in document["webhooks"]] == [
        ("transcode.queued", "pending")
    ]
    assert "outputs" not in document and "error" not in document
    # Sealed, bound to the job, and the request stored without its credentials.
    version, opened = await open_job_credentials(world.repo, world.vault, job_id)
    assert (version, opened.secret_access_key, opened.session_token) == (0, SECRET, TOKEN)
    for text in (answer.text, status.text):
        assert SECRET not in text and TOKEN not in text


async def test_replay_returns_the_same_job_and_another_body_conflicts(world: World) -> None:
    first = await world.post()
    again = await world.post()
    assert again.status_code == 202
    assert again.json()["job_id"] == first.json()["job_id"]
    assert again.json()["replayed"] is True and again.headers[REPLAYED_HEADER] == "true"
    # Fresh credentials are the same transcode: the same job (the hash leaves them out).
    fresher = body(
        storage_credentials={**BODY["storage_credentials"], "secret_access_key": "x" * 40}
    )
    assert (await world.post(fresher)).json()["job_id"] == first.json()["job_id"]

    conflict = await world.post(body(presets=["webm-vp9-360p"]))
    assert conflict.status_code == 409
    assert conflict.json()["error"] == "idempotency_conflict"
    assert conflict.json()["field"] == "Idempotency-Key"
    # Another requester's key space is its own: the same key makes a new job.
    other = await world.post(auth=world.other)
    assert other.status_code == 202 and other.json()["job_id"] != first.json()["job_id"]
    assert await world.rows(schema.inbox_jobs) == 2


async def test_a_key_in_flight_is_answered_409_with_retry_after(world: World) -> None:
    digest = request_hash(parse_transcode_request(BODY, policy=UrlPolicy()))
    replay = await world.idempotency.begin(enqueue_scope("acme"), "k-1", digest)
    assert replay.first
    answer = await world.post()
    assert answer.status_code == 409
    assert answer.json()["error"] == "idempotency_in_flight"
    assert answer.headers["retry-after"] == "1"
    assert await world.rows(schema.inbox_jobs) == 0
    # Once the first request lets go of the key, the retry runs.
    await world.idempotency.release(enqueue_scope("acme"), "k-1", digest)
    assert (await world.post()).status_code == 202


@pytest.mark.parametrize(
    ("document", "key", "field"),
    [
        (BODY, None, "Idempotency-Key"),
        (BODY, "k" * 256, "Idempotency-Key"),
        (body(presets=["mp4-h265-8k"]), "k", "presets[0]"),
        (body(presets=[]), "k", "presets"),
        (body(source="http://example.com/a.mov"), "k", "source"),
        (body(priority=5), "k", "priority"),
        (body(status_webhook_url="http://127.0.0.1/hook"), "k", "status_webhook_url"),
        (body(refresh_url="http://169.254.169.254/latest"), "k", "refresh_url"),
        (
            body(storage_credentials={"access_key_id": "AKID", "secret_access_key": 7}),
            "k",
            "storage_credentials.secret_access_key",
        ),
        (
            body(
                storage_credentials={
                    **BODY["storage_credentials"],
                    "expiration": "2025-12-31T00:00:00Z",
                }
            ),
            "k",
            "storage_credentials.expiration",
        ),
        ("not an object", "k", "body"),
    ],
)
async def test_bad_input_is_400_naming_the_field_and_stores_nothing(
    world: World, document: Any, key: str | None, field: str
) -> None:
    answer = await world.post(document, key=key)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == "invalid_request"
    assert answer.json()["field"] == field
    assert SECRET not in answer.text and TOKEN not in answer.text
    for table in (schema.inbox_jobs, schema.idempotency_keys, schema.job_outbox_events):
        assert await world.rows(table) == 0


async def test_malformed_json_is_400_and_stores_nothing(world: World) -> None:
    answer = await world.post(content=b'{"source": ', key="k")
    assert answer.status_code == 400 and answer.json()["field"] == "body"
    assert await world.rows(schema.idempotency_keys) == 0


async def test_an_oversized_body_is_413(world: World) -> None:
    answer = await world.post(content=b"x" * (300 * 1024), key="k")
    assert answer.status_code == 413
    assert await world.rows(schema.inbox_jobs) == 0


@pytest.mark.parametrize(
    "auth",
    [
        {},
        {"Authorization": "Bearer eut_not-a-key"},
        {"Authorization": "Basic eut_whatever"},
        {"Authorization": "Bearer nonsense"},
    ],
)
async def test_every_route_refuses_a_missing_or_bad_key_with_401(
    world: World, auth: dict[str, str]
) -> None:
    job_id = uuid.UUID((await world.post()).json()["job_id"])
    answers = [
        await world.post(key="k-2", auth=auth),
        await world.status(job_id, auth=auth or {"X": "none"}),
        await world.http.put(
            f"/transcode/{job_id}/credentials",
            json={"credential_version": 0, "storage_credentials": BODY["storage_credentials"]},
            headers=auth,
        ),
    ]
    for answer in answers:
        assert answer.status_code == 401, answer.text
        assert answer.json()["error"] == "unauthorized"
        assert answer.headers["www-authenticate"].startswith("Bearer")
        assert str(job_id) not in answer.text
    assert await world.rows(schema.inbox_jobs) == 1
    assert await world.rows(schema.idempotency_keys) == 1


async def test_a_revoked_key_is_refused(world: World) -> None:
    issued = await world.keys.issue("acme", label="old")
    assert await world.keys.revoke(issued.key_id)
    answer = await world.post(auth={"Authorization": f"Bearer {issued.secret}"})
    assert answer.status_code == 401
    assert await world.rows(schema.inbox_jobs) == 0


# --- GET /transcode/status ------------------------------------------------------------


async def test_status_404_for_unknown_and_for_another_requesters_job(world: World) -> None:
    job_id = uuid.UUID((await world.post()).json()["job_id"])
    unknown = await world.status(uuid.uuid4())
    theirs = await world.status(job_id, auth=world.other)
    assert unknown.status_code == theirs.status_code == 404
    assert unknown.json()["error"] == theirs.json()["error"] == "not_found"
    # Nothing of the job leaks: not its stage, not its source.
    assert "queued" not in theirs.text and "media-in" not in theirs.text


@pytest.mark.parametrize(("params", "field"), [({}, "job_id"), ({"job_id": "nope"}, "job_id")])
async def test_status_needs_a_uuid_job_id(world: World, params: dict[str, str], field: str) -> None:
    answer = await world.http.get("/transcode/status", params=params, headers=world.acme)
    assert answer.status_code == 400 and answer.json()["field"] == field


async def test_status_shows_outputs_when_succeeded_and_the_error_when_dead(
    world: World,
) -> None:
    good = uuid.UUID((await world.post()).json()["job_id"])
    bad = uuid.UUID((await world.post(key="k-2")).json()["job_id"])
    await drive_to(world, good, "succeeded")
    await drive_to(world, bad, "dead_letter")

    succeeded = (await world.status(good)).json()
    assert succeeded["status"] == "succeeded" and succeeded["finished_at"] is not None
    assert [o["key"] for o in succeeded["outputs"]] == ["s3://media-out/jobs/a/x.mp4"]
    assert [h["to"] for h in succeeded["history"]] == [
        "queued",
        "claimed",
        "fetching",
        "processing",
        "uploading",
        "succeeded",
    ]
    assert "error" not in succeeded

    dead = (await world.status(bad)).json()
    assert dead["status"] == "dead_letter" and "outputs" not in dead
    assert dead["error"]["code"] == "source_missing" and dead["error"]["retryable"] is False
    assert [h["to"] for h in dead["history"]][-2:] == ["failed", "dead_letter"]


async def test_a_pruned_job_is_410_for_its_requester_and_404_for_others(world: World) -> None:
    # Polling requester: no webhook, so nothing pending keeps the job.
    job_id = uuid.UUID((await world.post(body(status_webhook_url=None))).json()["job_id"])
    await drive_to(world, job_id, "succeeded")
    service = EuterpeMaintenance(
        InboxMaintenance(world.jobs),
        config=MaintenanceConfig(retention=timedelta(days=1)),
        idempotency=world.idempotency,
    )
    kept = await service.run_once(prune=True)
    assert kept.pruned == [] and (await world.status(job_id)).status_code == 200

    world.clock.advance(timedelta(days=2).total_seconds())
    done = await service.run_once(prune=True)
    assert done.pruned == [job_id]
    assert done.idempotency_swept == 1  # the key (24 h) expired too
    gone = await world.status(job_id)
    assert gone.status_code == 410 and gone.json()["error"] == "gone"
    assert (await world.status(job_id, auth=world.other)).status_code == 404


# --- PUT /transcode/{job_id}/credentials --------------------------------------------


def refresh_body(version: int, secret: str = NEW_SECRET, **creds: Any) -> dict[str, Any]:
    credentials = {"access_key_id": "AKIDNEW", "secret_access_key": secret, **creds}
    return {"credential_version": version, "storage_credentials": credentials}


async def test_a_refresh_bumps_the_version_and_a_stale_one_conflicts(world: World) -> None:
    job_id = uuid.UUID((await world.post()).json()["job_id"])
    url = f"/transcode/{job_id}/credentials"
    answer = await world.http.put(url, json=refresh_body(0), headers=world.acme)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"job_id": str(job_id), "credential_version": 1}
    assert NEW_SECRET not in answer.text
    version, opened = await open_job_credentials(world.repo, world.vault, job_id)
    assert (version, opened.secret_access_key) == (1, NEW_SECRET)

    race = await world.http.put(url, json=refresh_body(0, "z" * 40), headers=world.acme)
    assert race.status_code == 409
    assert race.json()["error"] == "credential_version_conflict"
    theirs = await world.http.put(url, json=refresh_body(1), headers=world.other)
    assert theirs.status_code == 404
    unknown = await world.http.put(
        f"/transcode/{uuid.uuid4()}/credentials", json=refresh_body(0), headers=world.acme
    )
    assert unknown.status_code == 404
    assert (await open_job_credentials(world.repo, world.vault, job_id))[0] == 1


@pytest.mark.parametrize(
    ("document", "field"),
    [
        (refresh_body(-1), "credential_version"),
        ({"storage_credentials": refresh_body(0)["storage_credentials"]}, "credential_version"),
        (refresh_body(0, secret=""), "storage_credentials.secret_access_key"),
        (refresh_body(0, expiration="2025-01-01T00:00:00Z"), "storage_credentials.expiration"),
        ({**refresh_body(0), "extra": 1}, "extra"),
    ],
)
async def test_a_bad_refresh_is_400_naming_the_field(
    world: World, document: dict[str, Any], field: str
) -> None:
    job_id = uuid.UUID((await world.post()).json()["job_id"])
    answer = await world.http.put(
        f"/transcode/{job_id}/credentials", json=document, headers=world.acme
    )
    assert answer.status_code == 400, answer.text
    assert answer.json()["field"] == field
    assert NEW_SECRET not in answer.text
    assert (await open_job_credentials(world.repo, world.vault, job_id))[0] == 0


# --- the maintenance service ------------------------------------------------------


async def test_maintenance_reclaims_expired_leases_and_requeues_due_retries(
    world: World,
) -> None:
    job_id = uuid.UUID((await world.post()).json()["job_id"])
    lease = (await world.jobs.claim(job_id, "dead-worker")).lease
    assert lease is not None
    service = EuterpeMaintenance(InboxMaintenance(world.jobs))
    assert (await service.run_once(prune=False)).reclaimed == 0
    world.clock.advance(31)
    done = await service.run_once(prune=False)
    assert done.reclaimed == 1 and not done.pruning_ran
    assert (await world.status(job_id)).json()["status"] == "failed"
    world.clock.advance(3600)
    assert (await service.run_once(prune=False)).requeued == [job_id]
    document = (await world.status(job_id)).json()
    assert document["status"] == "queued"
    assert [h["to"] for h in document["history"]] == ["queued", "claimed", "failed", "queued"]


# --- the OpenAPI document ---------------------------------------------------------


async def test_the_openapi_document_declares_every_answer(world: World) -> None:
    document = (await world.http.get("/openapi.json")).json()
    paths = document["paths"]
    expected = {
        ("/transcode", "post"): {"202", "400", "401", "409", "413", "503"},
        ("/transcode/status", "get"): {"200", "400", "401", "404", "410", "413", "503"},
        ("/transcode/{job_id}/credentials", "put"): {
            "200",
            "400",
            "401",
            "404",
            "409",
            "413",
            "503",
        },
    }
    for (path, method), codes in expected.items():
        operation = paths[path][method]
        assert set(operation["responses"]) == codes, (path, operation["responses"].keys())
        assert operation["security"] == [{"euterpeApiKey": []}]
    schemas = document["components"]["schemas"]
    post_body = paths["/transcode"]["post"]["requestBody"]["content"]["application/json"]
    assert post_body["schema"]["$ref"] == "#/components/schemas/TranscodeRequest"
    for name in ("TranscodeRequest", "CredentialsBody", "JobStatusBody", "TranscodeAccepted"):
        assert name in schemas
    header = [p for p in paths["/transcode"]["post"]["parameters"] if p["in"] == "header"]
    assert [p["name"] for p in header] == ["Idempotency-Key"]
    assert document["components"]["securitySchemes"]["euterpeApiKey"]["scheme"] == "bearer"


async def test_concurrent_identical_posts_make_one_job(world: World) -> None:
    answers: list[httpx.Response] = []

    async def post() -> None:
        answers.append(await world.post(key="same"))

    async with anyio.create_task_group() as group:
        for _ in range(10):
            group.start_soon(post)
    accepted = [a for a in answers if a.status_code == 202]
    in_flight = [a for a in answers if a.status_code == 409]
    assert len(accepted) + len(in_flight) == 10 and accepted
    assert {a.json()["job_id"] for a in accepted} == {accepted[0].json()["job_id"]}
    assert all(a.json()["error"] == "idempotency_in_flight" for a in in_flight)
    assert await world.rows(schema.inbox_jobs) == 1


async def test_answers_match_their_documented_models(world: World) -> None:
    posted = await world.post()
    TranscodeAccepted.model_validate(posted.json())
    job_id = uuid.UUID(posted.json()["job_id"])
    JobStatusBody.model_validate((await world.status(job_id)).json())
    other = uuid.UUID((await world.post(key="k-2")).json()["job_id"])
    await drive_to(world, job_id, "succeeded")
    await drive_to(world, other, "dead_letter")
    for job in (job_id, other):
        document = JobStatusBody.model_validate((await world.status(job)).json())
        assert (document.outputs is None) == (job == other)
        assert (document.error is None) == (job == job_id)


async def test_the_maintenance_loop_runs_until_stopped(world: World) -> None:
    job_id = uuid.UUID((await world.post()).json()["job_id"])
    assert (await world.jobs.claim(job_id, "dead-worker")).lease is not None
    world.clock.advance(31)
    service = EuterpeMaintenance(
        InboxMaintenance(world.jobs), config=MaintenanceConfig(interval_seconds=0.05)
    )

    async def reclaimed() -> bool:
        return (await world.status(job_id)).json()["status"] == "failed"

    async with anyio.create_task_group() as group:
        await service.start(group)
        await wait_until(
            "the loop to reclaim the expired lease",
            reclaimed,
            time.monotonic() + 20,
            describe=lambda: "still leased",
        )
        assert service.health.running
        await service.stop()
    assert not service.health.running


async def test_maintenance_prunes_the_receivers_expired_records(world: World) -> None:
    signer = WebhookSigner([MasterSecret("1", b"m" * 32)])
    receiver = WebhookReceiver(world.repo, signer.requester_secrets("acme"), clock=world.clock)
    event_id = uuid.uuid4()
    raw = json.dumps({"event_id": str(event_id)}).encode()
    headers = signer.headers("acme", event_id, raw, timestamp=int(world.clock.now().timestamp()))
    assert not (await receiver.verify_and_record(headers, raw)).duplicate
    service = EuterpeMaintenance(InboxMaintenance(world.jobs), receiver=receiver)
    assert (await service.run_once(prune=True)).nonces_pruned == 0
    world.clock.advance(timedelta(days=31).total_seconds())
    done = await service.run_once(prune=True)
    assert (done.nonces_pruned, done.events_pruned) == (1, 1)
