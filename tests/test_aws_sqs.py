"""SQS adapters against moto (in-process ``mock_aws``): the wake-up queue and the worker loop.

Where moto cannot fail on purpose (a throttled call, an entry of a batch
failing), botocore's Stubber answers instead, for the error handling only.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import anyio.to_thread
import pytest
from botocore.stub import Stubber
from moto import mock_aws

from tests.test_worker_wrapper import (
    BACKOFF,
    DAG,
    DEPLOYED,
    EXPIRE,
    WAIT,
    FlakyClient,
    Platform,
    Ticker,
    no_heartbeat,
    relay_partition,
    wrapper_for,
)
from trace_aws.errors import AwsRequestFailed, AwsUnavailable
from trace_aws.sqs import SqsWakeupQueue, parse_wakeup, sqs_client, wakeup_body
from trace_aws.sqs_worker import SqsWorker, SqsWorkerSettings
from trace_core.authoring.context import OperatorError, OperatorResult, TaskContext
from trace_core.clock import ManualClock
from trace_core.dag import parse_dag
from trace_core.dispatcher.inprocess import InProcessWakeupQueue
from trace_core.dispatcher.inprocess_client import InProcessClient
from trace_core.dispatcher.service import Dispatcher
from trace_core.errors import ConfigurationError, InvalidInput, NotFound
from trace_core.outage import LoopHealth
from trace_core.storage.sql import SqlRepository

if TYPE_CHECKING:
    from mypy_boto3_sqs import SQSClient

pytestmark = pytest.mark.anyio

REGION = "us-east-1"
QUEUE = "trace-ecs-platform"
UDF = "trace-ecs-udf"


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


class OnLog(logging.Handler):
    """Sets ``event`` when a record containing ``text`` is logged (in the event loop)."""

    def __init__(self, text: str, event: anyio.Event) -> None:
        super().__init__(logging.DEBUG)
        self.text, self.event = text, event

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


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
        (
            json.dumps({"task_id": "905c7f3f-9b74-4190-9c35-4a184ff9dd8f", "x": 1}),
            "body",
            "unexpected keys ['x']",
        ),
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
    with pytest.raises(NotFound, match="sqs GetQueueUrl: the queue does not exist"):
        await queue.send("no-such-queue", [uuid.uuid4()])
    await queue.send(QUEUE, [uuid.uuid4()])  # URL now cached
    sqs.delete_queue(QueueUrl=queue_url)
    with pytest.raises(NotFound, match="sqs SendMessageBatch: the queue does not exist"):
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
        with pytest.raises(
            AwsRequestFailed, match=r"AWS sqs SendMessageBatch was refused \(InternalError\)"
        ):
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
        with pytest.raises(AwsRequestFailed) as denied:
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


# --- the worker loop ----------------------------------------------------------------
# A real Dispatcher on SQLite (the loop is not storage behaviour), its wake-ups on
# moto's SQS, and the tests' workers polling them.


@pytest.fixture
def engine() -> str:
    return "sqlite"


@dataclass
class SqsPlatform:
    """A deployed Dispatcher whose wake-ups go to SQS, with a DLQ behind both queues."""

    platform: Platform
    sqs: SQSClient
    urls: dict[str, str]
    dlq: str
    received: dict[str, list[str]] = field(default_factory=dict)
    received_ids: list[str] = field(default_factory=list)
    last_url: str = ""

    def worker(self, follow: Any, double: Any = None, **kwargs: Any) -> SqsWorker:
        queue = kwargs.pop("queue", UDF)
        client = kwargs.pop("client", None)
        sleep = kwargs.pop("sleep", no_heartbeat)
        settings = SqsWorkerSettings(self.urls[queue], wait_seconds=0, **kwargs)
        wrapper = wrapper_for(self.platform, follow, double, client=client)
        return SqsWorker(self.sqs, wrapper, settings, sleep=sleep)

    def counts(self, queue: str = UDF) -> tuple[int, int]:
        """(visible, in flight) messages of ``queue``."""
        names: Any = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
        got = self.sqs.get_queue_attributes(QueueUrl=self.urls[queue], AttributeNames=names)
        return tuple(int(got["Attributes"][n]) for n in names)  # type: ignore[return-value]

    def reappear(self, queue: str = UDF) -> None:
        """What the visibility timeout does for a dead worker: what was received
        from ``queue`` and not deleted is visible again."""
        for receipt in self.received.pop(queue, []):
            with contextlib.suppress(self.sqs.exceptions.ReceiptHandleIsInvalid):
                self.sqs.change_message_visibility(
                    QueueUrl=self.urls[queue], ReceiptHandle=receipt, VisibilityTimeout=0
                )
        assert self.counts(queue)[1] == 0, "still in flight"

    def record_receipts(self, params: Any = None, parsed: Any = None, **_: Any) -> None:
        """``after-call`` hook: remember each received message's receipt handle."""
        queue = {url: name for name, url in self.urls.items()}.get(self.last_url, self.last_url)
        messages = parsed.get("Messages", [])
        self.received.setdefault(queue, []).extend(m["ReceiptHandle"] for m in messages)
        self.received_ids.extend(m["MessageId"] for m in messages)


@pytest.fixture
async def aws(repo: SqlRepository, clock: ManualClock, sqs: SQSClient) -> SqsPlatform:
    dlq = sqs.create_queue(QueueName="trace-dlq")["QueueUrl"]
    dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"][
        "QueueArn"
    ]
    redrive = json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": "5"})
    urls = {
        name: sqs.create_queue(QueueName=name, Attributes={"RedrivePolicy": redrive})["QueueUrl"]
        for name in (UDF, QUEUE)
    }
    wakeups = SqsWakeupQueue(sqs)
    dispatcher = Dispatcher(repo, operators=DEPLOYED, clock=clock, wakeups=wakeups)
    deployed = await dispatcher.deploy(parse_dag(DAG, operators=DEPLOYED.names()))
    platform = Platform(dispatcher, deployed, clock, InProcessWakeupQueue())
    aws = SqsPlatform(platform, sqs, urls, dlq)

    def note_url(params: Any, **_: Any) -> None:
        aws.last_url = params["QueueUrl"]

    sqs.meta.events.register("provide-client-params.sqs.ReceiveMessage", note_url)
    sqs.meta.events.register("after-call.sqs.ReceiveMessage", aws.record_receipts)
    return aws


async def wake(aws: SqsPlatform, key: str = "run-1") -> uuid.UUID:
    """Trigger the source task; the Dispatcher's relay sends its wake-up to SQS."""
    task_id = await aws.platform.trigger(key)
    await aws.platform.dispatcher.run_once()
    return task_id


async def test_wakeups_from_the_dispatcher_run_through_sqs_and_are_deleted(
    aws: SqsPlatform,
) -> None:
    async def follow(ctx: TaskContext) -> OperatorResult:
        return OperatorResult(events=[aws.platform.partition(0, 9), aws.platform.partition(10, 19)])

    task_id = await wake(aws)
    source = aws.worker(follow)
    assert await source.poll_once() == 1
    assert source.outcomes == {"completed": 1}
    assert (await aws.platform.task(task_id))["status"] == "Completed"
    assert aws.counts(UDF) == (0, 0)  # deleted

    await aws.platform.dispatcher.run_once()  # routes the events: two wake-ups on QUEUE
    downstream = aws.worker(follow, relay_partition, queue=QUEUE, concurrency=2)
    await downstream.run(max_messages=2)
    assert downstream.outcomes == {"completed": 2}
    assert {t["status"] for t in await aws.platform.tasks_of("double")} == {"Completed"}
    assert aws.counts(QUEUE) == (0, 0)


async def test_duplicates_and_a_wakeup_for_a_completed_task_run_nothing_and_are_deleted(
    aws: SqsPlatform,
) -> None:
    runs: list[str] = []
    task_id = await wake(aws)
    await SqsWakeupQueue(aws.sqs).send(UDF, [task_id, task_id])  # two duplicates
    worker = aws.worker(lambda ctx: runs.append("ran"), concurrency=3)
    await worker.run(max_messages=3)
    assert runs == ["ran"]
    assert worker.outcomes["completed"] == 1
    # The duplicates ran beside the first (AlreadyRunning) or after it (Completed).
    assert sum(worker.outcomes.values()) == 3
    assert set(worker.outcomes) <= {"completed", "AlreadyRunning", "Completed"}
    assert aws.counts(UDF) == (0, 0)

    await SqsWakeupQueue(aws.sqs).send(UDF, [task_id])  # late, after completion
    assert await worker.poll_once() == 1
    assert worker.outcomes["Completed"] >= 1 and runs == ["ran"]
    assert aws.counts(UDF) == (0, 0)


async def test_failed_and_stale_attempts_delete_their_wakeups_too(aws: SqsPlatform) -> None:
    async def crash(ctx: TaskContext) -> None:
        raise OperatorError("boom", retryable=False)

    failed_id = await wake(aws, "run-1")
    worker = aws.worker(crash)
    assert await worker.poll_once() == 1
    assert worker.outcomes == {"failed": 1}
    assert (await aws.platform.task(failed_id))["status"] == "Failed"
    assert aws.counts(UDF) == (0, 0)

    async def outlived(ctx: TaskContext) -> OperatorResult:
        # The lease expires and another worker claims attempt 2 meanwhile.
        await aws.platform.reclaim(ctx.task_id)
        return OperatorResult(events=[aws.platform.partition(0, 9)])

    stale_id = await wake(aws, "run-2")
    worker = aws.worker(outlived)
    assert await worker.poll_once() == 1
    assert worker.outcomes == {"stale": 1}
    assert await aws.platform.events_of(stale_id) == []  # the stale attempt wrote nothing
    assert aws.counts(UDF) == (0, 0)


async def test_a_poison_message_goes_to_the_dead_letter_queue_and_the_loop_carries_on(
    aws: SqsPlatform,
) -> None:
    runs: list[str] = []
    url = aws.urls[UDF]
    aws.sqs.send_message(QueueUrl=url, MessageBody='{"task_id": "not-a-uuid"}')
    aws.sqs.send_message(QueueUrl=url, MessageBody="garbage")
    await wake(aws)
    worker = aws.worker(lambda ctx: runs.append("ran"), concurrency=3)
    await worker.run(max_messages=3)
    assert worker.outcomes == {"malformed": 2, "completed": 1}
    assert runs == ["ran"]
    assert aws.counts(UDF) == (0, 0)
    dead = aws.sqs.receive_message(
        QueueUrl=aws.dlq, MaxNumberOfMessages=10, MessageAttributeNames=["All"]
    )["Messages"]
    assert sorted(m["Body"] for m in dead) == ["garbage", '{"task_id": "not-a-uuid"}']
    reasons = {m["MessageAttributes"]["trace-error"]["StringValue"] for m in dead}
    assert reasons == {"body.task_id: not a UUID", "body: not JSON"}
    assert {m["MessageAttributes"]["trace-source-queue"]["StringValue"] for m in dead} == {url}


async def test_a_queue_without_a_dead_letter_queue_is_refused_at_start(
    aws: SqsPlatform,
) -> None:
    bare = aws.sqs.create_queue(QueueName="no-dlq")["QueueUrl"]
    wrapper = wrapper_for(aws.platform, lambda ctx: None)
    worker = SqsWorker(aws.sqs, wrapper, SqsWorkerSettings(bare, wait_seconds=0))
    with pytest.raises(ConfigurationError, match="no-dlq: no RedrivePolicy"):
        await worker.run(max_messages=1)


async def test_a_long_task_keeps_its_message_invisible_until_it_finishes(
    aws: SqsPlatform,
) -> None:
    ticks = Ticker()
    release = anyio.Event()
    extended: list[tuple[str, int]] = []
    aws.sqs.meta.events.register(
        "provide-client-params.sqs.ChangeMessageVisibility",
        lambda params, **_: extended.append((params["ReceiptHandle"], params["VisibilityTimeout"])),
    )
    received: list[str] = []
    aws.sqs.meta.events.register(
        "after-call.sqs.ReceiveMessage",
        lambda parsed, **_: received.extend(m["ReceiptHandle"] for m in parsed.get("Messages", [])),
    )

    async def follow(ctx: TaskContext) -> None:
        await release.wait()

    task_id = await wake(aws)
    worker = aws.worker(follow, sleep=ticks.sleep, visibility_seconds=30, extend_seconds=10)
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(worker.poll_once)
            await ticks.wait_for_sleeps(1)
            assert ticks.delays == [10]
            for n in (2, 3):
                ticks.tick()
                await ticks.wait_for_sleeps(n)  # one extension done per tick
            assert extended == [(received[0], 30), (received[0], 30)]
            assert aws.counts(UDF) == (0, 1)  # in flight while it runs
            release.set()
    finally:
        ticks.close()
    assert worker.outcomes == {"completed": 1}
    assert len(extended) == 2  # no extension after the task finished
    assert aws.counts(UDF) == (0, 0)
    assert (await aws.platform.task(task_id))["status"] == "Completed"


async def test_a_throttled_extension_is_tried_again_and_an_invalid_receipt_ends_them(
    aws: SqsPlatform,
) -> None:
    # Stubber: moto neither throttles nor invalidates a receipt on purpose.
    client = sqs_client(REGION)
    ticks = Ticker()
    release = anyio.Event()

    async def follow(ctx: TaskContext) -> None:
        await release.wait()

    task_id = await wake(aws)
    wrapper = wrapper_for(aws.platform, follow)
    settings = SqsWorkerSettings(URL, visibility_seconds=30, dead_letter_url=aws.dlq)
    worker = SqsWorker(client, wrapper, settings, sleep=ticks.sleep)
    message: Any = {"MessageId": "m-1", "ReceiptHandle": "r-1", "Body": wakeup_body(task_id)}
    gave_up = anyio.Event()
    handler = OnLog("visibility can no longer be extended", gave_up)
    logger = logging.getLogger("trace_aws.sqs_worker")
    logger.addHandler(handler)
    with Stubber(client) as stub:
        stub.add_client_error("change_message_visibility", "ThrottlingException")
        stub.add_client_error("change_message_visibility", "ReceiptHandleIsInvalid")
        stub.add_response("delete_message", {}, {"QueueUrl": URL, "ReceiptHandle": "r-1"})
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(worker.handle, message)
                await ticks.wait_for_sleeps(1)
                ticks.tick()  # throttled: tried again after the next sleep
                await ticks.wait_for_sleeps(2)
                ticks.tick()  # invalid receipt: no more extensions
                with anyio.fail_after(WAIT):
                    await gave_up.wait()
                release.set()
        finally:
            ticks.close()
            logger.removeHandler(handler)
        stub.assert_no_pending_responses()
    assert len(ticks.delays) == 2
    assert worker.outcomes == {"completed": 1}


async def test_a_dead_workers_wakeup_reappears_and_the_lease_decides(aws: SqsPlatform) -> None:
    runs: list[int] = []
    task_id = await wake(aws)
    # A worker claimed the task, then was SIGKILLed: nothing deleted its message.
    aws.sqs.receive_message(QueueUrl=aws.urls[UDF], VisibilityTimeout=30)
    assert (await aws.platform.dispatcher.tasks.claim(task_id, "dead-worker")).lease is not None
    aws.reappear()
    worker = aws.worker(lambda ctx: runs.append(ctx.attempt))
    assert await worker.poll_once() == 1
    assert worker.outcomes == {"AlreadyRunning": 1} and runs == []
    assert aws.counts(UDF) == (0, 0)

    # Its lease expires; the retry sends a new wake-up, which runs attempt 2.
    aws.platform.clock.advance(EXPIRE)
    await aws.platform.dispatcher.run_once()
    aws.platform.clock.advance(BACKOFF)
    await aws.platform.dispatcher.run_once()
    assert await worker.poll_once() == 1
    assert runs == [2] and worker.outcomes["completed"] == 1
    assert (await aws.platform.task(task_id))["status"] == "Completed"


async def test_a_control_plane_outage_keeps_the_wakeup_until_the_claim_is_made(
    aws: SqsPlatform,
) -> None:
    runs: list[str] = []
    flaky = FlakyClient(InProcessClient(aws.platform.control), {"claim": 1})
    task_id = await wake(aws)
    worker = aws.worker(lambda ctx: runs.append("ran"), client=flaky, requeue_delay_seconds=0)
    ids = aws.received_ids
    assert await worker.poll_once() == 1
    assert worker.outcomes == {"kept": 1} and runs == []
    # Kept: sent again as a new message (a fresh receive count), the received one deleted.
    assert aws.counts(UDF) == (1, 0)
    assert await worker.poll_once() == 1
    assert len(set(ids)) == 2  # two messages, not one received twice
    assert worker.outcomes == {"kept": 1, "completed": 1} and runs == ["ran"]
    assert aws.counts(UDF) == (0, 0)
    assert (await aws.platform.task(task_id))["status"] == "Completed"


async def test_a_throttled_receive_backs_off_and_a_deleted_queue_ends_the_loop(
    aws: SqsPlatform,
) -> None:
    client = sqs_client(REGION)
    sleep = NoWait()
    wrapper = wrapper_for(aws.platform, lambda ctx: None)
    health = LoopHealth("test", sleep=sleep, unavailable=(AwsUnavailable,))
    settings = SqsWorkerSettings(URL, wait_seconds=0, dead_letter_url=aws.dlq)
    worker = SqsWorker(client, wrapper, settings, health=health)
    with Stubber(client) as stub:
        stub.add_client_error("receive_message", "ThrottlingException", http_status_code=400)
        stub.add_client_error("receive_message", "InternalError", http_status_code=500)
        stub.add_client_error(
            "receive_message", "AWS.SimpleQueueService.NonExistentQueue", http_status_code=400
        )
        with pytest.raises(NotFound, match="sqs ReceiveMessage: the queue does not exist"):
            await worker.run()
        stub.assert_no_pending_responses()
    assert len(sleep.delays) == 2 and health.total_failures == 2


async def test_stop_ends_an_idle_loop(aws: SqsPlatform) -> None:
    worker = aws.worker(lambda ctx: None)
    polls: list[int] = []

    def stop_on_third(**_: Any) -> None:
        polls.append(1)
        if len(polls) == 3:  # in boto3's thread: stop() belongs to the event loop
            anyio.from_thread.run_sync(worker.stop)

    aws.sqs.meta.events.register("provide-client-params.sqs.ReceiveMessage", stop_on_third)
    with anyio.fail_after(WAIT):
        await worker.run()
    assert len(polls) == 3 and worker.outcomes == {}


async def test_stop_abandons_a_long_poll_at_once(aws: SqsPlatform) -> None:
    worker = aws.worker(lambda ctx: None)
    polling, release = threading.Event(), threading.Event()

    def long_poll(**_: Any) -> None:
        """A receive that waits (in boto3's thread) until the test releases it."""
        polling.set()
        release.wait(WAIT)

    aws.sqs.meta.events.register("provide-client-params.sqs.ReceiveMessage", long_poll)
    try:
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as group:
                group.start_soon(worker.run)
                assert await anyio.to_thread.run_sync(polling.wait, WAIT)
                worker.stop()
            # run() returned while the poll still waits.
            assert not release.is_set()
    finally:
        release.set()


async def test_never_more_messages_in_hand_than_free_slots(aws: SqsPlatform) -> None:
    release, both_running = anyio.Event(), anyio.Event()
    started: list[uuid.UUID] = []

    async def follow(ctx: TaskContext) -> None:
        started.append(ctx.task_id)
        if len(started) == 2:
            both_running.set()
        await release.wait()

    asked: list[int] = []
    aws.sqs.meta.events.register(
        "provide-client-params.sqs.ReceiveMessage",
        lambda params, **_: asked.append(params["MaxNumberOfMessages"]),
    )
    for key in ("a", "b", "c"):
        await wake(aws, key)
    worker = aws.worker(follow, concurrency=2)
    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as group:
            group.start_soon(functools.partial(worker.run, max_messages=3))
            await both_running.wait()
            assert aws.counts(UDF) == (1, 2)  # the third waits on the queue, not in hand
            release.set()
    assert worker.outcomes == {"completed": 3}
    assert asked[0] == 2 and max(asked) <= 2
    assert aws.counts(UDF) == (0, 0)


def test_worker_settings_are_checked() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"queue_url": ""}, "queue_url"),
        ({"wait_seconds": 21}, "wait_seconds"),
        ({"concurrency": 0}, "concurrency"),
        ({"visibility_seconds": 0}, "visibility_seconds"),
        ({"visibility_seconds": 30, "extend_seconds": 30}, "extend_seconds"),
        ({"requeue_delay_seconds": 901}, "requeue_delay_seconds"),
    ]
    for bad, name in cases:
        with pytest.raises(ConfigurationError, match=name):
            SqsWorkerSettings(**{"queue_url": URL, **bad})
    assert SqsWorkerSettings(URL, visibility_seconds=90).extend_every == 30
