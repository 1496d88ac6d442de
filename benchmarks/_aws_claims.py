"""The claim->complete figure of ``python -m benchmarks.aws``: SQS + HTTP against lite.

Both paths run the same one-job DAG (:data:`benchmarks.api.DAG`: a manual
source on ``runtime: ecs_platform``) with a no-op async operator, on their
own database of one throwaway Postgres cluster, and hand each task to a
:class:`~trace_core.worker.WorkerWrapper` with ``concurrency`` tasks at once.

- AWS: ``trace-aws serve`` in a subprocess (the Dispatcher and the HTTP API;
  tokens signed by a KMS key and wake-ups sent to SQS, both on the moto
  server). The tasks are created in this process through
  ``Dispatcher.manual`` on the same database, and serve's outbox relay sends
  their wake-ups; once all of them wait on the queue, the clock starts and an
  :class:`~trace_aws.sqs_worker.SqsWorker` drains them: receive -> claim over
  HTTP (the answer carries the KMS-signed capability token) -> run ->
  complete over HTTP -> delete the message.
- Lite: a Dispatcher in this process with the in-process wake-up queue and
  the lite profile's local-key capability issuer. The tasks are created the
  same way and the relay is drained; then the clock starts and
  ``concurrency`` consumers receive one wake-up each and run it through a
  wrapper on the in-process client (direct claim and complete).

The clock stops when every wake-up was handled; the task creation and the
sending of the wake-ups are not timed (the ``wakeups`` figure measures those).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio

from benchmarks._common import Databases, count_tasks, log, stop_process

if TYPE_CHECKING:
    from trace_core.authoring.operators import OperatorRegistry
    from trace_core.dispatcher.service import Dispatcher
    from trace_core.ports import WakeupQueue

__all__ = ["OPERATORS_FACTORY", "ClaimBench", "PathResult"]

TOKEN = "benchmark-aws-token-0123456789abcdef"
JOB = "bench/work"
QUEUE = "trace-ecs-platform"
"""The wake-up queue of ``runtime: ecs_platform`` (its default runtime target)."""
BUCKET = "trace-bench"
ROLE_ARN = "arn:aws:iam::123456789012:role/trace-bench"
OPERATORS_REF = "benchmarks._aws_claims:OPERATORS_FACTORY"
_START_SECONDS = 60.0

PathResult = tuple[float, dict[str, int]]
"""(seconds, outcomes by name) of one path's timed part."""


def OPERATORS_FACTORY() -> OperatorRegistry:
    """The benchmark's registry: ``bench``, an operator that does nothing, so the
    figure is the protocol's cost (wake-up, claim, token, complete), not work."""
    from trace_core.authoring.operators import OperatorRegistry, OperatorSpec

    async def bench(ctx: Any) -> None:
        return None

    return OperatorRegistry([OperatorSpec("bench", bench, source=True)])


def _until(what: str, check: Callable[[], bool], timeout: float) -> None:
    """Poll ``check`` until true; a ``RuntimeError`` naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


class ClaimBench:
    """The setup shared by every run: the Postgres databases, the AWS resources
    on the moto server at ``endpoint`` and the ``trace-aws serve`` process.

    Each run then calls :meth:`aws` and :meth:`lite` (in either order) with
    ``tasks`` new tasks each.
    """

    def __init__(self, endpoint: str, tasks: int, concurrency: int, region: str) -> None:
        self.endpoint = endpoint
        self.tasks = tasks
        self.concurrency = concurrency
        self.region = region
        self._dbs = Databases("postgres", None)
        self._scratch = Path(tempfile.mkdtemp(prefix="trace-bench-aws-"))
        self._server: subprocess.Popen[bytes] | None = None
        self.aws_url = self.lite_url = self.base = self.queue_url = self.dlq_url = ""

    def __enter__(self) -> ClaimBench:
        try:
            self._dbs.__enter__()
            self.aws_url = self._dbs.fresh("awsclaims")
            self.lite_url = self._dbs.fresh("liteclaims")
            anyio.run(_deploy, self.aws_url)
            anyio.run(_deploy, self.lite_url)
            key = self._aws_resources()
            self._server, self.base = self._start_serve(key)
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._server is not None:
            stop_process(self._server)
        self._dbs.__exit__(exc_type, exc, tb)
        shutil.rmtree(self._scratch, ignore_errors=True)

    def _aws_resources(self) -> str:
        """The signing key, and the wake-up queue with its DLQ; the key's id."""
        import boto3

        kms = boto3.client("kms", region_name=self.region, endpoint_url=self.endpoint)
        key = kms.create_key(KeySpec="ECC_NIST_P256", KeyUsage="SIGN_VERIFY")["KeyMetadata"]
        sqs = boto3.client("sqs", region_name=self.region, endpoint_url=self.endpoint)
        # Queue names of their own: moto's state is per process, and another
        # user of it in this process (a test) may hold the plain names.
        name = f"{QUEUE}-{uuid.uuid4().hex[:8]}"
        self.dlq_url = sqs.create_queue(QueueName=f"{name}-dlq")["QueueUrl"]
        arn = sqs.get_queue_attributes(QueueUrl=self.dlq_url, AttributeNames=["QueueArn"])
        redrive = {"deadLetterTargetArn": arn["Attributes"]["QueueArn"], "maxReceiveCount": "5"}
        self.queue_url = sqs.create_queue(
            QueueName=name, Attributes={"RedrivePolicy": json.dumps(redrive)}
        )["QueueUrl"]
        return str(key["KeyId"])

    def _start_serve(self, key: str) -> tuple[subprocess.Popen[bytes], str]:
        """``trace-aws serve`` on a free loopback port, once ready; its base URL."""
        import httpx

        from benchmarks.api import _free_port

        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        root = Path(__file__).resolve().parents[1]
        env = {
            **os.environ,
            "PYTHONPATH": str(root),
            "TRACE_AWS_REGION": self.region,
            "TRACE_AWS_ENDPOINT_URL": self.endpoint,
            "TRACE_AWS_SIGNING_KEY": key,
            "TRACE_AWS_ROLE_ARN": ROLE_ARN,
            "TRACE_AWS_BUCKET": BUCKET,
            "TRACE_AWS_QUEUE_URLS": f"{QUEUE}={self.queue_url}",
            "TRACE_DATABASE_URL": self.aws_url,
            "TRACE_INTERNAL_TOKEN": TOKEN,
            "TRACE_BIND": f"127.0.0.1:{port}",
        }
        command = [sys.executable, "-m", "trace_aws.cli", "--log-level", "warning"]
        command += ["serve", "--operators", OPERATORS_REF]
        log_file = self._scratch / "serve.log"
        with log_file.open("wb") as out:
            server = subprocess.Popen(command, env=env, cwd=root, stdout=out, stderr=out)
        auth = {"Authorization": f"Bearer {TOKEN}"}

        def ready() -> bool:
            if server.poll() is not None:
                raise RuntimeError("trace-aws serve exited:\n" + log_file.read_text())
            try:
                return httpx.get(f"{base}/readyz", headers=auth, timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        try:
            _until("trace-aws serve to be ready", ready, _START_SECONDS)
        except BaseException:
            server.kill()
            server.wait(timeout=30)
            raise
        return server, base

    def completed(self, aws: bool) -> int:
        """Tasks ``Completed`` so far in the AWS (or the lite) database."""
        return count_tasks(self.aws_url if aws else self.lite_url).get("Completed", 0)

    async def aws(self, run: int) -> PathResult:
        """One run of the SQS + HTTP path (module docstring)."""
        import httpx

        from trace_aws.sqs import sqs_client
        from trace_aws.sqs_worker import SqsWorker, SqsWorkerSettings
        from trace_core.worker import HttpControlPlaneClient, RetryingClient, WorkerWrapper

        sqs = sqs_client(self.region, self.endpoint)
        await _create(self.aws_url, self.tasks, run, relay=False)
        await anyio.to_thread.run_sync(
            _until, "the wake-ups on SQS", lambda: self._waiting(sqs) >= self.tasks, 60.0
        )
        settings = SqsWorkerSettings(
            self.queue_url,
            wait_seconds=1,
            concurrency=self.concurrency,
            dead_letter_url=self.dlq_url,
        )
        async with httpx.AsyncClient(timeout=30.0) as http:
            control = RetryingClient(HttpControlPlaneClient(self.base, TOKEN, http=http))
            wrapper = WorkerWrapper(control, OPERATORS_FACTORY(), worker_id=f"bench-aws-{run}")
            worker = SqsWorker(sqs, wrapper, settings)
            started = time.perf_counter()
            await worker.run(max_messages=self.tasks)
            seconds = time.perf_counter() - started
        return seconds, dict(worker.outcomes)

    def _waiting(self, sqs: Any) -> int:
        got = sqs.get_queue_attributes(
            QueueUrl=self.queue_url, AttributeNames=["ApproximateNumberOfMessages"]
        )
        return int(got["Attributes"]["ApproximateNumberOfMessages"])

    async def lite(self, run: int) -> PathResult:
        """One run of the lite in-process path (module docstring)."""
        from trace_core.dispatcher.inprocess import InProcessWakeupQueue
        from trace_core.dispatcher.inprocess_client import InProcessClient
        from trace_core.worker import RetryingClient, WorkerWrapper

        queue = InProcessWakeupQueue()
        outcomes: dict[str, int] = {}
        async with _dispatcher(self.lite_url, queue) as dispatcher:
            await _create_with(dispatcher, self.tasks, run, relay=True)
            if len(queue.pending(QUEUE)) != self.tasks:
                raise RuntimeError(f"lite: {len(queue.pending(QUEUE))} of {self.tasks} wake-ups")
            wrapper = WorkerWrapper(
                RetryingClient(InProcessClient(dispatcher.control)),
                dispatcher.operators,
                worker_id=f"bench-lite-{run}",
                clock=dispatcher.clock,
            )

            async def consume() -> None:
                while ids := await queue.receive(QUEUE, max_messages=1):
                    outcome = await wrapper.handle_wakeup(ids[0])
                    outcomes[outcome] = outcomes.get(outcome, 0) + 1

            started = time.perf_counter()
            async with anyio.create_task_group() as group:
                for _ in range(self.concurrency):
                    group.start_soon(consume)
            seconds = time.perf_counter() - started
        return seconds, outcomes


class _dispatcher:
    """An unstarted Dispatcher on ``url`` with ``wakeups`` and the lite profile's
    local-key capability issuer; its repository closed on exit."""

    def __init__(self, url: str, wakeups: WakeupQueue | None = None) -> None:
        self.url = url
        self.wakeups = wakeups

    async def __aenter__(self) -> Dispatcher:
        from trace_core.clock import SystemClock
        from trace_core.dispatcher.service import Dispatcher, DispatcherConfig
        from trace_core.security import KeyRing
        from trace_core.security.signing import PrivateKeySigner
        from trace_core.storage.sql import SqlRepository
        from trace_lite.credentials import capability_issuer

        clock = SystemClock()
        ring = KeyRing(clock)
        ring.bootstrap(PrivateKeySigner.generate())
        config = DispatcherConfig(storage_root=f"s3://{BUCKET}/")
        self.repo = SqlRepository(self.url)
        return Dispatcher(
            self.repo,
            operators=OPERATORS_FACTORY(),
            clock=clock,
            config=config,
            wakeups=self.wakeups,
            capabilities=capability_issuer(ring, self.repo, clock, config.storage_root),
        )

    async def __aexit__(self, *exc: object) -> None:
        await self.repo.close()


async def _deploy(url: str) -> None:
    from benchmarks.api import DAG
    from trace_core.dag import parse_dag

    async with _dispatcher(url) as dispatcher:
        await dispatcher.deploy(parse_dag(DAG, operators=dispatcher.operators.names()))


async def _create(url: str, count: int, run: int, *, relay: bool) -> None:
    async with _dispatcher(url) as dispatcher:
        await _create_with(dispatcher, count, run, relay=relay)


async def _create_with(dispatcher: Dispatcher, count: int, run: int, *, relay: bool) -> None:
    """``count`` new tasks of the benchmark job (keys unique to ``run``); with
    ``relay`` their wake-ups are sent here (else another process's relay sends them)."""
    for index in range(count):
        made = await dispatcher.manual.create_task(JOB, f"run{run}-{index}")
        if not made.created:
            raise RuntimeError(f"task run{run}-{index} not created: {made.refused}")
    if relay:
        while await dispatcher.relay.run_once():
            pass
    log.debug("created %d tasks (run %d)", count, run)
