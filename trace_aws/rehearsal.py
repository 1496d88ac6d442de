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
import io
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TextIO, cast

import anyio
import yaml

from trace_core.errors import ConfigurationError, TraceError
from trace_lite.run_command import (
    RunSummary,
    fill_summary,
    follow_run,
    print_summary,
    with_block_count,
)

__all__ = [
    "FAKE_AWS",
    "Children",
    "RehearsalOptions",
    "RehearsalResult",
    "aws_resources",
    "moto_server",
    "rehearse",
    "rehearse_main",
    "with_runtime",
]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "chain_pipeline.yaml"
REGION = "us-east-1"
FAKE_AWS: Mapping[str, str] = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": REGION,
}
"""moto's fake credentials: the children's environment only, never this process's."""
BUCKET = "trace-data"
WORKER_QUEUE = "trace-ecs-platform"
WORKER_RUNTIME = "ecs_platform"
OPERATORS_REF = "trace_aws.rehearsal_operators:OPERATORS"
_STOP_SECONDS = 10.0


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


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """moto's threaded server on a free loopback port: its endpoint URL."""
    try:
        from moto.server import ThreadedMotoServer
    except ImportError:
        raise ConfigurationError(
            "the AWS rehearsal needs moto's server, a dev dependency: "
            "pip install -e '.[dev]' (or ./dev setup)"
        ) from None
    # One access-log line per AWS call would bury the progress lines.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def _client(service: str, endpoint: str) -> Any:
    import boto3

    # The service is a plain str here: the typed stubs' per-service overloads do not apply.
    make: Any = boto3.client
    return make(
        service,
        region_name=REGION,
        endpoint_url=endpoint,
        aws_access_key_id=FAKE_AWS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=FAKE_AWS["AWS_SECRET_ACCESS_KEY"],
        aws_session_token=FAKE_AWS["AWS_SESSION_TOKEN"],
    )


@dataclass(frozen=True)
class AwsResources:
    """What :func:`aws_resources` created."""

    endpoint: str
    bucket: str
    worker_queue: str
    buffer_queue: str
    dead_letter_queue: str
    signing_key: str
    role_arn: str


def aws_resources(endpoint: str, *, visibility_seconds: int = 60) -> AwsResources:
    """The bucket, the queues (each redriven to one DLQ after 5 receives), the
    signing key and the task role, on the AWS at ``endpoint``.

    Names end in a random suffix: moto keeps its state per process, not per
    server, so a second rehearsal in one process (the tests) must not meet
    the first one's resources."""
    suffix = secrets.token_hex(4)
    bucket = f"{BUCKET}-{suffix}"
    _client("s3", endpoint).create_bucket(Bucket=bucket)
    sqs = _client("sqs", endpoint)
    dlq = sqs.create_queue(QueueName=f"trace-dlq-{suffix}")["QueueUrl"]
    dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"][
        "QueueArn"
    ]
    attributes = {
        "RedrivePolicy": json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": "5"}),
        "VisibilityTimeout": str(visibility_seconds),
    }
    queue = sqs.create_queue(QueueName=f"{WORKER_QUEUE}-{suffix}", Attributes=attributes)
    buffer = sqs.create_queue(QueueName=f"trace-buffer-alerts-{suffix}", Attributes=attributes)
    kms = _client("kms", endpoint)
    key = kms.create_key(KeySpec="ECC_NIST_P256", KeyUsage="SIGN_VERIFY")["KeyMetadata"]["KeyId"]
    trust = {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Principal": {"AWS": "arn:aws:iam::123456789012:root"},
                "Action": "sts:AssumeRole",
            }
        ],
    }
    role = _client("iam", endpoint).create_role(
        RoleName=f"trace-task-{suffix}", AssumeRolePolicyDocument=json.dumps(trust)
    )["Role"]["Arn"]
    return AwsResources(endpoint, bucket, queue["QueueUrl"], buffer["QueueUrl"], dlq, key, role)


def _queue_depth(sqs: Any, url: str) -> int:
    names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
    got = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=names)["Attributes"]
    return sum(int(got[n]) for n in names)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class Children:
    """OS processes started in their own process groups, stopped together."""

    def __init__(self, log_dir: Path, env: Mapping[str, str]) -> None:
        self.log_dir = log_dir
        self.env = dict(env)
        self.started: list[tuple[str, subprocess.Popen[bytes], IO[bytes]]] = []

    def start(self, name: str, args: list[str], env: Mapping[str, str] | None = None) -> Any:
        """Start ``trace-aws ARGS`` as ``name`` (log ``<log_dir>/<name>.log``)."""
        out = (self.log_dir / f"{name}.log").open("wb")
        process = subprocess.Popen(
            [sys.executable, "-m", "trace_aws.cli", *args],
            env={**self.env, **(env or {})},
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            # Its own group: the stop reaches its children too (Spark's JVM).
            start_new_session=True,
        )
        self.started.append((name, process, out))
        return process

    def run(self, name: str, args: list[str], timeout: float = 300.0) -> None:
        """Run ``trace-aws ARGS`` to its end; raise with its log unless it exits 0."""
        with (self.log_dir / f"{name}.log").open("wb") as out:
            done = subprocess.run(
                [sys.executable, "-m", "trace_aws.cli", *args],
                env=self.env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                check=False,
            )
        if done.returncode != 0:
            raise TraceError(f"trace-aws {name} failed:\n{self.log(name)[-3000:]}")

    def log(self, name: str) -> str:
        """The output of ``name`` so far."""
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def check_alive(self) -> None:
        """Raise naming the first child that exited, with its log's tail."""
        for name, process, _ in self.started:
            if process.poll() is not None:
                tail = self.log(name)[-3000:]
                raise TraceError(f"{name} exited with {process.returncode}:\n{tail}")

    def stop(self, seconds: float = _STOP_SECONDS) -> None:
        """SIGTERM every group, wait up to ``seconds``, then SIGKILL what is left."""
        for _, process, _ in reversed(self.started):
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + seconds
        for _, process, out in reversed(self.started):
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait(timeout=30)
            # The group may outlive its leader (a JVM): make sure it is gone.
            _signal_group(process, signal.SIGKILL)
            out.close()
        self.started.clear()


def _signal_group(process: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)


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


def _rows_of(endpoint: str, database_url: str) -> Callable[[Any], Any]:
    import pyarrow.parquet as pq

    from trace_lite.buffered import DataDatabase
    from trace_lite.status import table_rows

    s3 = _client("s3", endpoint)

    def object_rows(location: str) -> int:
        bucket, _, prefix = location.removeprefix("s3://").partition("/")
        rows = 0
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                if item["Key"].endswith(".parquet"):
                    body = s3.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
                    rows += pq.read_metadata(io.BytesIO(body)).num_rows
        return rows

    async def rows(status: Any) -> int:
        if status.location.startswith("s3://"):
            return await anyio.to_thread.run_sync(object_rows, status.location)
        data = DataDatabase(database_url)
        try:
            return await table_rows(data, status.location)
        finally:
            await data.close()

    return rows


def check_outputs(
    endpoint: str, dag_text: str, summary: RunSummary, statuses: list[Any]
) -> list[str]:
    """What differs from the pyarrow reference: each partition of the Parquet
    datasets (exactly the Cryo-named objects, no other), and the alert count."""
    import pyarrow.parquet as pq

    from trace_lite.pipeline.chain import BLOCK_SCHEMA, TRANSACTION_SCHEMA, SyntheticChain, conform
    from trace_lite.pipeline.cryo import partition_ranges, partition_uri
    from trace_lite.pipeline.operators import alert_records, alert_rules
    from trace_lite.pipeline.predicate import parse_where
    from trace_lite.pipeline.reference import reference_aggregates
    from trace_lite.pipeline.transforms import AGGREGATE_SCHEMA

    jobs = {j["name"]: j for j in yaml.safe_load(dag_text)["jobs"]}
    follow, aggregate, alerts = jobs["follow"], jobs["aggregate"], jobs["alerts"]
    config = follow["config"]
    chain = SyntheticChain(
        seed=config["seed"],
        chain_id=config["chain_id"],
        mean_txs_per_block=config["mean_txs_per_block"],
    )
    span = follow["outputs"][0]["range"]
    ranges = partition_ranges(int(span["start"]), int(span["end"]), int(config["partition_size"]))
    where = aggregate["inputs"][1]["where"]
    s3 = _client("s3", endpoint)
    current = {s.name: s for s in statuses if s.dag_version_status == "current"}
    mismatches: list[str] = []
    schemas = {
        "blocks": BLOCK_SCHEMA,
        "transactions": TRANSACTION_SCHEMA,
        "range_aggregates": AGGREGATE_SCHEMA,
    }
    for name in schemas:
        if name not in current:
            mismatches.append(f"{name}: no current version")
            continue
        location = current[name].location
        bucket, _, prefix = location.removeprefix("s3://").partition("/")
        listed = s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
        expected_keys = sorted(
            partition_uri(location, name, a, b).removeprefix(f"s3://{bucket}/") for a, b in ranges
        )
        if sorted(item["Key"] for item in listed) != expected_keys:
            mismatches.append(f"{name}: the objects are not one per partition")
    alert_where = parse_where(alerts["inputs"][0]["where"]).to_arrow()
    rules = alert_rules(alerts["config"])
    expected_alerts = 0
    for start, end in ranges:
        reference = reference_aggregates(chain, start, end, transactions_where=where)
        expected = {
            "blocks": chain.blocks(start, end),
            "transactions": chain.transactions(start, end),
            "range_aggregates": reference,
        }
        for name, schema in schemas.items():
            if name not in current:
                continue
            uri = partition_uri(current[name].location, name, start, end)
            bucket, _, key = uri.removeprefix("s3://").partition("/")
            try:
                body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
            except s3.exceptions.NoSuchKey:
                mismatches.append(f"{uri}: missing")
                continue
            if not conform(pq.read_table(io.BytesIO(body)), schema).equals(expected[name]):
                mismatches.append(f"{uri}: differs from the reference")
        selected = reference.filter(alert_where)
        expected_alerts += len(alert_records(selected, rules, f"{start}-{end}"))
    if summary.alerts != expected_alerts:
        mismatches.append(f"alerts: {summary.alerts} rows, the reference has {expected_alerts}")
    return mismatches


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
            "TRACE_DATABASE_URL": database_url,
            "TRACE_INTERNAL_TOKEN": token,
            "TRACE_BIND": f"127.0.0.1:{port}",
            "TRACE_API_URL": base,
            "TRACE_REHEARSAL_WORK_DIR": str(work / "scratch"),
            "TRACE_REHEARSAL_SPARK_MEMORY": options.spark_memory,
        }
        children = Children(work, env)
        stack.callback(children.stop)
        children.run("migrate", ["migrate"])
        dag, line, alerts_uuid = anyio.run(_deploy, database_url, text, name, aws.bucket)
        say(line)
        shown = make_url(database_url).render_as_string(hide_password=True)
        say(f"  state db {shown}, bucket s3://{aws.bucket}/, moto {endpoint}")
        say(f"  logs {work}")
        children.start(
            "serve",
            ["--log-level", "warning", "serve", "--operators", OPERATORS_REF],
            {"TRACE_AWS_BUFFER_QUEUES": f"{alerts_uuid}={aws.buffer_queue}"},
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

    sqs = _client("sqs", aws.endpoint)

    async def buffer_pending() -> int:
        children.check_alive()  # a dead process would stall the run: say so at once
        return await anyio.to_thread.run_sync(_queue_depth, sqs, aws.buffer_queue)

    sources = frozenset(
        j["name"] for j in yaml.safe_load(text)["jobs"] if j.get("activation") == "source"
    )
    repo = SqlRepository(database_url)
    try:
        summary = RunSummary(dag, 0, 0.0)
        summary.finished, summary.blocks = await follow_run(
            repo,
            dag,
            sources,
            say,
            started=started,
            timeout_seconds=options.timeout_seconds,
            refresh_seconds=options.refresh_seconds,
            buffer_pending=buffer_pending,
        )
        summary.seconds = time.perf_counter() - started
        await fill_summary(repo, summary, _rows_of(aws.endpoint, database_url))
        statuses = await dataset_statuses(repo, dag)
    finally:
        await repo.close()
    mismatches = await anyio.to_thread.run_sync(
        check_outputs, aws.endpoint, text, summary, statuses
    )
    # A wake-up or buffer message that kept failing would sit in the DLQ.
    dead = await anyio.to_thread.run_sync(_queue_depth, sqs, aws.dead_letter_queue)
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
