"""The local rehearsal of the AWS profile: ``./dev run --aws`` (``trace-aws rehearse``).

One command runs the whole profile on this machine, each part as it runs on
AWS, as separate OS processes:

1. moto's server on a loopback port (S3, SQS, KMS, STS, IAM), with fake
   credentials given to the children's environment only; a throwaway
   Postgres (:class:`~trace_lite.pgcluster.PostgresCluster`);
2. the resources: the data bucket, the platform worker queue and the
   alerts buffer queue, each with a redrive policy to one dead-letter
   queue, the ES256 signing key in KMS and the task role STS assumes;
3. ``trace-aws migrate``; the chain pipeline deployed (with ``--blocks N``
   blocks and its jobs on the ``ecs_platform`` worker-queue runtime instead
   of the in-process one, nothing else changed); ``trace-aws serve`` with the
   alerts dataset's buffer queue; ``workers`` x ``trace-aws worker``, whose
   operators (:mod:`trace_aws.rehearsal_operators`) are the pipeline's,
   reading and writing Parquet through the S3 store on STS credentials;
4. the same progress lines and summary as ``./dev run``
   (:func:`trace_lite.run_command.follow_run` and friends), then a check of
   every output against the pyarrow reference: each partition of
   ``blocks``, ``transactions`` and ``range_aggregates`` in S3, and the
   number of alert rows;
5. everything it started is stopped in reverse order, also on failure or
   Ctrl-C: each child runs in its own process group, which gets SIGTERM and,
   after a bound, SIGKILL (the always-on follower never finishes by itself).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO, cast

import anyio
import yaml

from trace_aws.rehearsal_aws import (
    FAKE_AWS,
    REGION,
    WORKER_QUEUE,
    AwsResources,
    aws_client,
    aws_resources,
    moto_server,
    queue_depth,
)
from trace_aws.rehearsal_check import check_outputs, rows_of
from trace_aws.rehearsal_children import Children
from trace_core.errors import ConfigurationError, TraceError
from trace_lite.run_command import (
    RunSummary,
    fill_summary,
    follow_run,
    print_summary,
    with_block_count,
)

__all__ = [
    "RehearsalOptions",
    "RehearsalResult",
    "rehearse",
    "rehearse_main",
    "with_runtime",
]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "chain_pipeline.yaml"
WORKER_RUNTIME = "ecs_platform"
OPERATORS_REF = "trace_aws.rehearsal_operators:OPERATORS"


@dataclass(frozen=True)
class RehearsalOptions:
    """What the rehearsal runs."""

    dag_file: Path = EXAMPLE
    blocks: int = 20_000
    workers: int = 2
    concurrency: int = 2
    """Tasks each worker runs at once (the follower holds one slot for the whole run)."""
    work_dir: Path | None = None
    """Logs and scratch; a temporary directory (removed afterwards) by default."""
    timeout_seconds: float = 3600.0
    refresh_seconds: float = 1.0
    spark_memory: str = "1g"
    visibility_seconds: int = 60
    wait_seconds: int = 2
    """The workers' SQS long-poll."""
    database_url: str | None = None
    """An existing empty Postgres database (``postgresql+psycopg://``) instead of
    a throwaway cluster (the tests pass theirs)."""


@dataclass
class RehearsalResult:
    """The run's summary and what differs from the reference (empty: all equal)."""

    summary: RunSummary
    mismatches: list[str] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    """The processes it started (all stopped when :func:`rehearse` returns)."""

    @property
    def ok(self) -> bool:
        """Finished, every dataset version current and every output as the reference."""
        current = all(d["dag_version"] == "current" for d in self.summary.datasets)
        return self.summary.finished and current and not self.mismatches


def with_runtime(text: str, runtime: str) -> str:
    """The DAG YAML with every job of the in-process runtime on ``runtime``."""
    doc = yaml.safe_load(text)
    for job in doc.get("jobs", []) if isinstance(doc, dict) else []:
        if isinstance(job, dict) and job.get("runtime", "dispatcher") == "dispatcher":
            job["runtime"] = runtime
    return str(yaml.safe_dump(doc, sort_keys=False))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _until(what: str, check: Callable[[], Any], timeout: float, children: Children) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        children.check_alive()
        found = check()
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise TraceError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def _ready(base: str, token: str) -> Callable[[], bool | None]:
    import httpx

    def check() -> bool | None:
        try:
            answer = httpx.get(f"{base}/readyz", headers={"Authorization": f"Bearer {token}"})
        except httpx.TransportError:
            return None
        return answer.status_code == 200 or None

    return check


async def _deploy(
    database_url: str, text: str, name: str, bucket: str
) -> tuple[str, str, uuid.UUID]:
    """Deploy the DAG: ``(dag name, first line to print, the alerts dataset's uuid)``."""
    from trace_core.dag import parse_dag
    from trace_core.dispatcher.service import Dispatcher, DispatcherConfig
    from trace_core.storage.sql import SqlRepository
    from trace_lite.status import dataset_statuses

    operators = _pipeline_names()
    repo = SqlRepository(database_url)
    try:
        config = DispatcherConfig(storage_root=f"s3://{bucket}/")
        dispatcher = Dispatcher(repo, operators=operators, config=config)
        result = await dispatcher.deploy(parse_dag(text, file=name, operators=operators.names()))
        state = "deployed" if result.changed else "unchanged"
        line = f"{result.dag_name}: {state}, version {result.dag_version_id} ({result.status})"
        statuses = await dataset_statuses(repo, result.dag_name)
        buffered = [s for s in statuses if not s.location.startswith("s3://")]
        if len(buffered) != 1:
            raise ConfigurationError(f"{name}: expected one buffered dataset, not {len(buffered)}")
        return result.dag_name, line, buffered[0].dataset_uuid
    finally:
        await repo.close()


def _pipeline_names() -> Any:
    """The pipeline's operator registry for a deploy, which only checks names
    (binding the operators touches no part of the runtime)."""
    from trace_core.authoring.operators import OperatorRegistry
    from trace_lite.pipeline.operators import PipelineRuntime, pipeline_operators

    return OperatorRegistry(pipeline_operators(cast(PipelineRuntime, None)))


def rehearse(options: RehearsalOptions, out: TextIO) -> RehearsalResult:
    """Run the rehearsal of the module docstring; print progress and the summary."""
    from sqlalchemy.engine import make_url

    from trace_lite.pgcluster import PostgresCluster

    def say(message: str) -> None:
        print(message, file=out, flush=True)

    if options.blocks < 1:
        raise ConfigurationError("--blocks must be >= 1")
    if options.workers < 1:
        raise ConfigurationError("--workers must be >= 1")
    try:
        text = options.dag_file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigurationError(f"{options.dag_file}: {exc.strerror or exc}") from None
    text = with_runtime(with_block_count(text, options.blocks), WORKER_RUNTIME)
    name = f"{options.dag_file} (--blocks {options.blocks}, --aws)"
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if options.work_dir is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="trace-aws-")))
        else:
            work = options.work_dir
            work.mkdir(parents=True, exist_ok=True)
        endpoint = stack.enter_context(moto_server())
        if options.database_url is None:
            cluster = stack.enter_context(PostgresCluster())
            cluster.create_database("trace")
            database_url = cluster.url("trace").replace("postgresql://", "postgresql+psycopg://")
        else:
            database_url = options.database_url
        aws = aws_resources(endpoint, visibility_seconds=options.visibility_seconds)
        token = secrets.token_urlsafe(32)
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("TRACE_", "AWS_"))},
            **FAKE_AWS,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "TRACE_AWS_REGION": REGION,
            "TRACE_AWS_ENDPOINT_URL": endpoint,
            "TRACE_AWS_SIGNING_KEY": aws.signing_key,
            "TRACE_AWS_ROLE_ARN": aws.role_arn,
            "TRACE_AWS_BUCKET": aws.bucket,
            "TRACE_AWS_QUEUE_URLS": f"{WORKER_QUEUE}={aws.worker_queue}",
            "TRACE_AWS_WORKER_QUEUE": aws.worker_queue,
            "TRACE_INTERNAL_TOKEN": token,
            "TRACE_BIND": f"127.0.0.1:{port}",
            "TRACE_API_URL": base,
            "TRACE_REHEARSAL_WORK_DIR": str(work / "scratch"),
            "TRACE_REHEARSAL_SPARK_MEMORY": options.spark_memory,
        }
        # Only migrate and serve get the database; the workers are database-free
        # (operator state goes through /v1/task/state).
        database = {"TRACE_DATABASE_URL": database_url}
        children = Children(work, env)
        stack.callback(children.stop)
        children.run("migrate", ["migrate"], database)
        dag, line, alerts_uuid = anyio.run(_deploy, database_url, text, name, aws.bucket)
        say(line)
        shown = make_url(database_url).render_as_string(hide_password=True)
        say(f"  state db {shown}, bucket s3://{aws.bucket}/, moto {endpoint}")
        say(f"  logs {work}")
        children.start(
            "serve",
            ["--log-level", "warning", "serve", "--operators", OPERATORS_REF],
            {**database, "TRACE_AWS_BUFFER_QUEUES": f"{alerts_uuid}={aws.buffer_queue}"},
        )
        _until("trace-aws serve to be ready", _ready(base, token), 120, children)
        for i in range(options.workers):
            children.start(
                f"worker-{i + 1}",
                [
                    *("--log-level", "warning", "worker", "--operators", OPERATORS_REF),
                    *("--concurrency", str(options.concurrency)),
                    *("--wait-seconds", str(options.wait_seconds)),
                    *("--visibility-seconds", str(options.visibility_seconds)),
                    *("--worker-id", f"rehearsal-worker-{i + 1}"),
                ],
            )
        result = anyio.run(_follow, options, dag, text, database_url, aws, children, say, started)
        result.pids = [process.pid for _, process, _ in children.started]
    print_summary(result.summary, say)
    if result.mismatches:
        say("  outputs DIFFER from the pyarrow reference:")
        for mismatch in result.mismatches[:20]:
            say(f"    {mismatch}")
    elif result.summary.finished:
        say("  outputs equal the pyarrow reference")
    return result


async def _follow(
    options: RehearsalOptions,
    dag: str,
    text: str,
    database_url: str,
    aws: AwsResources,
    children: Children,
    say: Callable[[str], None],
    started: float,
) -> RehearsalResult:
    from trace_core.storage.sql import SqlRepository
    from trace_lite.status import dataset_statuses

    sqs = aws_client("sqs", aws.endpoint)

    async def buffer_pending() -> int:
        children.check_alive()  # a dead process would stall the run: say so at once
        return await anyio.to_thread.run_sync(queue_depth, sqs, aws.buffer_queue)

    sources = frozenset(
        j["name"] for j in yaml.safe_load(text)["jobs"] if j.get("activation") == "source"
    )
    repo = SqlRepository(database_url)
    try:
        summary = await follow_run(
            repo,
            dag,
            sources,
            say,
            started=started,
            timeout_seconds=options.timeout_seconds,
            refresh_seconds=options.refresh_seconds,
            buffer_pending=buffer_pending,
        )
        await fill_summary(repo, summary, rows_of(aws.endpoint, database_url))
        statuses = await dataset_statuses(repo, dag)
    finally:
        await repo.close()
    mismatches = await anyio.to_thread.run_sync(
        check_outputs, aws.endpoint, text, summary, statuses
    )
    # A wake-up or buffer message that kept failing would sit in the DLQ.
    dead = await anyio.to_thread.run_sync(queue_depth, sqs, aws.dead_letter_queue)
    if dead:
        mismatches.append(f"the dead-letter queue: {dead} message(s) dead-lettered")
    return RehearsalResult(summary, mismatches)


def rehearse_main(options: RehearsalOptions, out: TextIO) -> int:
    """:func:`rehearse` as a command: 0 when :attr:`RehearsalResult.ok`, else 1."""
    # SIGTERM unwinds like Ctrl-C, so the children's groups are stopped too.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        result = rehearse(options, out)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0 if result.ok else 1


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
