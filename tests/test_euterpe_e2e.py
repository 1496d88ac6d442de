"""Euterpe end to end (issue 16), on both engines: ``POST /transcode`` over
real HTTP -> the in-process worker transcodes with ffmpeg -> the outputs are
in the object store -> signed webhooks reach a local receiver built on the
receiver helper, in the order of the stages -> ``GET /transcode/status``
says succeeded. The server is what ``trace-lite euterpe serve --workers 1``
runs (:func:`trace_lite.euterpe_runtime.build_server`, served by
:func:`trace_core.api.transcode_serving.serve_transcode`).

A second run goes through the credential refresh of §7 with the API: the
store refuses the job's credentials, the worker's signed call reaches the
requester's ``refresh_url``, which verifies it with its webhook secret and
answers with ``PUT /transcode/{job_id}/credentials``; the job then succeeds.

The first run captures every log record (DEBUG, every logger) and every HTTP
answer and webhook body, and finds no plaintext credential in any of them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import uvicorn

from tests.euterpe_worker_fixtures import make_clip
from tests.factories import wait_until
from tests.test_e2e_http import _free_port
from trace_core.api.transcode_serving import serve_transcode
from trace_core.clock import SystemClock
from trace_core.euterpe.api_keys import ApiKeys
from trace_core.euterpe.copy_processor import CopyProcessor
from trace_core.euterpe.receiver import WebhookReceiver, read_request_body
from trace_core.euterpe.requests import UrlPolicy
from trace_core.security.minting import LocalCredentialMinter
from trace_core.security.scopes import S3Prefix, Scope
from trace_core.security.webhook_signing import WebhookRejected, WebhookVerifier
from trace_core.storage.sql import SqlRepository
from trace_lite.euterpe_ffmpeg import FfmpegProcessor
from trace_lite.euterpe_runtime import (
    EuterpeOptions,
    build_server,
    load_webhook_signer,
    object_storage,
)
from trace_lite.serve import read_minter_key

pytestmark = pytest.mark.anyio

DEADLINE_SECONDS = 90.0
"""Bound on the whole job (a one-second clip transcodes in about a second)."""
STAGES = ["queued", "claimed", "fetching", "processing", "uploading", "succeeded"]
PRESETS = ["mp4-h264-360p", "audio-aac-128k"]


class WebhookEndpoint:
    """The requester's webhook endpoint: the receiver helper verifies and
    records each delivery; the events accepted are kept in arrival order."""

    def __init__(self, receiver: WebhookReceiver) -> None:
        self.receiver = receiver
        self.accepted: list[dict[str, Any]] = []
        self.duplicates = 0
        self.refused: list[str] = []
        self.bodies: list[bytes] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = await read_request_body(receive)
        if body is None:
            return  # the client left mid-request: nothing to verify or answer
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.bodies.append(body)
        status = 204
        try:
            accepted = await self.receiver.verify_and_record(headers, body)
        except WebhookRejected as exc:
            self.refused.append(f"{exc.code}: {exc}")
            status = exc.http_status
        else:
            if accepted.duplicate:
                self.duplicates += 1
            else:
                self.accepted.append(dict(accepted.event))
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})


async def _started(server: uvicorn.Server) -> None:
    await wait_until(
        "a server started",
        lambda: server.started,
        time.monotonic() + 20,
        describe=lambda: "not started",
    )


@pytest.fixture
async def receiver_server() -> AsyncIterator[Any]:
    servers: list[uvicorn.Server] = []
    async with anyio.create_task_group() as group:

        async def start(app: Any) -> str:
            port = _free_port()
            server = uvicorn.Server(
                uvicorn.Config(
                    app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"
                )
            )
            servers.append(server)
            group.start_soon(server.serve)
            await _started(server)
            return f"http://127.0.0.1:{port}"

        yield start
        for server in servers:
            server.should_exit = True


async def test_post_to_ffmpeg_to_signed_webhooks_to_status(
    repo: SqlRepository,
    database_url: str,
    tmp_path: Path,
    receiver_server: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    data_dir = tmp_path / "data"
    options = EuterpeOptions(
        database_url=database_url,
        data_dir=data_dir,
        url_policy=UrlPolicy(allow_loopback=True),
        workers=1,
        port=_free_port(),
        log_level="warning",
    )
    vault, signer = options.vault(), load_webhook_signer(data_dir)
    storage = object_storage(data_dir)
    server = build_server(
        options, repo, vault=vault, signer=signer, storage=storage, processor=FfmpegProcessor()
    )

    # The requester: an API key, its webhook secret, a clip in the store and
    # credentials scoped to read it and write under its output prefix.
    issued = await ApiKeys(repo).issue("acme")
    secret = bytes.fromhex(signer.requester_secret_hex("acme"))
    endpoint = WebhookEndpoint(WebhookReceiver(repo, [secret]))
    hook_url = await receiver_server(endpoint) + "/euterpe"
    minter = LocalCredentialMinter(read_minter_key(data_dir), clock=SystemClock())
    admin = await minter.mint(
        Scope(
            read=(S3Prefix.parse("s3://media/none/"),), write=(S3Prefix.parse("s3://media/in/"),)
        ),
        session_name="admin",
        duration_seconds=3600,
    )
    clip = make_clip(tmp_path / "clip.mp4", 1.0)
    storage.store.handle(admin).put("s3://media/in/clip.mp4", clip.read_bytes())
    minted = await minter.mint(
        Scope(read=(S3Prefix.parse("s3://media/in/"),), write=(S3Prefix.parse("s3://media/out/"),)),
        session_name="job",
        duration_seconds=3600,
    )
    plaintext = [minted.secret_access_key, minted.session_token, issued.secret]
    request = {
        "source": "s3://media/in/clip.mp4",
        "output_prefix": "s3://media/out/clip/",
        "presets": PRESETS,
        "status_webhook_url": hook_url,
        "storage_credentials": {
            "access_key_id": minted.access_key_id,
            "secret_access_key": minted.secret_access_key,
            "session_token": minted.session_token,
            "expiration": minted.expiration.isoformat(),
        },
    }
    answers: list[httpx.Response] = []
    base = f"http://127.0.0.1:{options.port}"
    auth = {"Authorization": f"Bearer {issued.secret}"}
    deadline = time.monotonic() + DEADLINE_SECONDS

    shutdown = anyio.Event()
    async with anyio.create_task_group() as group, httpx.AsyncClient(base_url=base) as http:
        group.start_soon(
            lambda: serve_transcode(
                server.app,
                host=options.host,
                port=options.port,
                log_level="warning",
                beside=server.services,
                shutdown=shutdown,
                handle_signals=False,
            )
        )

        async def up() -> bool:
            try:
                return (await http.get("/openapi.json")).status_code == 200
            except httpx.TransportError:
                return False

        await wait_until("the API to answer", up, deadline, describe=lambda: "no answer")
        posted = await http.post(
            "/transcode", json=request, headers={**auth, "Idempotency-Key": "clip-1"}
        )
        answers.append(posted)
        assert posted.status_code == 202, posted.text
        job_id = posted.json()["job_id"]

        async def finished() -> bool:
            answer = await http.get(posted.json()["status_url"], headers=auth)
            answers.append(answer)
            document = answer.json()
            return document["status"] in ("succeeded", "dead_letter") and all(
                w["status"] == "delivered" for w in document["webhooks"]
            )

        await wait_until(
            "the job to succeed and its webhooks to be delivered",
            finished,
            deadline,
            describe=lambda: answers[-1].text,
        )
        status = answers[-1].json()
        # A replay of the POST answers the same job, still.
        replay = await http.post(
            "/transcode", json=request, headers={**auth, "Idempotency-Key": "clip-1"}
        )
        answers.append(replay)
        shutdown.set()  # a graceful stop: the services end, then the server
    await server.deliverer.aclose()

    assert status["status"] == "succeeded", status
    assert [h["to"] for h in status["history"]] == STAGES
    assert (status["attempt_count"], status["credential_refresh_count"]) == (1, 0)
    assert replay.status_code == 202 and replay.json()["job_id"] == job_id

    # The outputs are in the object store, as the status and the event say.
    outputs = {o["preset"]: o for o in status["outputs"]}
    assert set(outputs) == set(PRESETS)
    for output in outputs.values():
        path = data_dir / "objects" / output["key"].removeprefix("s3://")
        assert output["key"].startswith("s3://media/out/clip/")
        data = path.read_bytes()
        assert len(data) == output["size"] > 0
        assert hashlib.sha256(data).hexdigest() == output["sha256"]
    assert (data_dir / "objects/media/out/clip/mp4-h264-360p.mp4").read_bytes()[4:8] == b"ftyp"

    # Signed webhooks, verified by the receiver helper, one per stage, in order.
    assert endpoint.refused == []
    assert [e["event_type"] for e in endpoint.accepted] == [f"transcode.{s}" for s in STAGES]
    assert [e["sequence"] for e in endpoint.accepted] == list(range(1, len(STAGES) + 1))
    assert all(e["job_id"] == job_id for e in endpoint.accepted)
    assert endpoint.accepted[-1]["outputs"] == status["outputs"]
    assert [w["event_id"] for w in status["webhooks"]] == [e["event_id"] for e in endpoint.accepted]

    # No plaintext credential anywhere: logs, HTTP answers, webhook bodies.
    seen = [caplog.text, *(a.text for a in answers), *(b.decode() for b in endpoint.bodies)]
    seen += [json.dumps(r.__dict__, default=str) for r in caplog.records]
    for value in plaintext:
        for text in seen:
            assert value not in text
    assert len(caplog.records) > 0  # the capture did see the run


class RefreshEndpoint:
    """The requester's ``refresh_url``: verifies the worker's signed call with
    the requester's webhook secret, mints credentials that do reach the
    source, and answers by ``PUT /transcode/{job_id}/credentials`` through
    the API (``api``), as a requester would."""

    def __init__(self, verifier: WebhookVerifier, api: httpx.AsyncClient, mint: Any) -> None:
        self.verifier, self.api, self.mint = verifier, api, mint
        self.calls: list[dict[str, Any]] = []
        self.puts: list[httpx.Response] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = await read_request_body(receive)
        if body is None:
            return  # the client left mid-request: nothing to verify or answer
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        status = 204
        try:
            self.verifier.verify(headers, body)
        except WebhookRejected:
            status = 401
        else:
            call = json.loads(body)
            self.calls.append(call)
            put = await self.api.put(
                f"/transcode/{call['job_id']}/credentials",
                json={
                    "credential_version": call["credential_version"],
                    "storage_credentials": await self.mint(),
                },
            )
            self.puts.append(put)
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})


async def test_a_refused_credential_is_refreshed_through_the_api(
    repo: SqlRepository, database_url: str, tmp_path: Path, receiver_server: Any
) -> None:
    data_dir = tmp_path / "data"
    options = EuterpeOptions(
        database_url=database_url,
        data_dir=data_dir,
        url_policy=UrlPolicy(allow_loopback=True),
        workers=1,
    )
    vault, signer = options.vault(), load_webhook_signer(data_dir)
    storage = object_storage(data_dir)
    server = build_server(
        options, repo, vault=vault, signer=signer, storage=storage, processor=CopyProcessor()
    )
    issued = await ApiKeys(repo).issue("acme")
    minter = LocalCredentialMinter(read_minter_key(data_dir), clock=SystemClock())

    async def mint(read: str) -> dict[str, Any]:
        minted = await minter.mint(
            Scope(read=(S3Prefix.parse(read),), write=(S3Prefix.parse("s3://media/out/"),)),
            session_name="job",
            duration_seconds=3600,
        )
        return {
            "access_key_id": minted.access_key_id,
            "secret_access_key": minted.secret_access_key,
            "session_token": minted.session_token,
            "expiration": minted.expiration.isoformat(),
        }

    source = data_dir / "objects" / "media" / "in" / "clip.bin"
    source.parent.mkdir(parents=True)
    source.write_bytes(b"a source" * 64)
    auth = {"Authorization": f"Bearer {issued.secret}"}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=server.app), base_url="http://euterpe", headers=auth
    ) as api:
        secret = bytes.fromhex(signer.requester_secret_hex("acme"))
        endpoint = RefreshEndpoint(WebhookVerifier([secret]), api, lambda: mint("s3://media/in/"))
        refresh_url = await receiver_server(endpoint) + "/refresh"
        posted = await api.post(
            "/transcode",
            headers={"Idempotency-Key": "refresh-1"},
            json={
                "source": "s3://media/in/clip.bin",
                "output_prefix": "s3://media/out/clip/",
                "presets": ["mp4-h264-360p"],
                "refresh_url": refresh_url,
                # Scoped to another prefix: the store refuses the source (403).
                "storage_credentials": await mint("s3://media/elsewhere/"),
            },
        )
        assert posted.status_code == 202, posted.text
        job_id = posted.json()["job_id"]

        [outcome] = await server.workers[0].run_once()
        status = (await api.get("/transcode/status", params={"job_id": job_id})).json()

    assert outcome.result == "succeeded", outcome
    assert endpoint.calls == [{"credential_version": 0, "job_id": job_id}]
    assert [p.status_code for p in endpoint.puts] == [200]
    assert endpoint.puts[0].json()["credential_version"] == 1
    assert status["status"] == "succeeded"
    # One refresh, one execution attempt: the refresh spent no attempt (§5).
    assert (status["credential_refresh_count"], status["attempt_count"]) == (1, 1)
    out = data_dir / "objects" / "media" / "out" / "clip" / "mp4-h264-360p.mp4"
    assert out.read_bytes() == source.read_bytes()
    await server.deliverer.aclose()
