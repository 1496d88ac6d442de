"""AWS adapters benchmark: SQS wake-ups, claim->complete, KMS tokens, each against lite.

    python -m benchmarks.aws --wakeups 200 --tokens 300 --tasks 200 --runs 3

Everything AWS runs against moto's threaded server on loopback
(``moto.server.ThreadedMotoServer``, started here with fake credentials), so
the figures measure the adapters and the HTTP round trips to a local
endpoint, not AWS itself. Each run measures, in alternating order:

- ``wakeups``: ``SqsWakeupQueue.send`` of ``--wakeups`` task ids (its
  ``SendMessageBatch`` groups of ten), then receive (ten per
  ``ReceiveMessage``) and ``DeleteMessageBatch`` until every one came back;
  against ``InProcessWakeupQueue`` send (groups of ten) and receive, the lite
  stand-in. The bodies are parsed back and must be exactly the ids sent.
- ``tokens``: ``--tokens`` capability tokens issued one after the other by
  a ``TokenIssuer`` over a ``KeyRing`` whose signer is the ``KmsSigner``
  (one ``Sign`` call per token), against the same over a ``PrivateKeySigner``.
- ``claim_complete``: ``--tasks`` tasks on a Postgres state database (a
  throwaway cluster) woken through SQS and drained by an ``SqsWorker``
  (``--concurrency`` at once) that claims and completes each over HTTP with
  ``trace-aws serve`` (a subprocess: KMS-signed capability tokens), against
  the same tasks on the lite in-process path (in-process wake-up queue, direct
  claim and complete); see :mod:`benchmarks._aws_claims`. Every wake-up must
  end ``completed`` and every task ``Completed``. ``--tasks 0`` skips it
  (no Postgres, no server).

Each AWS figure has ``<name>_lite_over_aws`` = lite per second / AWS per
second (above 1: the AWS path is that many times slower). One JSON object per run,
then a summary with medians (ratios: the median of the per-run ratios).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

import anyio

from benchmarks._aws_claims import ClaimBench, PathResult
from benchmarks._common import configure_logging, emit, load_average, log, summarize
from trace_aws.kms import KmsSigner, kms_client
from trace_aws.sqs import BATCH_LIMIT, SqsWakeupQueue, call_sqs, parse_wakeup, sqs_client
from trace_core.clock import SystemClock
from trace_core.dispatcher.inprocess import InProcessWakeupQueue
from trace_core.security import DatasetInput, KeyRing, RotationPolicy, TokenIssuer
from trace_core.security.signing import PrivateKeySigner, Signer

if TYPE_CHECKING:
    from mypy_boto3_sqs import SQSClient

__all__ = ["main"]

REGION = "us-east-1"
QUEUE = "trace-bench"
# Fake credentials for the local moto server only; set when absent so that
# botocore signs its requests (moto accepts any).
_FAKE_AWS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
}
_ISS, _AUD, _TTL = "trace-dispatcher", "trace-task", 600
_POLICY = RotationPolicy(verifier_cache_seconds=300.0, max_token_ttl_seconds=_TTL)

_KEYS = (
    "wakeups_aws_per_s",
    "wakeups_lite_per_s",
    "wakeups_lite_over_aws",
    "tokens_aws_per_s",
    "tokens_lite_per_s",
    "tokens_lite_over_aws",
    "claim_complete_aws_per_s",
    "claim_complete_lite_per_s",
    "claim_complete_lite_over_aws",
)
_FIGURES = ("wakeups", "tokens", "claim_complete")


@contextmanager
def moto_server() -> Iterator[str]:
    """moto's threaded server on a free loopback port; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    for name, value in _FAKE_AWS.items():
        os.environ.setdefault(name, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


# --- wake-ups ------------------------------------------------------------------


async def _sqs_wakeups(client: SQSClient, n: int, run: int) -> tuple[float, int, int]:
    """(seconds, received, deleted) for ``n`` wake-ups through SQS on a fresh queue."""
    name = f"{QUEUE}-{run}-{uuid.uuid4().hex[:6]}"
    url = (await call_sqs("CreateQueue", client.create_queue, QueueName=name))["QueueUrl"]
    queue = SqsWakeupQueue(client, queue_urls={name: url})
    sent = [uuid.uuid4() for _ in range(n)]
    received: list[uuid.UUID] = []
    deleted = 0
    started = time.perf_counter()
    await queue.send(name, sent)
    deadline = time.monotonic() + 60 + n / 10
    while len(received) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"sqs: {len(received)} of {n} wake-ups came back in time")
        answer = await call_sqs(
            "ReceiveMessage",
            client.receive_message,
            QueueUrl=url,
            MaxNumberOfMessages=BATCH_LIMIT,
            WaitTimeSeconds=1,
        )
        messages = answer.get("Messages", [])
        if not messages:
            continue
        received.extend(parse_wakeup(m["Body"]) for m in messages)
        entries = [
            {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(messages)
        ]
        done = await call_sqs(
            "DeleteMessageBatch", client.delete_message_batch, QueueUrl=url, Entries=entries
        )
        if done.get("Failed"):
            raise RuntimeError(f"sqs DeleteMessageBatch failed: {done['Failed']}")
        deleted += len(done.get("Successful", []))
    seconds = time.perf_counter() - started
    await call_sqs("DeleteQueue", client.delete_queue, QueueUrl=url)
    if sorted(received) != sorted(sent):
        raise RuntimeError("sqs: the wake-ups received are not the ones sent")
    return seconds, len(received), deleted


async def _lite_wakeups(n: int) -> tuple[float, int]:
    """(seconds, received) for ``n`` wake-ups through the in-process queue."""
    queue = InProcessWakeupQueue()
    sent = [uuid.uuid4() for _ in range(n)]
    received: list[uuid.UUID] = []
    started = time.perf_counter()
    for start in range(0, n, BATCH_LIMIT):
        await queue.send(QUEUE, sent[start : start + BATCH_LIMIT])
    while len(received) < n:
        got = await queue.receive(QUEUE, max_messages=BATCH_LIMIT)
        if not got:
            raise RuntimeError(f"in-process: {len(received)} of {n} wake-ups came back")
        received.extend(got)
    seconds = time.perf_counter() - started
    if received != sent:
        raise RuntimeError("in-process: the wake-ups received are not the ones sent")
    return seconds, len(received)


# --- tokens --------------------------------------------------------------------


async def _tokens(signer: Signer, n: int) -> tuple[float, int]:
    """(seconds, tokens) for ``n`` tokens issued one after the other through ``signer``."""
    clock = SystemClock()
    ring = KeyRing(clock, _POLICY)
    ring.bootstrap(signer)
    issuer = TokenIssuer(ring, _ISS, _AUD, _TTL, clock)
    inputs = [DatasetInput(uuid.uuid4(), uuid.uuid4(), "s3://trace-data/t1/in/")]
    issued = 0
    started = time.perf_counter()
    for attempt in range(1, n + 1):
        token = await issuer.issue(
            uuid.uuid4(), attempt, inputs, "s3://trace-data/t1/out/", "s3://trace-scratch/t1/"
        )
        issued += token.count(".") == 2  # a compact JWS: header.payload.signature
    return time.perf_counter() - started, issued


# --- runs ----------------------------------------------------------------------


def _per_s(count: int, seconds: float) -> float:
    return round(count / seconds, 1) if seconds > 0 else 0.0


async def _run(
    endpoint: str, wakeups: int, tokens: int, run: int, claims: ClaimBench | None
) -> dict[str, Any]:
    sqs = sqs_client(REGION, endpoint)
    kms = kms_client(REGION, endpoint)
    key = kms.create_key(KeyUsage="SIGN_VERIFY", KeySpec="ECC_NIST_P256")["KeyMetadata"]["Arn"]
    kms_signer = KmsSigner.load(kms, key)
    lite_signer = PrivateKeySigner.generate()
    out: dict[str, Any] = {}
    # Alternate which side goes first, so neither always meets a warmer process.
    aws_first = run % 2 == 0
    for aws in (aws_first, not aws_first):
        side = "aws" if aws else "lite"
        if aws:
            seconds, received, deleted = await _sqs_wakeups(sqs, wakeups, run)
            out["wakeups_aws_received"], out["wakeups_aws_deleted"] = received, deleted
            out["wakeups_aws_per_s"] = _per_s(received, seconds)
            seconds, issued = await _tokens(kms_signer, tokens)
            out["tokens_aws_issued"], out["tokens_aws_per_s"] = issued, _per_s(issued, seconds)
        else:
            seconds, received = await _lite_wakeups(wakeups)
            out["wakeups_lite_received"] = received
            out["wakeups_lite_per_s"] = _per_s(received, seconds)
            seconds, issued = await _tokens(lite_signer, tokens)
            out["tokens_lite_issued"], out["tokens_lite_per_s"] = issued, _per_s(issued, seconds)
        if claims is not None:
            got: PathResult = await (claims.aws(run) if aws else claims.lite(run))
            seconds, outcomes = got
            done = outcomes.get("completed", 0)
            if outcomes != {"completed": claims.tasks}:
                raise RuntimeError(f"claim->complete ({side}): outcomes {outcomes}")
            out[f"claim_complete_{side}_outcomes"] = outcomes
            out[f"claim_complete_{side}_completed"] = done
            out[f"claim_complete_{side}_per_s"] = _per_s(done, seconds)
    for name in _FIGURES:
        if f"{name}_aws_per_s" not in out:
            continue
        rate = out[f"{name}_aws_per_s"]
        out[f"{name}_lite_over_aws"] = round(out[f"{name}_lite_per_s"] / rate, 2) if rate else None
    if claims is not None:
        # Cumulative over the runs: every task of every run so far, on each path.
        for side in ("aws", "lite"):
            completed = claims.completed(aws=side == "aws")
            if completed != claims.tasks * (run + 1):
                raise RuntimeError(f"claim->complete ({side}): {completed} tasks Completed")
            out[f"claim_complete_{side}_tasks_completed"] = completed
    return out


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.aws", description=__doc__.split("\n")[0])
    p.add_argument("--wakeups", type=int, default=200, help="wake-ups per run (each way)")
    p.add_argument("--tokens", type=int, default=300, help="tokens per run (each way)")
    p.add_argument("--tasks", type=int, default=200, help="claim->complete tasks per run (0: skip)")
    p.add_argument("--concurrency", type=int, default=4, help="claim->complete tasks at once")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    for name in ("wakeups", "tokens", "concurrency", "runs"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.tasks < 0:
        p.error("--tasks must be >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; one JSON object per run, then a summary."""
    args = _parse(argv)
    # The worker logs every task at INFO (and httpx every request): not the
    # benchmark's output, and the formatting would be timed on one path only.
    quiet = ("werkzeug", "botocore", "moto", "httpx", "trace_aws", "trace_core.worker")
    configure_logging(args.verbose, *quiet)
    results: list[dict[str, Any]] = []
    with ExitStack() as stack:
        endpoint = stack.enter_context(moto_server())
        claims = None
        if args.tasks:
            log.info("claim->complete: Postgres, the AWS resources and trace-aws serve")
            claims = stack.enter_context(ClaimBench(endpoint, args.tasks, args.concurrency, REGION))
        for run in range(args.runs):
            load = load_average()
            log.info(
                "run %d: %d wake-ups, %d tokens, %d tasks",
                run,
                args.wakeups,
                args.tokens,
                args.tasks,
            )
            got = anyio.run(
                _run, endpoint, args.wakeups, args.tokens, run, claims, backend="asyncio"
            )
            row = {
                "bench": "aws",
                "run": run,
                "wakeups": args.wakeups,
                "tokens": args.tokens,
                "tasks": args.tasks,
                "concurrency": args.concurrency,
                **got,
                "load_avg_1m": load,
            }
            emit(row)
            results.append(row)
    emit({"bench": "aws", "summary": True, "runs": args.runs, **summarize(results, _KEYS)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
