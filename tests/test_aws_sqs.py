"""SQS adapters against moto (in-process ``mock_aws``): the wake-up queue and the worker loop.

Where moto cannot fail on purpose (a throttled call, an entry of a batch
failing), botocore's Stubber answers instead, for the error handling only.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
from botocore.stub import Stubber
from moto import mock_aws

from trace_aws.errors import AwsRejected, AwsUnavailable
from trace_aws.sqs import SqsWakeupQueue, parse_wakeup, sqs_client, wakeup_body
from trace_core.errors import ConfigurationError, InvalidInput, NotFound

if TYPE_CHECKING:
    from mypy_boto3_sqs import SQSClient

pytestmark = pytest.mark.anyio

REGION = "us-east-1"
QUEUE = "trace-ecs-platform"


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake credentials and region: nothing here may reach real AWS."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)


@pytest.fixture
def sqs(aws_env: None) -> Iterator[SQSClient]:
    with mock_aws():
        yield sqs_client(REGION)


@pytest.fixture
def queue_url(sqs: SQSClient) -> str:
    return sqs.create_queue(QueueName=QUEUE)["QueueUrl"]


def drain(sqs: SQSClient, url: str) -> list[str]:
    """Every body on the queue (received, then deleted)."""
    bodies: list[str] = []
    while True:
        got = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=0)
        messages = got.get("Messages", [])
        if not messages:
            return bodies
        for message in messages:
            bodies.append(message["Body"])
            sqs.delete_message(QueueUrl=url, ReceiptHandle=message["ReceiptHandle"])


class NoWait:
    """An injected backoff sleep that records the delays instead of waiting."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


# --- the message body -------------------------------------------------------------


def test_the_body_is_exactly_the_task_id() -> None:
    task_id = uuid.uuid4()
    body = wakeup_body(task_id)
    assert json.loads(body) == {"task_id": str(task_id)}
    assert parse_wakeup(body) == task_id


@pytest.mark.parametrize(
    ("body", "field", "reason"),
    [
        ("not json", "body", "not JSON"),
        ("[1]", "body", "not a JSON object"),
        ("{}", "body.task_id", "missing"),
        ('{"task_id": 7}', "body.task_id", "not a string"),
        ('{"task_id": "nope"}', "body.task_id", "not a UUID"),
        (json.dumps({"task_id": str(uuid.uuid4()), "x": 1}), "body", "unexpected keys ['x']"),
    ],
)
def test_a_malformed_body_names_the_field_and_the_reason(
    body: str, field: str, reason: str
) -> None:
    with pytest.raises(InvalidInput) as caught:
        parse_wakeup(body)
    assert (caught.value.field, caught.value.reason) == (field, reason)


# --- the wake-up queue ------------------------------------------------------------


async def test_send_delivers_one_wakeup_per_task_in_batches_of_ten(
    sqs: SQSClient, queue_url: str
) -> None:
    ids = [uuid.uuid4() for _ in range(23)]
    queue = SqsWakeupQueue(sqs)
    calls: list[int] = []
    sqs.meta.events.register(
        "provide-client-params.sqs.SendMessageBatch",
        lambda params, **_: calls.append(len(params["Entries"])),
    )
    await queue.send(QUEUE, ids)
    assert calls == [10, 10, 3]
    assert sorted(drain(sqs, queue_url)) == sorted(wakeup_body(t) for t in ids)
    assert await queue.queue_url(QUEUE) == queue_url


async def test_configured_urls_are_used_without_a_lookup(sqs: SQSClient, queue_url: str) -> None:
    queue = SqsWakeupQueue(sqs, queue_urls={"fast": queue_url})
    lookups: list[str] = []
    sqs.meta.events.register(
        "provide-client-params.sqs.GetQueueUrl", lambda **_: lookups.append("x")
    )
    await queue.send("fast", [uuid.uuid4()])
    assert lookups == []
    assert len(drain(sqs, queue_url)) == 1


async def test_an_unknown_or_deleted_queue_is_not_found_naming_the_operation(
    sqs: SQSClient, queue_url: str
) -> None:
    queue = SqsWakeupQueue(sqs)
    with pytest.raises(NotFound, match="sqs GetQueueUrl: not found"):
        await queue.send("no-such-queue", [uuid.uuid4()])
    await queue.send(QUEUE, [uuid.uuid4()])  # URL now cached
    sqs.delete_queue(QueueUrl=queue_url)
    with pytest.raises(NotFound, match="sqs SendMessageBatch: not found"):
        await queue.send(QUEUE, [uuid.uuid4()])


async def test_nothing_to_send_calls_nothing(aws_env: None) -> None:
    client = sqs_client(REGION)
    with Stubber(client) as stub:  # any call would fail: nothing is queued
        await SqsWakeupQueue(client).send(QUEUE, [])
        stub.assert_no_pending_responses()


# Stubber from here: moto never fails an entry of a batch or throttles a call.
URL = "https://sqs.us-east-1.amazonaws.com/123456789012/trace-ecs-platform"


def batch_answer(failed: list[str], *, sender_fault: bool = False) -> dict[str, Any]:
    return {
        "Successful": [],
        "Failed": [
            {"Id": i, "SenderFault": sender_fault, "Code": "InternalError", "Message": "x"}
            for i in failed
        ],
    }


async def test_a_failed_entry_is_sent_again_until_accepted(aws_env: None) -> None:
    client = sqs_client(REGION)
    ids = [uuid.uuid4() for _ in range(3)]
    sleep = NoWait()
    queue = SqsWakeupQueue(client, queue_urls={QUEUE: URL}, sleep=sleep)
    with Stubber(client) as stub:
        entries = [{"Id": str(i), "MessageBody": wakeup_body(t)} for i, t in enumerate(ids)]
        stub.add_response(
            "send_message_batch", batch_answer(["1"]), {"QueueUrl": URL, "Entries": entries}
        )
        # Only the failed entry goes again.
        stub.add_response(
            "send_message_batch", batch_answer([]), {"QueueUrl": URL, "Entries": [entries[1]]}
        )
        await queue.send(QUEUE, ids)
        stub.assert_no_pending_responses()
    assert queue.resends == 1
    assert len(sleep.delays) == 1


async def test_entries_failing_every_attempt_raise_unavailable(aws_env: None) -> None:
    client = sqs_client(REGION)
    queue = SqsWakeupQueue(client, queue_urls={QUEUE: URL}, max_attempts=3, sleep=NoWait())
    with Stubber(client) as stub:
        for _ in range(3):
            stub.add_response("send_message_batch", batch_answer(["0"]))
        with pytest.raises(AwsUnavailable, match=r"1 wake-up\(s\) still failed after 3 attempts"):
            await queue.send(QUEUE, [uuid.uuid4()])
        stub.assert_no_pending_responses()


async def test_an_entry_the_sender_is_blamed_for_is_rejected_at_once(aws_env: None) -> None:
    client = sqs_client(REGION)
    queue = SqsWakeupQueue(client, queue_urls={QUEUE: URL}, sleep=NoWait())
    with Stubber(client) as stub:
        stub.add_response("send_message_batch", batch_answer(["0"], sender_fault=True))
        with pytest.raises(AwsRejected, match="sqs SendMessageBatch: refused by AWS"):
            await queue.send(QUEUE, [uuid.uuid4()])
        stub.assert_no_pending_responses()


async def test_throttling_is_unavailable_and_the_aws_message_is_not_repeated(
    aws_env: None,
) -> None:
    client = sqs_client(REGION)
    queue = SqsWakeupQueue(client, queue_urls={QUEUE: URL})
    with Stubber(client) as stub:
        stub.add_client_error(
            "send_message_batch",
            service_error_code="ThrottlingException",
            service_message="secret-ish detail AKIAEXAMPLE",
            http_status_code=400,
        )
        stub.add_client_error(
            "send_message_batch",
            service_error_code="AccessDenied",
            service_message="secret-ish detail AKIAEXAMPLE",
            http_status_code=403,
        )
        with pytest.raises(AwsUnavailable) as throttled:
            await queue.send(QUEUE, [uuid.uuid4()])
        with pytest.raises(AwsRejected) as denied:
            await queue.send(QUEUE, [uuid.uuid4()])
    assert "ThrottlingException" in str(throttled.value)
    assert "AccessDenied" in str(denied.value) and "403" in str(denied.value)
    for error in (throttled.value, denied.value):
        assert "AKIA" not in str(error) and "secret" not in str(error)
        assert error.__cause__ is None


def test_settings_are_checked(aws_env: None) -> None:
    with pytest.raises(ConfigurationError, match="region"):
        sqs_client("")
    with pytest.raises(ConfigurationError, match="max_attempts"):
        SqsWakeupQueue(sqs_client(REGION), max_attempts=0)
