"""The Euterpe worker on both engines with the lite store: the stage machine,
failures through the retry policy, disk safety (§11), and the credential
refresh of §7 against a real local HTTP refresh endpoint."""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest

import tests.euterpe_worker_fixtures as fx
from tests.euterpe_worker_fixtures import (
    REQUESTER,
    Env,
    OverproducingProcessor,
    RaisingProcessor,
    RecordingStorage,
    RefreshEndpoint,
    make_env,
    refresher,
    sign,
)
from tests.factories import wait_until
from trace_core.clock import ManualClock
from trace_core.errors import ConfigurationError
from trace_core.euterpe.copy_processor import CopyProcessor
from trace_core.euterpe.job_maintenance import InboxMaintenance
from trace_core.euterpe.processor import Processor
from trace_core.euterpe.refresh import CredentialRefresher, refresh_body
from trace_core.euterpe.requests import UrlPolicy
from trace_core.euterpe.storage_access import TranscodeStorage
from trace_core.euterpe.worker import EuterpeWorker
from trace_core.euterpe.worker_config import WorkerConfig
from trace_core.euterpe.worker_job import WorkerParts
from trace_core.storage.sql import SqlRepository
from trace_lite.euterpe_storage import LiteTranscodeStorage

pytestmark = pytest.mark.anyio

SOURCE_BYTES = b"not really a video, but bytes to copy " * 40
STAGES = [
    (None, "queued"),
    ("queued", "claimed"),
    ("claimed", "fetching"),
    ("fetching", "processing"),
    ("processing", "uploading"),
    ("uploading", "succeeded"),
]


@pytest.fixture
async def env(repo: SqlRepository, clock: ManualClock, tmp_path: Path) -> Env:
    e = await make_env(repo, clock, tmp_path)
    e.put_source(SOURCE_BYTES)
    return e


def worker(
    env: Env,
    processor: Processor | None = None,
    *,
    storage: TranscodeStorage | None = None,
    refresher: CredentialRefresher | None = None,
    **config: Any,
) -> EuterpeWorker:
    config.setdefault("heartbeat_seconds", 0.05)
    parts = WorkerParts(
        jobs=env.jobs,
        vault=env.vault,
        storage=storage or LiteTranscodeStorage(env.store),
        processor=processor or CopyProcessor(),
        config=WorkerConfig(temp_dir=env.work_dir, **config),
        refresher=refresher,
    )
    return EuterpeWorker(parts, worker_id="w-test")


async def history(env: Env, job: uuid.UUID) -> list[tuple[str | None, str]]:
    status = await env.jobs.status(job)
    return [(h.from_status, h.to_status) for h in status.history]


# --- the stage machine ----------------------------------------------------------------


async def test_a_job_walks_every_stage_and_its_outputs_are_stored(env: Env) -> None:
    job, prefix = await env.enqueue(["mp4-h264-360p", "audio-aac-128k"])
    outcomes = await worker(env).run_once()
    assert [(o.job_id, o.result) for o in outcomes] == [(job, "succeeded")]
    status = await env.jobs.status(job)
    assert status.status == "succeeded" and status.attempt_count == 1
    assert await history(env, job) == STAGES
    digest = hashlib.sha256(SOURCE_BYTES).hexdigest()
    assert status.outputs == [
        {
            "key": f"{prefix}mp4-h264-360p.mp4",
            "preset": "mp4-h264-360p",
            "size": len(SOURCE_BYTES),
            "sha256": digest,
        },
        {
            "key": f"{prefix}audio-aac-128k.m4a",
            "preset": "audio-aac-128k",
            "size": len(SOURCE_BYTES),
            "sha256": digest,
        },
    ]
    assert [p.name for p in env.stored(prefix)] == ["audio-aac-128k.m4a", "mp4-h264-360p.mp4"]
    assert env.leftovers() == []


async def test_nothing_to_claim_is_an_empty_round(env: Env) -> None:
    assert await worker(env).run_once() == []
    with pytest.raises(ConfigurationError, match="heartbeat_seconds must be shorter"):
        worker(env, heartbeat_seconds=30.0)


async def test_the_running_service_keeps_its_slots_busy_until_stopped(env: Env) -> None:
    jobs = [(await env.enqueue())[0] for _ in range(5)]
    w = worker(env, concurrency=2, batch_size=1, poll_min_seconds=0.01, poll_max_seconds=0.02)

    async def done() -> bool:
        return all([(await env.jobs.status(j)).status == "succeeded" for j in jobs])

    async with anyio.create_task_group() as group:
        await w.start(group)
        await wait_until("every job succeeded", done, time.monotonic() + 30, describe=lambda: "")
        await w.stop()
    assert w.health.running is False and w.active == 0
    assert env.leftovers() == []


def test_settings_are_validated_with_their_name(tmp_path: Path) -> None:
    for bad, name in [
        ({"batch_size": 26}, "batch_size"),
        ({"concurrency": 0}, "concurrency"),
        ({"poll_min_seconds": 2.0, "poll_max_seconds": 1.0}, "poll_min_seconds"),
        ({"max_source_bytes": 0}, "max_source_bytes"),
        ({"max_output_ratio": 0}, "max_output_ratio"),
        ({"temp_dir": tmp_path / "missing"}, "temp_dir"),
    ]:
        with pytest.raises(ConfigurationError, match=name):
            WorkerConfig(**bad)
    assert WorkerConfig().output_limit(10**9) is None
    assert WorkerConfig().output_limit(10**9 + 1) == 2 * (10**9 + 1)


# --- failures -------------------------------------------------------------------------


async def test_a_raising_processor_is_retried_then_dead_lettered_through_failed(
    env: Env, clock: ManualClock
) -> None:
    job, prefix = await env.enqueue()
    processor = RaisingProcessor()
    w = worker(env, processor)
    first = await w.run_once()
    assert [(o.result, o.path) for o in first] == [("failed", ("failed",))]
    assert env.leftovers() == []
    clock.advance(5)
    assert await InboxMaintenance(env.jobs).requeue_due() == [job]
    second = await w.run_once()
    assert [(o.result, o.path) for o in second] == [("failed", ("failed", "dead_letter"))]
    status = await env.jobs.status(job)
    assert status.status == "dead_letter" and status.attempt_count == 2
    assert status.error is not None and status.error.code == "worker_error"
    assert status.error.retryable and "RuntimeError" in status.error.message
    steps = await history(env, job)
    assert steps[-3:] == [
        ("fetching", "processing"),
        ("processing", "failed"),
        ("failed", "dead_letter"),
    ]
    assert ("processing", "failed") in steps[:-3] and ("failed", "queued") in steps
    assert processor.calls == 2
    assert env.leftovers() == [] and env.stored(prefix) == []


async def test_a_missing_source_is_fatal(env: Env) -> None:
    (env.root / "media" / "in" / "clip.mp4").unlink()
    job, _ = await env.enqueue()
    [outcome] = await worker(env).run_once()
    assert outcome.path == ("failed", "dead_letter")
    status = await env.jobs.status(job)
    assert status.error is not None and status.error.code == "source_not_found"
    assert env.leftovers() == []


async def test_a_stored_request_that_does_not_read_fails_for_good(env: Env) -> None:
    job = await env.jobs.enqueue(requester_id=REQUESTER, request={"source": 3})
    [outcome] = await worker(env).run_once()
    assert outcome.path == ("failed", "dead_letter")
    status = await env.jobs.status(job)
    assert status.error is not None and status.error.code == "invalid_request"


# --- disk safety (§11) ----------------------------------------------------------------


async def test_a_source_over_the_maximum_is_refused_before_download(env: Env) -> None:
    job, _ = await env.enqueue()
    storage = RecordingStorage(LiteTranscodeStorage(env.store))
    [outcome] = await worker(env, storage=storage, max_source_bytes=100).run_once()
    assert outcome.path == ("failed", "dead_letter")
    assert storage.calls == ["size"]  # never downloaded
    status = await env.jobs.status(job)
    assert status.error is not None and status.error.code == "source_too_large"
    assert str(len(SOURCE_BYTES)) in status.error.message
    assert env.leftovers() == []


async def test_a_lying_size_is_caught_while_streaming(env: Env) -> None:
    job, _ = await env.enqueue()
    storage = RecordingStorage(LiteTranscodeStorage(env.store, chunk_bytes=64), claimed=10)
    [outcome] = await worker(env, storage=storage, max_source_bytes=100).run_once()
    assert storage.calls == ["size", "download"]
    assert outcome.path == ("failed", "dead_letter")
    status = await env.jobs.status(job)
    assert status.error is not None and status.error.code == "source_too_large"
    assert "more than that" in status.error.message
    assert env.leftovers() == []


async def test_an_overproducing_processor_is_refused(env: Env) -> None:
    job, prefix = await env.enqueue()
    w = worker(env, OverproducingProcessor(factor=3), output_limit_threshold_bytes=100)
    [outcome] = await w.run_once()
    assert outcome.path == ("failed", "dead_letter")
    status = await env.jobs.status(job)
    assert status.error is not None and status.error.code == "output_too_large"
    assert (await history(env, job))[-3] == ("processing", "uploading")
    assert env.stored(prefix) == [] and env.leftovers() == []
    # under the threshold the same outputs are fine (200 % applies to large sources only)
    _, prefix2 = await env.enqueue()
    ok = worker(env, OverproducingProcessor(factor=3), output_limit_threshold_bytes=10**9)
    assert [o.result for o in await ok.run_once()] == ["succeeded"]
    assert len(env.stored(prefix2)) == 1


# --- credential refresh (§7) ----------------------------------------------------------


serve = fx.serve


async def test_a_refused_credential_is_refreshed_and_the_job_succeeds(
    env: Env, serve: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    endpoint = await serve(RefreshEndpoint(env, replace=True))
    # credentials that may read elsewhere only: the store answers 403
    job, prefix = await env.enqueue(read="s3://media/elsewhere/", refresh_url=endpoint.url)
    [outcome] = await worker(env, refresher=refresher()).run_once()
    assert outcome.result == "succeeded"
    assert endpoint.calls == [
        {"signed": True, "body": {"credential_version": 0, "job_id": str(job)}}
    ]
    status = await env.jobs.status(job)
    assert status.status == "succeeded"
    assert (status.attempt_count, status.credential_refresh_count) == (1, 1)
    assert await history(env, job) == STAGES  # the refresh is in band: no extra status
    assert len(env.stored(prefix)) == 1 and env.leftovers() == []
    assert "refresh of job" in caplog.text  # the logs were captured…
    assert len(env.secrets) == 4  # …and hold neither the first nor the refreshed secrets
    assert not [s for s in env.secrets if s in caplog.text]


async def test_credentials_not_refreshed_back_off_then_fail(
    env: Env, serve: Any, clock: ManualClock
) -> None:
    endpoint = await serve(RefreshEndpoint(env, replace=False))
    job, prefix = await env.enqueue(read="s3://media/elsewhere/", refresh_url=endpoint.url)
    w = worker(env, refresher=refresher())
    paths = []
    for _ in range(4):
        [outcome] = await w.run_once()
        paths.append(outcome.path)
        if outcome.path[-1] == "dead_letter":
            break
        clock.advance(60)
    assert paths == [("queued",), ("failed", "dead_letter")]
    status = await env.jobs.status(job)
    assert status.status == "dead_letter"
    assert status.attempt_count == 1  # refreshes never spend an execution attempt
    assert status.credential_refresh_count == 3
    assert status.error is not None and status.error.code == "credentials_not_refreshed"
    assert status.error.http_status == 403
    assert len(endpoint.calls) == 2 and all(c["signed"] for c in endpoint.calls)
    steps = await history(env, job)
    assert ("fetching", "queued") in steps and steps[-2:] == [
        ("fetching", "failed"),
        ("failed", "dead_letter"),
    ]
    assert env.stored(prefix) == [] and env.leftovers() == []


async def test_without_a_refresh_url_a_refused_credential_backs_off_too(env: Env) -> None:
    job, _ = await env.enqueue(read="s3://media/elsewhere/")
    [outcome] = await worker(env, refresher=refresher()).run_once()
    assert outcome.path == ("queued",)
    status = await env.jobs.status(job)
    assert status.attempt_count == 0 and status.credential_refresh_count == 1


def test_the_refresh_body_is_canonical() -> None:
    job = uuid.UUID("00000000-0000-4000-8000-000000000001")
    assert refresh_body(job, 2) == (
        b'{"credential_version":2,"job_id":"00000000-0000-4000-8000-000000000001"}'
    )


async def test_a_refresh_url_resolving_to_a_refused_address_is_not_called() -> None:
    strict = CredentialRefresher(sign, url_policy=UrlPolicy())
    answer = await strict.request(
        "http://localhost:9/refresh",
        requester_id=REQUESTER,
        job_id=uuid.uuid4(),
        credential_version=0,
    )
    assert answer.status is None and "loopback" in answer.detail
