"""``trace-aws``: its settings; ``serve`` and ``worker`` as processes on moto and Postgres."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import anyio
import boto3
import httpx
import pytest
from moto.server import ThreadedMotoServer

from tests.e2e_operators import RELEASE
from tests.test_e2e_http import (
    ROOT,
    STREAM,
    _deploy,
    _free_port,
    _tasks,
    _until,
    processes,  # noqa: F401 (a fixture)
)
from trace_aws.kms import KmsSigner, kms_client
from trace_aws.settings import SERVE_REQUIRED, WORKER_REQUIRED, AwsSettings, load_settings
from trace_core.errors import ConfigurationError

TOKEN = "internal-token-for-tests-0123456789"
SERVE_ENV = {
    "TRACE_AWS_REGION": "us-east-1",
    "TRACE_AWS_SIGNING_KEY": "alias/trace-signing",
    "TRACE_AWS_ROLE_ARN": "arn:aws:iam::123456789012:role/trace-task",
    "TRACE_AWS_BUCKET": "trace-data",
    "TRACE_DATABASE_URL": "postgresql+psycopg://trace:secret-pw@localhost/trace",
    "TRACE_INTERNAL_TOKEN": TOKEN,
}


def write(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    os.chmod(path, mode)
    return path


def test_serve_settings_from_the_environment_are_typed() -> None:
    env = {
        **SERVE_ENV,
        "TRACE_AWS_ENDPOINT_URL": "http://127.0.0.1:5000",
        "TRACE_AWS_QUEUE_URLS": "trace-ecs-platform=http://q/1, trace-ecs-udf=http://q/2",
        "TRACE_BIND": "0.0.0.0:8081",
    }
    settings = load_settings(env, required=SERVE_REQUIRED)
    assert settings.region == "us-east-1"
    assert settings.endpoint_url == "http://127.0.0.1:5000"
    assert settings.queue_urls == {
        "trace-ecs-platform": "http://q/1",
        "trace-ecs-udf": "http://q/2",
    }
    assert (settings.host, settings.port) == ("0.0.0.0", 8081)
    assert settings.bucket == "trace-data"
    assert settings.internal_token == TOKEN
    assert TOKEN not in repr(settings)


@pytest.mark.parametrize("missing", SERVE_REQUIRED)
def test_a_missing_setting_is_named(missing: str) -> None:
    env = {k: v for k, v in SERVE_ENV.items() if k != missing}
    with pytest.raises(ConfigurationError, match=f"^{missing}: missing"):
        load_settings(env, required=SERVE_REQUIRED)


def test_the_worker_needs_its_queue_and_the_api() -> None:
    with pytest.raises(ConfigurationError, match="TRACE_AWS_WORKER_QUEUE: missing"):
        load_settings({"TRACE_AWS_REGION": "us-east-1"}, required=WORKER_REQUIRED)


@pytest.mark.parametrize(
    ("name", "value", "reason"),
    [
        ("TRACE_AWS_REGION", "Europe", "not an AWS region"),
        ("TRACE_AWS_ENDPOINT_URL", "localhost:5000", "not a URL"),
        ("TRACE_AWS_QUEUE_URLS", "trace-ecs-platform", "is not name=url"),
        ("TRACE_AWS_ROLE_ARN", "trace-task", "not an IAM role ARN"),
        ("TRACE_AWS_SIGNING_KEY", "key with spaces", "not a KMS key"),
        ("TRACE_AWS_BUCKET", "Not_A_Bucket", "not an S3 bucket name"),
        ("TRACE_DATABASE_URL", "sqlite:///x.db", "runs on Postgres"),
        ("TRACE_INTERNAL_TOKEN", "short", ""),
        ("TRACE_BIND", "8000", "not host:port"),
        ("TRACE_AWS_BUFFER_QUEUES", "not-a-uuid=http://q/1", "'not-a-uuid' is not a dataset UUID"),
        ("TRACE_AWS_BUFFER_QUEUES", f"{uuid.UUID(int=1)}", "is not dataset-uuid=url"),
        ("TRACE_AWS_BUFFER_QUEUES", f"{uuid.UUID(int=1)}=q1", "not a URL"),
        (
            "TRACE_AWS_BUFFER_QUEUES",
            f"{uuid.UUID(int=1)}=http://q/1,{str(uuid.UUID(int=1)).upper()}=http://q/2",
            "listed twice",
        ),
        ("TRACE_AWS_LAMBDA_RUNTIMES", "lambda", "is not runtime=function"),
        ("TRACE_AWS_LAMBDA_RUNTIMES", "lambda=has space", "not a Lambda function name or ARN"),
        ("TRACE_AWS_LAMBDA_RUNTIMES", "9x=trace-f", "'9x' is not a runtime name"),
        ("TRACE_AWS_LAMBDA_RUNTIMES", "a=f1,a=f2", "'a' is listed twice"),
        ("TRACE_AWS_LAMBDA_QUALIFIER", "live/1", "not a Lambda alias or version"),
    ],
)
def test_a_wrong_setting_is_named_with_the_reason(name: str, value: str, reason: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        load_settings({**SERVE_ENV, name: value}, required=SERVE_REQUIRED)
    message = str(caught.value)
    assert message.startswith(f"{name} (environment {name}): ")
    assert reason in message


def test_buffer_queues_and_lambda_runtimes_are_typed() -> None:
    dataset = uuid.uuid4()
    arn = "arn:aws:lambda:us-east-1:123456789012:function:trace-follow"
    env = {
        **SERVE_ENV,
        "TRACE_AWS_BUFFER_QUEUES": f" {dataset} = http://q/alerts ",
        "TRACE_AWS_LAMBDA_RUNTIMES": f"lambda=trace-{{operator}}, follow={arn}",
        "TRACE_AWS_LAMBDA_QUALIFIER": "live",
    }
    settings = load_settings(env, required=SERVE_REQUIRED)
    assert settings.buffer_queue_urls == {dataset: "http://q/alerts"}
    assert settings.lambda_runtimes == {"lambda": "trace-{operator}", "follow": arn}
    assert settings.lambda_qualifier == "live"


def test_a_database_url_is_never_echoed() -> None:
    url = "mysql://trace:secret-pw@db/trace"
    with pytest.raises(ConfigurationError) as caught:
        load_settings({**SERVE_ENV, "TRACE_DATABASE_URL": url}, required=SERVE_REQUIRED)
    assert "secret-pw" not in str(caught.value)


def test_settings_from_a_file_and_the_environment_wins(tmp_path: Path) -> None:
    file = write(
        tmp_path / "trace.env",
        "# the fleet's settings\n\n"
        + "".join(f"{k}={v}\n" for k, v in SERVE_ENV.items() if k != "TRACE_AWS_BUCKET")
        + 'TRACE_AWS_BUCKET="trace-data"\n',
    )
    settings = load_settings({"TRACE_AWS_REGION": "eu-west-1"}, file, required=SERVE_REQUIRED)
    assert settings.region == "eu-west-1"
    assert settings.bucket == "trace-data"
    assert settings.role_arn == SERVE_ENV["TRACE_AWS_ROLE_ARN"]


def test_a_wrong_setting_in_a_file_names_the_file_and_line(tmp_path: Path) -> None:
    file = write(tmp_path / "trace.env", "# comment\nTRACE_AWS_REGION=us-east-1\nTRACE_BIND=nope\n")
    with pytest.raises(ConfigurationError, match=f"^TRACE_BIND \\({file}:3\\): 'nope' is not"):
        load_settings({}, file)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("TRACE_AWS_REGION\n", ":1: expected NAME=value"),
        ("TRACE_REGION=us-east-1\n", ":1: unknown setting 'TRACE_REGION'"),
        (
            "TRACE_AWS_REGION=us-east-1\nTRACE_AWS_REGION=eu-west-1\n",
            ":2: TRACE_AWS_REGION is set twice",
        ),
    ],
    ids=["no-equals", "unknown", "twice"],
)
def test_a_malformed_file_names_the_line(tmp_path: Path, text: str, reason: str) -> None:
    file = write(tmp_path / "trace.env", text)
    with pytest.raises(ConfigurationError, match=f"^{file}{reason}"):
        load_settings({}, file)


def test_a_token_in_a_file_others_can_read_is_refused(tmp_path: Path) -> None:
    file = write(tmp_path / "trace.env", f"TRACE_INTERNAL_TOKEN={TOKEN}\n", mode=0o644)
    with pytest.raises(ConfigurationError, match="chmod 600") as caught:
        load_settings({"TRACE_AWS_REGION": "us-east-1"}, file)
    assert TOKEN not in str(caught.value)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"settings file .*absent\.env: No such file"):
        load_settings({}, tmp_path / "absent.env")


def test_the_defaults() -> None:
    settings = load_settings({"TRACE_AWS_REGION": "us-east-1"})
    assert settings == AwsSettings(region="us-east-1")
    assert (settings.host, settings.port) == ("127.0.0.1", 8000)


# --- ``serve`` and ``worker`` as OS processes on moto's server and Postgres --------

REGION = "us-east-1"
FAKE_AWS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": REGION,
}
Process = tuple[subprocess.Popen[bytes], IO[bytes]]


@pytest.fixture
def moto_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """moto's threaded server on a free loopback port (fake credentials only)."""
    for name, value in FAKE_AWS.items():
        monkeypatch.setenv(name, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def _aws_resources(endpoint: str) -> tuple[str, str]:
    """A signing key and the platform queue with its DLQ: (key id, queue URL)."""
    kms = boto3.client("kms", region_name=REGION, endpoint_url=endpoint)
    key = kms.create_key(KeySpec="ECC_NIST_P256", KeyUsage="SIGN_VERIFY")["KeyMetadata"]["KeyId"]
    sqs = boto3.client("sqs", region_name=REGION, endpoint_url=endpoint)
    dlq = sqs.create_queue(QueueName="trace-dlq")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]
    redrive = json.dumps({"deadLetterTargetArn": arn["QueueArn"], "maxReceiveCount": "5"})
    queue = sqs.create_queue(QueueName=STREAM, Attributes={"RedrivePolicy": redrive})["QueueUrl"]
    return key, queue


def _spawn_aws(args: list[str], env: dict[str, str], log: Path) -> Process:
    out = log.open("wb")
    command = [sys.executable, "-m", "trace_aws.cli", *args]
    full_env = {**os.environ, **FAKE_AWS, **env, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        command, env=full_env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
    )
    return process, out


def _queue_counts(endpoint: str, queue: str) -> tuple[int, int]:
    sqs = boto3.client("sqs", region_name=REGION, endpoint_url=endpoint)
    names: Any = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
    got = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=names)["Attributes"]
    return int(got[names[0]]), int(got[names[1]])


@pytest.mark.parametrize("engine", ["postgres"])
def test_a_triggered_task_is_woken_over_sqs_and_completed_by_the_worker_process(
    database_url: str,
    tmp_path: Path,
    moto_endpoint: str,
    processes: list[Process],  # noqa: F811 (the fixture imported above)
) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    (markers / RELEASE).touch()  # the gate operator completes at once
    anyio.run(_deploy, database_url, markers)
    key, queue = _aws_resources(moto_endpoint)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {
        "TRACE_AWS_REGION": REGION,
        "TRACE_AWS_ENDPOINT_URL": moto_endpoint,
        "TRACE_AWS_SIGNING_KEY": key,
        "TRACE_AWS_ROLE_ARN": "arn:aws:iam::123456789012:role/trace-task",
        "TRACE_AWS_BUCKET": "trace-data",
        "TRACE_DATABASE_URL": database_url,
        "TRACE_INTERNAL_TOKEN": TOKEN,
        "TRACE_BIND": f"127.0.0.1:{port}",
        "TRACE_AWS_WORKER_QUEUE": queue,
        "TRACE_API_URL": base,
    }
    operators = ("--operators", "tests.e2e_operators:OPERATORS")
    serve_log, worker_log = tmp_path / "serve.log", tmp_path / "worker.log"
    server = _spawn_aws(["--log-level", "warning", "serve", *operators], env, serve_log)
    processes.append(server)

    auth = {"Authorization": f"Bearer {TOKEN}"}

    def ready() -> bool | None:
        assert server[0].poll() is None, "serve exited:\n" + serve_log.read_text()
        try:
            answer = httpx.get(f"{base}/readyz", headers=auth, timeout=5)
            last.append(answer.text)
            return answer.status_code == 200 or None
        except httpx.TransportError:
            return None

    last: list[str] = []
    try:
        _until("the server to be ready", ready, timeout=60)
    except AssertionError:
        raise AssertionError(f"not ready: {last[-1:]}\n{serve_log.read_text()}") from None
    worker = _spawn_aws(["worker", "--wait-seconds", "1", *operators], env, worker_log)
    processes.append(worker)

    created = httpx.post(
        f"{base}/internal/trigger", json={"job": "e2e/work", "key": "k1"}, headers=auth, timeout=10
    )
    assert created.status_code == 200, created.text
    task_id = uuid.UUID(created.json()["task_id"])

    def completed() -> dict[str, Any] | None:
        assert worker[0].poll() is None, "worker exited:\n" + worker_log.read_text()
        task = anyio.run(_tasks, database_url).get(task_id)
        return task if task is not None and task["status"] == "Completed" else None

    done = _until("the worker process to complete the task", completed)
    assert done["attempt"] == 1
    # The worker process ran it (the gate records its pid), and deleted the wake-up.
    assert int((markers / f"done-{task_id}-1").read_text()) == worker[0].pid
    # Its capability token was signed by the KMS key: the JWKS publishes exactly that key.
    signer = KmsSigner.load(kms_client(REGION, moto_endpoint), key)
    jwks = httpx.get(f"{base}/internal/jwks/task", headers=auth, timeout=10).json()
    assert [k["kid"] for k in jwks["keys"]] == [signer.kid]
    _until(
        "the wake-up to be deleted", lambda: _queue_counts(moto_endpoint, queue) == (0, 0) or None
    )

    # SIGTERM stops both cleanly: the worker exits 0; uvicorn shuts the server
    # down (the Dispatcher's services stopped) and then re-raises the signal.
    for process, _ in (worker, server):
        process.send_signal(signal.SIGTERM)
    assert worker[0].wait(timeout=30) == 0, worker_log.read_text()
    assert "stopped" in worker_log.read_text()
    assert server[0].wait(timeout=30) == -signal.SIGTERM, serve_log.read_text()
    assert "Traceback" not in serve_log.read_text()


def test_serve_with_a_missing_setting_exits_2_naming_it(tmp_path: Path) -> None:
    env = {k: v for k, v in SERVE_ENV.items() if k != "TRACE_AWS_ROLE_ARN"}
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TRACE_")}
    result = subprocess.run(
        [sys.executable, "-m", "trace_aws.cli", "serve"],
        env={**clean, **env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "trace-aws serve: TRACE_AWS_ROLE_ARN: missing" in result.stderr
    assert "secret-pw" not in result.stderr


def test_a_signing_key_kms_cannot_sign_with_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from moto import mock_aws

    from trace_aws.cli import signing_ring

    for name, value in FAKE_AWS.items():
        monkeypatch.setenv(name, value)
    with mock_aws():
        kms = boto3.client("kms", region_name=REGION)
        key = kms.create_key(KeySpec="SYMMETRIC_DEFAULT")["KeyMetadata"]["KeyId"]
        settings = load_settings({**SERVE_ENV, "TRACE_AWS_SIGNING_KEY": key})
        with pytest.raises(ConfigurationError, match=key):
            signing_ring(settings)


def test_worker_options_out_of_range_exit_2_naming_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from trace_aws.cli import main

    env = {
        "TRACE_AWS_REGION": REGION,
        "TRACE_AWS_WORKER_QUEUE": "http://127.0.0.1:1/123456789012/q",
        "TRACE_API_URL": "http://127.0.0.1:1",
        "TRACE_INTERNAL_TOKEN": TOKEN,
    }
    assert main(["worker", "--wait-seconds", "30"], env) == 2
    err = capsys.readouterr().err
    assert "trace-aws worker: worker options: wait_seconds must be within 0..20" in err
    assert TOKEN not in err


def test_a_worker_on_a_missing_queue_exits_1_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from moto import mock_aws

    from trace_aws.cli import main

    for name, value in FAKE_AWS.items():
        monkeypatch.setenv(name, value)
    env = {
        "TRACE_AWS_REGION": REGION,
        "TRACE_AWS_WORKER_QUEUE": "https://sqs.us-east-1.amazonaws.com/123456789012/absent",
        "TRACE_API_URL": "http://127.0.0.1:1",
        "TRACE_INTERNAL_TOKEN": TOKEN,
    }
    with mock_aws():
        assert main(["worker", "--wait-seconds", "0"], env) == 1
    err = capsys.readouterr().err
    assert "trace-aws worker: sqs GetQueueAttributes: the queue does not exist" in err
    assert "Traceback" not in err


# --- buffered datasets and Lambda runtimes in ``serve`` -------------------------------

BUFFER_DAG = """
dag: buffered
jobs:
  - name: alerting
    activation: source
    runtime: ecs_platform
    operator: gate
    source: { kind: manual }
    heartbeat_timeout_seconds: 60
    outputs:
      - { dataset: alerts, kind: postgres_table }
"""


async def _deploy_buffered(url: str) -> None:
    from tests.e2e_operators import OPERATORS
    from trace_core.dag import parse_dag
    from trace_core.dispatcher.service import Dispatcher
    from trace_core.storage.sql import SqlRepository

    repo = SqlRepository(url)
    try:
        await Dispatcher(repo, operators=OPERATORS).deploy(
            parse_dag(BUFFER_DAG, operators=OPERATORS.names())
        )
    finally:
        await repo.close()


async def _rows(url: str, table: str) -> list[dict[str, Any]]:
    import sqlalchemy as sa

    from trace_lite.buffered import DataDatabase

    data = DataDatabase(url)
    try:
        async with data.engine.connect() as conn:
            present = await conn.run_sync(lambda c: sa.inspect(c).has_table(table))
            if not present:
                return []
            rows = await conn.execute(sa.text(f'SELECT * FROM "{table}" ORDER BY dedupe_key'))
            return [dict(row._mapping) for row in rows]
    finally:
        await data.close()


def _lambda_function(endpoint: str, name: str, retries: int) -> None:
    """A function (moto keeps it without running it) whose own retries are ``retries``."""
    import io
    import zipfile

    iam = boto3.client("iam", region_name=REGION, endpoint_url=endpoint)
    trust = {"Version": "2012-10-17", "Statement": []}
    role = iam.create_role(RoleName=f"{name}-role", AssumeRolePolicyDocument=json.dumps(trust))
    code = io.BytesIO()
    with zipfile.ZipFile(code, "w") as archive:
        archive.writestr("handler.py", "def handler(event, context):\n    return None\n")
    lam = boto3.client("lambda", region_name=REGION, endpoint_url=endpoint)
    lam.create_function(
        FunctionName=name,
        Runtime="python3.11",
        Role=role["Role"]["Arn"],
        Handler="handler.handler",
        Code={"ZipFile": code.getvalue()},
    )
    lam.put_function_event_invoke_config(FunctionName=name, MaximumRetryAttempts=retries)


def _serve_env(endpoint: str, database_url: str, key: str, port: int) -> dict[str, str]:
    return {
        "TRACE_AWS_REGION": REGION,
        "TRACE_AWS_ENDPOINT_URL": endpoint,
        "TRACE_AWS_SIGNING_KEY": key,
        "TRACE_AWS_ROLE_ARN": "arn:aws:iam::123456789012:role/trace-task",
        "TRACE_AWS_BUCKET": "trace-data",
        "TRACE_DATABASE_URL": database_url,
        "TRACE_INTERNAL_TOKEN": TOKEN,
        "TRACE_BIND": f"127.0.0.1:{port}",
    }


@pytest.mark.parametrize("engine", ["postgres"])
def test_buffer_publish_lands_records_in_postgres_through_sqs(
    database_url: str,
    tmp_path: Path,
    moto_endpoint: str,
    processes: list[Process],  # noqa: F811 (the fixture imported above)
) -> None:
    from trace_lite.buffered import table_name_of
    from trace_lite.pipeline.operators import ALERT_SCHEMA

    anyio.run(_deploy_buffered, database_url)
    key, queue = _aws_resources(moto_endpoint)
    sqs = boto3.client("sqs", region_name=REGION, endpoint_url=moto_endpoint)
    dlq_arn = sqs.get_queue_attributes(
        QueueUrl=sqs.get_queue_url(QueueName="trace-dlq")["QueueUrl"], AttributeNames=["QueueArn"]
    )["Attributes"]["QueueArn"]
    redrive = json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": "5"})
    buffer_queue = sqs.create_queue(
        QueueName="trace-buffer-alerts", Attributes={"RedrivePolicy": redrive}
    )["QueueUrl"]
    _lambda_function(moto_endpoint, "trace-follow", retries=0)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {TOKEN}"}

    # serve needs the dataset -> queue map at start: the deploy fixed the uuid.
    dataset = anyio.run(_dataset_uuid, database_url, "alerts")
    env = {
        **_serve_env(moto_endpoint, database_url, key, port),
        "TRACE_AWS_QUEUE_URLS": f"{STREAM}={queue}",
        "TRACE_AWS_BUFFER_QUEUES": f"{dataset}={buffer_queue}",
        "TRACE_AWS_LAMBDA_RUNTIMES": "follow=trace-follow",
    }
    serve_log = tmp_path / "serve.log"
    server = _spawn_aws(
        ["--log-level", "warning", "serve", "--operators", "tests.e2e_operators:OPERATORS"],
        env,
        serve_log,
    )
    processes.append(server)

    def ready() -> bool | None:
        assert server[0].poll() is None, "serve exited:\n" + serve_log.read_text()
        try:
            return httpx.get(f"{base}/readyz", headers=auth, timeout=5).status_code == 200 or None
        except httpx.TransportError:
            return None

    _until("the server to be ready", ready, timeout=60)
    created = httpx.post(
        f"{base}/internal/trigger", json={"job": "buffered/alerting", "key": "k1"}, headers=auth
    )
    assert created.status_code == 200, created.text
    task_id = created.json()["task_id"]
    claim = httpx.post(
        f"{base}/internal/task-claim",
        json={"task_id": task_id, "worker_id": "test-producer"},
        headers=auth,
        timeout=10,
    )
    assert claim.status_code == 200 and claim.json()["status"] == "Claimed", claim.text
    claimed = claim.json()
    [output] = [o for o in claimed["task"]["outputs"] if o["dataset_uuid"] == str(dataset)]
    table = table_name_of(output["location"])
    record = {
        "rule": "r1",
        "severity": "warning",
        "block_number": 7,
        "metric": "m",
        "value": 2.5,
        "threshold": 1.0,
        "partition_key": "p",
    }
    published = httpx.post(
        f"{base}/v1/task/buffer-publish",
        json={
            "task_id": task_id,
            "attempt": claimed["attempt"],
            "dataset_uuid": str(dataset),
            "schema_hash": ALERT_SCHEMA.schema_hash,
            "records": [{**record, "dedupe_key": "r1:7"}, {**record, "dedupe_key": "r1:8"}],
        },
        headers={"X-Trace-Task-Capability": claimed["task"]["capability_token"]},
        timeout=10,
    )
    assert published.status_code < 300, published.text

    rows = _until(
        "the sink to write the records",
        lambda: anyio.run(_rows, database_url, table) or None,
    )
    assert [(r["dedupe_key"], r["block_number"]) for r in rows] == [("r1:7", 7), ("r1:8", 7)]
    # The sink deleted the message after writing it.
    _until(
        "the buffer message to be deleted",
        lambda: _queue_counts(moto_endpoint, buffer_queue) == (0, 0) or None,
    )
    server[0].send_signal(signal.SIGTERM)
    assert server[0].wait(timeout=30) == -signal.SIGTERM, serve_log.read_text()
    assert "Traceback" not in serve_log.read_text()


async def _dataset_uuid(url: str, name: str) -> uuid.UUID:
    import sqlalchemy as sa

    from trace_core.storage import schema
    from trace_core.storage.sql import SqlRepository

    repo = SqlRepository(url)
    try:
        async with repo.read() as tx:
            found = await tx.connection.execute(
                sa.select(schema.datasets.c.id).where(schema.datasets.c.name == name)
            )
            return uuid.UUID(str(found.scalar_one()))
    finally:
        await repo.close()


@pytest.mark.parametrize("engine", ["postgres"])
def test_serve_refuses_a_lambda_runtime_whose_function_retries_naming_it(
    database_url: str, moto_endpoint: str
) -> None:
    key, _ = _aws_resources(moto_endpoint)
    _lambda_function(moto_endpoint, "trace-retrying", retries=2)
    env = {
        **_serve_env(moto_endpoint, database_url, key, _free_port()),
        "TRACE_AWS_LAMBDA_RUNTIMES": "fast=trace-retrying",
    }
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TRACE_")}
    result = subprocess.run(
        [sys.executable, "-m", "trace_aws.cli", "serve"],
        env={**clean, **FAKE_AWS, **env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "'trace-retrying': MaximumRetryAttempts is 2, must be 0" in result.stderr
