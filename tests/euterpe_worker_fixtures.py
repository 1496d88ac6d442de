"""Shared parts of the Euterpe worker tests: a lite object store with minted
credentials, a vault, the job lifecycle on a manual clock, test clips made
with ffmpeg's own sources, a small HMAC signer, and test processors."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import random
import secrets
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
import uvicorn

from tests.factories import wait_until
from tests.test_e2e_http import _free_port
from trace_core.clock import ManualClock
from trace_core.euterpe.credentials import (
    CredentialVault,
    StorageCredentials,
    refresh_credentials,
)
from trace_core.euterpe.jobs import InboxJobs, JobsConfig
from trace_core.euterpe.presets import Preset
from trace_core.euterpe.processor import ProducedOutput, describe_output, output_path
from trace_core.euterpe.receiver import read_request_body
from trace_core.euterpe.refresh import CredentialRefresher
from trace_core.euterpe.requests import UrlPolicy
from trace_core.euterpe.storage_access import StorageHandle
from trace_core.retry import Backoff, RetryPolicy
from trace_core.security.minting import LocalCredentialMinter, MintedCredentials
from trace_core.security.scopes import S3Prefix, Scope
from trace_core.storage.protocol import Repository
from trace_lite.envelope import LocalKeyEncryption
from trace_lite.object_store import LocalObjectStore

BUCKET = "media"
SOURCE = f"s3://{BUCKET}/in/clip.mp4"
REQUESTER = "acme"
LEASE_SECONDS = 30.0
MASTER_SECRET = b"test-master-secret-for-refresh-signing"


def make_clip(path: Path, seconds: float = 1.0, *, audio: bool = True) -> Path:
    """A tiny H.264 (+AAC) clip from ffmpeg's test sources."""
    command = [
        "ffmpeg",
        "-nostdin",
        "-y",
        "-hide_banner",
        "-loglevel",
        "error",
        "-f",
        "lavfi",
        "-i",
        f"testsrc=size=160x120:rate=10:duration={seconds}",
    ]
    if audio:
        command += ["-f", "lavfi", "-i", f"sine=frequency=440:duration={seconds}"]
    command += ["-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p"]
    if audio:
        command += ["-c:a", "aac", "-shortest"]
    command.append(str(path))
    subprocess.run(command, check=True, timeout=60)
    return path


def requester_secret(requester_id: str) -> bytes:
    """The tests' per-requester secret, derived from a master secret."""
    return hmac.digest(MASTER_SECRET, requester_id.encode(), hashlib.sha256)


def sign(requester_id: str, body: bytes) -> dict[str, str]:
    """A webhook-style signer: HMAC-SHA256 over ``timestamp.nonce.body``."""
    ts, nonce = str(int(time.time())), secrets.token_urlsafe(18)
    mac = hmac.digest(requester_secret(requester_id), f"{ts}.{nonce}.".encode() + body, "sha256")
    return {
        "x-euterpe-signature": "v1," + base64.b64encode(mac).decode(),
        "x-euterpe-timestamp": ts,
        "x-euterpe-nonce": nonce,
        "x-euterpe-event-id": nonce,
    }


def verify(requester_id: str, headers: Mapping[str, str], body: bytes) -> bool:
    """Whether ``headers`` sign ``body`` for ``requester_id`` (constant time)."""
    ts, nonce = headers.get("x-euterpe-timestamp", ""), headers.get("x-euterpe-nonce", "")
    given = headers.get("x-euterpe-signature", "").removeprefix("v1,")
    mac = hmac.digest(requester_secret(requester_id), f"{ts}.{nonce}.".encode() + body, "sha256")
    return hmac.compare_digest(base64.b64encode(mac).decode().encode(), given.encode())


@dataclass
class Env:
    """A worker's world: the store, its minter, the vault and the lifecycle."""

    repo: Repository
    clock: ManualClock
    root: Path
    minter: LocalCredentialMinter
    store: LocalObjectStore
    vault: CredentialVault
    jobs: InboxJobs
    work_dir: Path
    admin: MintedCredentials = field(init=False)
    secrets: list[str] = field(default_factory=list)
    """Every secret and session token minted for jobs (none may be logged)."""

    async def setup(self) -> Env:
        self.admin = await self.minter.mint(
            Scope(
                read=(S3Prefix.parse(f"s3://{BUCKET}/x/"),),
                write=(S3Prefix.parse(f"s3://{BUCKET}/in/"),),
            ),
            session_name="admin",
            duration_seconds=43200,
        )
        return self

    def put_source(self, data: bytes, uri: str = SOURCE) -> None:
        self.store.handle(self.admin).put(uri, data)

    async def credentials(
        self, output_prefix: str, *, read: str = f"s3://{BUCKET}/in/"
    ) -> StorageCredentials:
        minted = await self.minter.mint(
            Scope(read=(S3Prefix.parse(read),), write=(S3Prefix.parse(output_prefix),)),
            session_name="job",
            duration_seconds=43200,
        )
        self.secrets += [minted.secret_access_key, minted.session_token]
        return StorageCredentials(
            minted.access_key_id,
            minted.secret_access_key,
            minted.session_token,
            minted.expiration,
        )

    async def enqueue(
        self,
        presets: Sequence[str] = ("mp4-h264-360p",),
        *,
        read: str = f"s3://{BUCKET}/in/",
        refresh_url: str | None = None,
        max_attempts: int | None = None,
    ) -> tuple[uuid.UUID, str]:
        job_id = uuid.uuid4()
        prefix = f"s3://{BUCKET}/out/{job_id}/"
        sealed = self.vault.seal(
            await self.credentials(prefix, read=read),
            job_id=job_id,
            requester_id=REQUESTER,
            credential_version=0,
        )
        request = {
            "source": SOURCE,
            "output_prefix": prefix,
            "presets": list(presets),
            "status_webhook_url": "https://hooks.example/acme",
            "refresh_url": refresh_url,
        }
        await self.jobs.enqueue(
            requester_id=REQUESTER,
            request=request,
            job_id=job_id,
            status_webhook_url=request["status_webhook_url"],
            refresh_url=refresh_url,
            sealed=sealed,
            max_attempts=max_attempts,
        )
        return job_id, prefix

    def stored(self, prefix: str) -> list[Path]:
        """Files the store holds under an ``s3://`` prefix (admin's view)."""
        bucket, _, key = prefix.removeprefix("s3://").partition("/")
        base = self.root / bucket / key
        return sorted(p for p in base.rglob("*") if p.is_file()) if base.exists() else []

    def leftovers(self) -> list[Path]:
        """What the worker left in its temporary directory (must be nothing)."""
        return sorted(self.work_dir.rglob("*"))


async def make_env(repo: Repository, clock: ManualClock, tmp_path: Path, **jobs_kw: Any) -> Env:
    root = tmp_path / "store"
    root.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    minter = LocalCredentialMinter(os.urandom(32), clock=clock)
    jobs = InboxJobs(
        repo,
        clock=clock,
        config=JobsConfig(lease_seconds=LEASE_SECONDS, max_attempts=jobs_kw.pop("max_attempts", 2)),
        retry=RetryPolicy(
            normal=Backoff(base_seconds=1, cap_seconds=1, jitter=0.0),
            max_credential_refreshes=jobs_kw.pop("max_credential_refreshes", 3),
        ),
        rng=random.Random(3),
    )
    vault = CredentialVault({"k1": LocalKeyEncryption(os.urandom(32))}, active="k1")
    env = Env(repo, clock, root, minter, LocalObjectStore(root, minter), vault, jobs, work)
    return await env.setup()


class RaisingProcessor:
    """Crashes every time (an unexpected processor failure)."""

    def __init__(self) -> None:
        self.calls = 0

    async def process(
        self, source: Path, presets: Sequence[Preset], output_dir: Path, stop: anyio.Event
    ) -> list[ProducedOutput]:
        self.calls += 1
        (output_dir / "partial.tmp").write_bytes(b"half an output")
        raise RuntimeError("the processor broke")


class OverproducingProcessor:
    """Writes outputs ``factor`` times the source's size."""

    def __init__(self, factor: int = 3) -> None:
        self.factor = factor

    async def process(
        self, source: Path, presets: Sequence[Preset], output_dir: Path, stop: anyio.Event
    ) -> list[ProducedOutput]:
        data = await anyio.Path(source).read_bytes() * self.factor
        produced = []
        for preset in presets:
            target = output_path(output_dir, preset)
            await anyio.Path(target).write_bytes(data)
            produced.append(await describe_output(preset, target))
        return produced


class LyingHandle:
    """A handle whose ``size`` says ``claimed`` bytes whatever the object holds,
    recording the calls made."""

    def __init__(self, inner: StorageHandle, claimed: int | None, calls: list[str]) -> None:
        self.inner, self.claimed, self.calls = inner, claimed, calls

    async def size(self, uri: str) -> int:
        self.calls.append("size")
        real = await self.inner.size(uri)
        return real if self.claimed is None else self.claimed

    async def download(self, uri: str, path: Path, max_bytes: int) -> int:
        self.calls.append("download")
        return await self.inner.download(uri, path, max_bytes)

    async def upload(self, path: Path, uri: str) -> None:
        self.calls.append("upload")
        await self.inner.upload(path, uri)


class RecordingStorage:
    """A storage whose handles are :class:`LyingHandle` over another storage's."""

    def __init__(self, inner: Any, claimed: int | None = None) -> None:
        self.inner, self.claimed = inner, claimed
        self.calls: list[str] = []

    def open(self, credentials: StorageCredentials) -> StorageHandle:
        return LyingHandle(self.inner.open(credentials), self.claimed, self.calls)


class RefreshEndpoint:
    """The requester's side of a refresh, as a real local HTTP server: it
    checks the signature, then replaces the job's credentials (the
    ``inbox_credentials`` area's guarded replace, sealed by the vault) when
    ``replace`` is set."""

    def __init__(
        self,
        env: Env,
        *,
        replace: bool,
        credentials: Callable[[uuid.UUID], Awaitable[StorageCredentials]] | None = None,
    ) -> None:
        self.env, self.replace = env, replace
        self.mint = credentials or (lambda job_id: env.credentials(f"s3://media/out/{job_id}/"))
        self.calls: list[dict[str, Any]] = []
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/refresh"

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = await read_request_body(receive)
        if body is None:
            return  # the client left mid-request: nothing to verify or answer
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        document = json.loads(body)
        ok = verify(REQUESTER, headers, body)
        self.calls.append({"signed": ok, "body": document})
        status = 401
        if ok:
            status = 204
            if self.replace:
                job_id = uuid.UUID(document["job_id"])
                status = await self._replace(job_id, document["credential_version"])
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def _replace(self, job_id: uuid.UUID, version: int) -> int:
        await refresh_credentials(
            self.env.repo,
            self.env.vault,
            job_id=job_id,
            requester_id=REQUESTER,
            expected_version=version,
            credentials=await self.mint(job_id),
            clock=self.env.clock,
        )
        return 204


@pytest.fixture
async def serve() -> AsyncIterator[Any]:
    async with anyio.create_task_group() as group:
        servers: list[uvicorn.Server] = []

        async def start(endpoint: RefreshEndpoint) -> RefreshEndpoint:
            server = uvicorn.Server(
                uvicorn.Config(
                    endpoint,
                    host="127.0.0.1",
                    port=endpoint.port,
                    log_level="warning",
                    lifespan="off",
                )
            )
            servers.append(server)
            group.start_soon(server.serve)
            await wait_until(
                "the refresh endpoint started",
                lambda: server.started,
                time.monotonic() + 10,
                describe=lambda: "not started",
            )
            return endpoint

        yield start
        for server in servers:
            server.should_exit = True


def refresher() -> CredentialRefresher:
    return CredentialRefresher(sign, url_policy=UrlPolicy(allow_loopback=True))
