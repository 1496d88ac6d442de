"""One engine's run of ``python -m benchmarks.euterpe``: jobs, webhooks, one ffmpeg job.

:func:`run_engine` builds Euterpe's real parts on one fresh database (an
API key, a vault with a local KEK, a lite object store under a temporary
directory, :class:`~trace_core.euterpe.intake.Intake` over
:class:`~trace_core.euterpe.jobs.InboxJobs`) and measures, in this order:

1. ``jobs``: ``--jobs`` requests through ``Intake.enqueue`` (the API key
   checked, the body validated, the idempotency key claimed, the credentials
   sealed), then one :class:`~trace_core.euterpe.worker.EuterpeWorker` with
   the copy processor runs them until every one succeeded;
2. ``webhooks``: one :class:`~trace_core.euterpe.deliverer.WebhookDeliverer`
   posts every event those jobs wrote to the receiver process
   (:mod:`benchmarks._euterpe_receiver`), until every one was answered 2xx;
3. ``ffmpeg``: one job with the real ffmpeg processor on a test clip, its
   time split into Euterpe's own steps and ffmpeg's.

Then it checks, untimed, through the status read model: every job
``succeeded``, every event ``delivered``, and the receiver processed each
event id exactly once. Anything else raises :class:`BenchmarkFailed`.
"""

from __future__ import annotations

import json
import os
import random
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from benchmarks._euterpe_probes import (
    CountingPoster,
    Stopwatch,
    TimedJobs,
    TimedProcessor,
    TimedStorage,
)
from benchmarks._euterpe_receiver import ReceiverProcess
from trace_core.euterpe.api_keys import ApiKeys
from trace_core.euterpe.copy_processor import CopyProcessor
from trace_core.euterpe.credentials import CredentialVault
from trace_core.euterpe.deliverer import WebhookDeliverer
from trace_core.euterpe.deliverer_config import DelivererConfig
from trace_core.euterpe.intake import Intake
from trace_core.euterpe.jobs import JobsConfig
from trace_core.euterpe.processor import Processor
from trace_core.euterpe.requests import UrlPolicy
from trace_core.euterpe.webhook_poster import HttpxPoster
from trace_core.euterpe.worker import EuterpeWorker
from trace_core.euterpe.worker_config import WorkerConfig
from trace_core.euterpe.worker_job import WorkerParts
from trace_core.idempotency import IdempotencyStore
from trace_core.security.minting import LocalCredentialMinter, MintedCredentials
from trace_core.security.scopes import S3Prefix, Scope
from trace_core.security.webhook_signing import WebhookSigner
from trace_core.storage.sql import SqlRepository
from trace_lite.envelope import LocalKeyEncryption
from trace_lite.euterpe_ffmpeg import FfmpegProcessor
from trace_lite.euterpe_storage import LiteTranscodeStorage
from trace_lite.object_store import LocalObjectStore

__all__ = ["BenchmarkFailed", "Params", "run_engine"]

REQUESTER = "bench-requester"
BUCKET = "media"
FFMPEG_PRESET = "mp4-h264-360p"
_KEK_ID = "bench-kek"


class BenchmarkFailed(RuntimeError):
    """A job did not succeed or an event was not delivered exactly once."""


@dataclass(frozen=True)
class Params:
    """What one run does (the command's options)."""

    jobs: int
    source_bytes: int
    enqueue_concurrency: int
    concurrency: int
    batch_size: int
    deliverer_batch: int
    deliverer_concurrency: int
    poll_max_seconds: float
    timeout_seconds: float
    clip: Path | None
    """The ffmpeg part's source clip; None skips that part."""


@dataclass
class _World:
    repo: SqlRepository
    jobs: TimedJobs
    intake: Intake
    api_key: str
    vault: CredentialVault
    store: LocalObjectStore
    minter: LocalCredentialMinter
    scratch: Path

    async def credentials(self, read: str, write: str) -> dict[str, Any]:
        """Minted credentials in the body's wire form."""
        minted = await self.minter.mint(
            Scope(read=(S3Prefix.parse(read),), write=(S3Prefix.parse(write),)),
            session_name="bench",
            duration_seconds=43200,
        )
        return {
            "access_key_id": minted.access_key_id,
            "secret_access_key": minted.secret_access_key,
            "session_token": minted.session_token,
            "expiration": minted.expiration.isoformat(),
        }

    async def admin(self) -> MintedCredentials:
        return await self.minter.mint(
            Scope(
                read=(S3Prefix.parse(f"s3://{BUCKET}/x/"),),
                write=(S3Prefix.parse(f"s3://{BUCKET}/in/"),),
            ),
            session_name="bench-admin",
            duration_seconds=43200,
        )

    def worker(self, params: Params, processor: Processor, watch: Stopwatch) -> EuterpeWorker:
        """A worker whose lifecycle writes, storage calls and processor calls
        are all charged to ``watch``."""
        self.jobs.watch = watch
        poll = params.poll_max_seconds
        parts = WorkerParts(
            jobs=self.jobs,
            vault=self.vault,
            storage=TimedStorage(LiteTranscodeStorage(self.store), watch),
            processor=TimedProcessor(processor, watch),
            config=WorkerConfig(
                poll_min_seconds=poll / 3,
                poll_max_seconds=poll,
                batch_size=params.batch_size,
                concurrency=params.concurrency,
                temp_dir=self.scratch / "work",
            ),
        )
        return EuterpeWorker(parts, worker_id="bench-worker", rng=random.Random(7))


async def _world(url: str, scratch: Path) -> _World:
    repo = SqlRepository(url)
    jobs = TimedJobs(repo, config=JobsConfig())
    vault = CredentialVault({_KEK_ID: LocalKeyEncryption(os.urandom(32))}, active=_KEK_ID)
    keys = ApiKeys(repo)
    intake = Intake(
        repo,
        keys=keys,
        vault=vault,
        enqueuer=jobs,
        idempotency=IdempotencyStore(repo),
        url_policy=UrlPolicy(allow_loopback=True),  # the receiver is on this machine
    )
    minter = LocalCredentialMinter(os.urandom(32))
    (scratch / "store").mkdir(parents=True)
    (scratch / "work").mkdir()
    issued = await keys.issue(REQUESTER, label="benchmark")
    store = LocalObjectStore(scratch / "store", minter)
    return _World(repo, jobs, intake, issued.secret, vault, store, minter, scratch)


async def run_engine(
    params: Params, url: str, scratch: Path, receiver: ReceiverProcess, signer: WebhookSigner
) -> dict[str, Any]:
    """The three parts on database ``url`` (module docstring); the figures."""
    world = await _world(url, scratch)
    try:
        row = await _jobs_and_webhooks(params, world, receiver, signer)
        if params.clip is not None:
            row |= await _ffmpeg_job(params, world)
        return row
    finally:
        await world.repo.close()


# --- 1. jobs -----------------------------------------------------------------------


async def _bodies(params: Params, world: _World, hook_url: str) -> list[bytes]:
    """The requests, with their sources stored (untimed: the requester's work)."""
    admin = world.store.handle(await world.admin())
    rng = random.Random(11)
    creds = await world.credentials(f"s3://{BUCKET}/in/", f"s3://{BUCKET}/out/")
    bodies = []
    for i in range(params.jobs):
        source = f"s3://{BUCKET}/in/{i}.bin"
        admin.put(source, rng.randbytes(params.source_bytes))
        body = {
            "source": source,
            "output_prefix": f"s3://{BUCKET}/out/{i}/",
            "presets": [FFMPEG_PRESET],
            "status_webhook_url": hook_url,
            "storage_credentials": creds,
        }
        bodies.append(json.dumps(body).encode())
    return bodies


async def _enqueue(params: Params, world: _World, bodies: list[bytes]) -> list[uuid.UUID]:
    ids: list[uuid.UUID | None] = [None] * len(bodies)
    limit = anyio.Semaphore(params.enqueue_concurrency)

    async def one(index: int) -> None:
        async with limit:
            result = await world.intake.enqueue(
                api_key=world.api_key, idempotency_key=f"bench-{index}", body=bodies[index]
            )
            ids[index] = result.job_id

    async with anyio.create_task_group() as group:
        for index in range(len(bodies)):
            group.start_soon(one, index)
    return [i for i in ids if i is not None]


async def _drain(params: Params, world: _World, count: int) -> float:
    """Run the worker until ``count`` jobs succeeded; the seconds to the last success."""
    watch = Stopwatch()
    world.jobs.expect(count)
    worker = world.worker(params, CopyProcessor(), watch)
    began = time.perf_counter()
    with anyio.fail_after(params.timeout_seconds):
        async with anyio.create_task_group() as group:
            await worker.start(group)
            await world.jobs.finished.wait()
            await worker.stop()
    if world.jobs.failures:
        raise BenchmarkFailed(f"jobs did not succeed: {world.jobs.failures[:5]}")
    return world.jobs.last_success - began


async def _deliver(
    params: Params, world: _World, signer: WebhookSigner, events: int
) -> tuple[float, list[str]]:
    """Run a deliverer until ``events`` posts were answered 2xx; its seconds,
    and the non-2xx answers (none expected)."""
    poster = CountingPoster(HttpxPoster())
    poster.expect(events)
    poll = params.poll_max_seconds
    deliverer = WebhookDeliverer(
        world.repo,
        signer,
        poster,
        config=DelivererConfig(
            batch_size=params.deliverer_batch,
            concurrency=params.deliverer_concurrency,
            poll_min_seconds=poll / 3,
            poll_max_seconds=poll,
        ),
        worker_id="bench-deliverer",
        rng=random.Random(5),
    )
    try:
        began = time.perf_counter()
        with anyio.fail_after(params.timeout_seconds):
            async with anyio.create_task_group() as group:
                await deliverer.start(group)
                await poster.enough.wait()
                await deliverer.stop()  # the round in flight records its answers
        return time.perf_counter() - began, poster.other
    finally:
        await deliverer.aclose()


async def _jobs_and_webhooks(
    params: Params, world: _World, receiver: ReceiverProcess, signer: WebhookSigner
) -> dict[str, Any]:
    bodies = await _bodies(params, world, receiver.hook_url)
    began = time.perf_counter()
    job_ids = await _enqueue(params, world, bodies)
    enqueue_s = time.perf_counter() - began
    processing_s = await _drain(params, world, len(job_ids))

    statuses = [await world.jobs.status(job) for job in job_ids]
    not_done = [f"{s.job_id}: {s.status}" for s in statuses if s.status != "succeeded"]
    if len(job_ids) != params.jobs or not_done:
        raise BenchmarkFailed(
            f"{len(job_ids)}/{params.jobs} enqueued; not succeeded: {not_done[:5]}"
        )
    expected = {str(e.event_id) for s in statuses for e in s.events}

    before = (await receiver.stats(0)).total_processed
    delivery_s, refused = await _deliver(params, world, signer, len(expected))
    if refused:
        raise BenchmarkFailed(f"deliveries answered non-2xx: {refused[:5]}")
    seen = await receiver.stats(before)
    undelivered = [
        f"{e.event_id}: {e.status}"
        for job in job_ids
        for e in (await world.jobs.status(job)).events
        if e.status != "delivered"
    ]
    if undelivered:
        raise BenchmarkFailed(f"events not delivered: {undelivered[:5]}")
    if len(seen.processed) != len(set(seen.processed)) or set(seen.processed) != expected:
        raise BenchmarkFailed(
            f"the receiver processed {len(seen.processed)} deliveries "
            f"({len(set(seen.processed))} distinct) of {len(expected)} events"
        )
    if seen.rejected:
        raise BenchmarkFailed(f"the receiver refused {seen.rejected} deliveries")

    total_s = enqueue_s + processing_s
    return {
        "jobs": len(job_ids),
        "jobs_succeeded": len(statuses),
        "jobs_per_s": round(len(job_ids) / total_s, 1),
        "enqueue_s": round(enqueue_s, 3),
        "enqueue_per_s": round(len(job_ids) / enqueue_s, 1),
        "processing_s": round(processing_s, 3),
        "processing_per_s": round(len(job_ids) / processing_s, 1),
        "events": len(expected),
        "events_per_job": round(len(expected) / len(job_ids), 2),
        "events_processed_once": len(seen.processed),
        "duplicate_deliveries": seen.duplicates,
        "delivery_s": round(delivery_s, 3),
        "deliveries_per_s": round(len(expected) / delivery_s, 1),
    }


# --- 3. one ffmpeg job ------------------------------------------------------------------


async def _ffmpeg_job(params: Params, world: _World) -> dict[str, Any]:
    assert params.clip is not None
    admin = world.store.handle(await world.admin())
    source = f"s3://{BUCKET}/in/clip.mp4"
    admin.put(source, params.clip.read_bytes())
    body = {
        "source": source,
        "output_prefix": f"s3://{BUCKET}/out/clip/",
        "presets": [FFMPEG_PRESET],
        "storage_credentials": await world.credentials(
            f"s3://{BUCKET}/in/", f"s3://{BUCKET}/out/clip/"
        ),
    }
    result = await world.intake.enqueue(
        api_key=world.api_key, idempotency_key="bench-ffmpeg", body=json.dumps(body).encode()
    )
    watch = Stopwatch()
    world.jobs.expect(1)
    worker = world.worker(params, FfmpegProcessor(), watch)
    began = time.perf_counter()
    with anyio.fail_after(params.timeout_seconds):
        outcomes = await worker.run_once()
    job_s = time.perf_counter() - began
    if [(o.job_id, o.result) for o in outcomes] != [(result.job_id, "succeeded")]:
        raise BenchmarkFailed(f"the ffmpeg job did not succeed: {outcomes}")
    status = await world.jobs.status(result.job_id)
    if status.status != "succeeded" or not status.outputs:
        raise BenchmarkFailed(f"the ffmpeg job is {status.status}")
    job_ms = job_s * 1000
    ffmpeg_ms = watch.ms("processor")
    overhead_ms = job_ms - ffmpeg_ms
    steps = ("claim", "fetch", "upload", "state_writes")
    return {
        "ffmpeg_preset": FFMPEG_PRESET,
        "ffmpeg_output_bytes": int(status.outputs[0]["size"]),
        "ffmpeg_job_ms": round(job_ms, 2),
        "ffmpeg_ms": ffmpeg_ms,
        "euterpe_overhead_ms": round(overhead_ms, 2),
        "overhead_ratio": round(overhead_ms / ffmpeg_ms, 4) if ffmpeg_ms else None,
        **{f"overhead_{step}_ms": watch.ms(step) for step in steps},
        "overhead_other_ms": round(overhead_ms - sum(watch.ms(s) for s in steps), 2),
    }
