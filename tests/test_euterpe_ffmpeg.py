"""The worker with the real ffmpeg processor, on both engines: a whole job
(outputs probed with ffprobe), an ffmpeg failure, a lost lease and a stopping
worker (ffmpeg killed, nothing written, the temporary directory emptied).
Clips come from ffmpeg's own lavfi test sources, tiny and short."""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from tests.euterpe_worker_fixtures import Env, make_clip, make_env
from tests.factories import wait_until
from trace_core.clock import ManualClock
from trace_core.errors import ConfigurationError
from trace_core.euterpe.job_maintenance import InboxMaintenance
from trace_core.euterpe.presets import PRESETS
from trace_core.euterpe.worker import EuterpeWorker
from trace_core.euterpe.worker_config import WorkerConfig
from trace_core.euterpe.worker_job import JobOutcome, WorkerParts
from trace_core.storage.sql import SqlRepository
from trace_lite.euterpe_ffmpeg import FfmpegProcessor, ffmpeg_command
from trace_lite.euterpe_storage import LiteTranscodeStorage

pytestmark = pytest.mark.anyio

BOUND = 20.0  # seconds any wait on a condition may take before the test fails


@pytest.fixture(scope="session")
def clip(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return make_clip(tmp_path_factory.mktemp("clips") / "clip.mp4", 1.0).read_bytes()


@pytest.fixture(scope="session")
def long_clip(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return make_clip(tmp_path_factory.mktemp("clips") / "long.mp4", 4.0, audio=False).read_bytes()


@pytest.fixture
async def env(repo: SqlRepository, clock: ManualClock, tmp_path: Path) -> Env:
    return await make_env(repo, clock, tmp_path)


def worker(env: Env, processor: FfmpegProcessor) -> EuterpeWorker:
    parts = WorkerParts(
        jobs=env.jobs,
        vault=env.vault,
        storage=LiteTranscodeStorage(env.store),
        processor=processor,
        config=WorkerConfig(temp_dir=env.work_dir, heartbeat_seconds=0.05),
    )
    return EuterpeWorker(parts, worker_id="w-ffmpeg")


def probe(path: Path) -> dict[str, Any]:
    answer = subprocess.run(
        ["ffprobe", "-v", "error", "-show_streams", "-of", "json", str(path)],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return {s["codec_type"]: s for s in json.loads(answer.stdout)["streams"]}


async def until(what: str, condition: Any) -> None:
    await wait_until(what, condition, time.monotonic() + BOUND, describe=lambda: "not yet")


def test_the_command_has_no_shell_and_preset_arguments_only(tmp_path: Path) -> None:
    preset = PRESETS["mp4-h264-360p"]
    command = ffmpeg_command("/usr/bin/ffmpeg", tmp_path / "in", preset, tmp_path / "out.mp4")
    assert command[:6] == [
        "/usr/bin/ffmpeg",
        "-nostdin",
        "-y",
        "-hide_banner",
        "-loglevel",
        "error",
    ]
    assert command[6:8] == ["-i", str(tmp_path / "in")]
    assert command[8:-1] == list(preset.ffmpeg_args) and command[-1] == str(tmp_path / "out.mp4")
    with pytest.raises(ConfigurationError, match="not found"):
        FfmpegProcessor(binary="no-such-ffmpeg-binary")


async def test_a_whole_job_is_transcoded_with_ffmpeg(env: Env, clip: bytes) -> None:
    env.put_source(clip)
    job, prefix = await env.enqueue(["mp4-h264-360p", "audio-aac-128k"])
    [outcome] = await worker(env, FfmpegProcessor()).run_once()
    assert outcome.result == "succeeded", outcome.error
    status = await env.jobs.status(job)
    assert status.status == "succeeded"
    assert [h.to_status for h in status.history] == [
        "queued",
        "claimed",
        "fetching",
        "processing",
        "uploading",
        "succeeded",
    ]
    stored = {p.name: p for p in env.stored(prefix)}
    assert status.outputs is not None and len(status.outputs) == 2
    for out in status.outputs:
        path = stored[out["key"].removeprefix(prefix)]
        data = path.read_bytes()
        assert out["size"] == len(data) > 0
        assert out["sha256"] == hashlib.sha256(data).hexdigest()
    video = probe(stored["mp4-h264-360p.mp4"])
    assert video["video"]["codec_name"] == "h264" and video["video"]["height"] == 360
    assert video["audio"]["codec_name"] == "aac"
    audio = probe(stored["audio-aac-128k.m4a"])
    assert set(audio) == {"audio"} and audio["audio"]["codec_name"] == "aac"
    assert env.leftovers() == []


async def test_an_ffmpeg_failure_carries_its_error_output(env: Env) -> None:
    env.put_source(b"these bytes are no video at all")
    job, prefix = await env.enqueue()
    [outcome] = await worker(env, FfmpegProcessor()).run_once()
    assert outcome.path == ("failed", "dead_letter")  # the same input fails again: fatal
    status = await env.jobs.status(job)
    assert status.error is not None and status.error.code == "transcode_failed"
    assert "exited" in status.error.message and "Invalid data" in status.error.message
    assert env.stored(prefix) == [] and env.leftovers() == []


async def test_a_lost_lease_kills_ffmpeg_and_writes_nothing(
    env: Env, long_clip: bytes, clock: ManualClock
) -> None:
    env.put_source(long_clip)
    job, prefix = await env.enqueue()
    started: list[anyio.abc.Process] = []
    # -re reads the input in real time: the 4 s clip keeps ffmpeg busy for 4 s
    processor = FfmpegProcessor(input_args=("-re",), on_start=started.append)
    outcomes: list[JobOutcome] = []

    async def run() -> None:
        outcomes.extend(await worker(env, processor).run_once())

    async with anyio.create_task_group() as group:
        group.start_soon(run)
        await until("ffmpeg started", lambda: bool(started))
        clock.advance(60)  # past the lease: another worker's reclaim fences this one out
        report = await InboxMaintenance(env.jobs).reclaim_expired()
        assert report.retried == [job]
        before = await env.jobs.status(job)
        await until("the worker gave up", lambda: bool(outcomes))
    assert [o.result for o in outcomes] == ["lost"]
    assert started[0].returncode is not None and started[0].returncode < 0  # killed
    after = await env.jobs.status(job)
    assert after.history == before.history and after.events == before.events
    assert after.status == "failed" and after.error is not None
    assert after.error.code == "lease_expired"
    assert env.stored(prefix) == [] and env.leftovers() == []


async def test_a_stopping_worker_kills_ffmpeg_and_hands_the_job_back(
    env: Env, long_clip: bytes
) -> None:
    env.put_source(long_clip)
    job, prefix = await env.enqueue()
    started: list[anyio.abc.Process] = []
    w = worker(env, FfmpegProcessor(input_args=("-re",), on_start=started.append))
    async with anyio.create_task_group() as group:
        await w.start(group)
        await until("ffmpeg started", lambda: bool(started))
        with anyio.fail_after(BOUND):
            await w.stop()
    assert started[0].returncode is not None and started[0].returncode < 0
    status = await env.jobs.status(job)
    assert status.status == "queued" and status.attempt_count == 0  # the attempt is refunded
    assert [h.to_status for h in status.history][-2:] == ["processing", "queued"]
    assert env.stored(prefix) == [] and env.leftovers() == []
