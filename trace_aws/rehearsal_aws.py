"""The AWS side of the local rehearsal: moto's server on loopback and the
resources the profile needs (:mod:`trace_aws.rehearsal`)."""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from trace_core.errors import ConfigurationError

__all__ = [
    "BUCKET",
    "FAKE_AWS",
    "REGION",
    "WORKER_QUEUE",
    "AwsResources",
    "aws_client",
    "aws_resources",
    "moto_server",
    "queue_depth",
]

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


def aws_client(service: str, endpoint: str) -> Any:
    """A boto3 client of ``service`` at ``endpoint`` on the fake credentials."""
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
    aws_client("s3", endpoint).create_bucket(Bucket=bucket)
    sqs = aws_client("sqs", endpoint)
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
    kms = aws_client("kms", endpoint)
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
    role = aws_client("iam", endpoint).create_role(
        RoleName=f"trace-task-{suffix}", AssumeRolePolicyDocument=json.dumps(trust)
    )["Role"]["Arn"]
    return AwsResources(endpoint, bucket, queue["QueueUrl"], buffer["QueueUrl"], dlq, key, role)


def queue_depth(sqs: Any, url: str) -> int:
    """Messages in the queue at ``url``, visible or in flight."""
    names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
    got = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=names)["Attributes"]
    return sum(int(got[n]) for n in names)
