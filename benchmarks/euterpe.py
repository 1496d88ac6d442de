"""Euterpe benchmark: jobs/s end to end, webhook deliveries/s, one ffmpeg job's overhead.

    python -m benchmarks.euterpe --runs 3
    python -m benchmarks.euterpe --jobs 500 --concurrency 4 --engines postgres

Each run measures, on SQLite and on Postgres (alternating which goes first
from run to run), on a freshly migrated database (:mod:`benchmarks._euterpe_run`):

- ``jobs_per_s``: ``--jobs`` transcode requests enqueued through the
  ``POST /transcode`` use case (``Intake``: API key, validation, idempotency
  key, credentials sealed with a local KEK), then run by one
  ``EuterpeWorker`` (``--concurrency``, ``--batch-size``) with the copy
  processor over small sources in a lite object store, from the first
  enqueue to the last ``succeeded``; split into ``enqueue_per_s`` and
  ``processing_per_s`` (worker start to last success);
- ``deliveries_per_s``: every event those jobs wrote (one per stage, six a
  job) posted by one ``WebhookDeliverer`` (``--deliverer-batch``,
  ``--deliverer-concurrency``; §12's defaults), signed, over HTTP to a
  receiver process (uvicorn) that verifies each with the receiver helper on
  its own SQLite file; every event must be processed exactly once;
- ``ffmpeg_ms`` and ``euterpe_overhead_ms``: one job with the real ffmpeg
  processor on a ``--clip-seconds`` lavfi ``testsrc`` + ``sine`` clip
  (``mp4-h264-360p``): the processor call against the rest of the job
  (claim, fetch, upload, state writes with their events, credential
  opening), and ``overhead_ratio`` = overhead / ffmpeg.

A run fails loudly (exit code 1) if a job does not succeed or an event is
not delivered exactly once. One JSON object per engine and run on stdout,
then a summary with medians per engine; logs go to stderr. Postgres runs on
a throwaway cluster unless ``--pg-url`` names a server (a new database is
made on it per run).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio

from benchmarks._common import Databases, configure_logging, emit, load_average, log, summarize
from benchmarks._euterpe_receiver import ReceiverProcess
from benchmarks._euterpe_run import REQUESTER, BenchmarkFailed, Params, run_engine
from trace_core.security.webhook_signing import MasterSecret, WebhookSigner

__all__ = ["main"]

ENGINES = ("sqlite", "postgres")
_KEYS = (
    "jobs_per_s",
    "enqueue_per_s",
    "processing_per_s",
    "deliveries_per_s",
    "ffmpeg_ms",
    "euterpe_overhead_ms",
    "overhead_ratio",
    "overhead_claim_ms",
    "overhead_fetch_ms",
    "overhead_upload_ms",
    "overhead_state_writes_ms",
    "overhead_other_ms",
)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.euterpe", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--runs", type=int, default=3, help="runs; the summary has medians")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated: sqlite, postgres")
    p.add_argument("--pg-url", help="a Postgres server URL (default: a throwaway cluster)")
    p.add_argument("--jobs", type=int, default=120, help="jobs per run and engine")
    p.add_argument("--source-bytes", type=int, default=16384, help="size of each source")
    p.add_argument("--enqueue-concurrency", type=int, default=4, help="enqueues in flight")
    p.add_argument("--concurrency", type=int, default=2, help="the worker's job slots")
    p.add_argument("--batch-size", type=int, default=2, help="the worker's claim batch")
    p.add_argument("--deliverer-batch", type=int, default=10, help="events per claim")
    p.add_argument("--deliverer-concurrency", type=int, default=5, help="posts in flight")
    p.add_argument(
        "--poll-max-seconds",
        type=float,
        default=1.5,
        help="longest idle poll of the worker and the deliverer (shortest: a third)",
    )
    p.add_argument(
        "--clip-seconds", type=float, default=3.0, help="the ffmpeg clip's length; 0 skips it"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="bound on each timed part")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    for name in ("runs", "jobs", "source_bytes", "enqueue_concurrency", "concurrency"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("batch_size", "deliverer_batch", "deliverer_concurrency"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 1 <= args.batch_size <= 25 or not 1 <= args.deliverer_batch <= 25:
        p.error("--batch-size and --deliverer-batch must be within 1..25")
    if not 1 <= args.concurrency <= 64:
        p.error("--concurrency must be within 1..64")
    if args.poll_max_seconds <= 0 or args.timeout <= 0:
        p.error("--poll-max-seconds and --timeout must be > 0")
    if args.clip_seconds < 0:
        p.error("--clip-seconds must be >= 0")
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not engines or any(e not in ENGINES for e in engines) or len(set(engines)) != len(engines):
        p.error(f"--engines must list distinct engines among {', '.join(ENGINES)}")
    args.engine_list = engines
    return args


def _make_clip(path: Path, seconds: float) -> Path:
    """A small H.264 + AAC clip from ffmpeg's own test sources."""
    command = ["ffmpeg", "-nostdin", "-y", "-hide_banner", "-loglevel", "error"]
    command += ["-f", "lavfi", "-i", f"testsrc=size=640x360:rate=25:duration={seconds}"]
    command += ["-f", "lavfi", "-i", f"sine=frequency=440:duration={seconds}"]
    command += ["-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p"]
    command += ["-c:a", "aac", "-shortest", str(path)]
    subprocess.run(command, check=True, timeout=120, capture_output=True)
    return path


def _params(args: argparse.Namespace, clip: Path | None) -> Params:
    return Params(
        jobs=args.jobs,
        source_bytes=args.source_bytes,
        enqueue_concurrency=args.enqueue_concurrency,
        concurrency=args.concurrency,
        batch_size=args.batch_size,
        deliverer_batch=args.deliverer_batch,
        deliverer_concurrency=args.deliverer_concurrency,
        poll_max_seconds=args.poll_max_seconds,
        timeout_seconds=args.timeout,
        clip=clip,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (module docstring); the exit code."""
    args = _parse(argv)
    configure_logging(args.verbose, "httpx", "trace_core.euterpe", "trace_core.security")
    # A fresh master per invocation: the deliverer signs with it, the receiver
    # verifies with the requester's secret derived from it.
    signer = WebhookSigner([MasterSecret("bench", os.urandom(32))])
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="euterpe-bench-")))
        dbs = {
            engine: stack.enter_context(
                Databases(engine, args.pg_url if engine == "postgres" else None)
            )
            for engine in args.engine_list
        }
        clip = _make_clip(scratch / "clip.mp4", args.clip_seconds) if args.clip_seconds else None
        params = _params(args, clip)
        receiver = stack.enter_context(
            ReceiverProcess(
                scratch / "receiver.db",
                signer.requester_secrets(REQUESTER),
                scratch / "receiver.log",
            )
        )
        for run in range(args.runs):
            order = args.engine_list if run % 2 == 0 else args.engine_list[::-1]
            for engine in order:
                log.info("run %d on %s: %d jobs", run, engine, args.jobs)
                load = load_average()
                url = dbs[engine].fresh(f"euterpe{run}")
                try:
                    figures = anyio.run(
                        run_engine, params, url, scratch / f"{engine}-{run}", receiver, signer
                    )
                except BenchmarkFailed as exc:
                    log.error("run %d on %s FAILED: %s", run, engine, exc)
                    return 1
                row = {
                    "bench": "euterpe",
                    "engine": engine,
                    "run": run,
                    "concurrency": args.concurrency,
                    "batch_size": args.batch_size,
                    "deliverer_batch": args.deliverer_batch,
                    "deliverer_concurrency": args.deliverer_concurrency,
                    **figures,
                    "load_average": load,
                    "verified": True,
                }
                emit(row)
                rows.append(row)
                dbs[engine].drop(url)
    for engine in args.engine_list:
        mine = [r for r in rows if r["engine"] == engine]
        emit(
            {
                "bench": "euterpe",
                "engine": engine,
                "summary": True,
                "runs": len(mine),
                "jobs": args.jobs,
                "all_verified": all(r["verified"] for r in mine),
                "jobs_per_s_all": [r["jobs_per_s"] for r in mine],
                "deliveries_per_s_all": [r["deliveries_per_s"] for r in mine],
                **summarize(mine, _KEYS),
            }
        )
    log.info("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
