"""The SQS dataset buffer and its sink against moto (in-process ``mock_aws``) and Postgres.

The sink writes a message's records into Postgres, commits, emits the
dataset event and only then deletes the message: a crash before the delete
redelivers the message, which adds no row and no second event. A message the
sink cannot use goes to the dead-letter queue with the reason naming the
field. The state and data databases are the throwaway Postgres (the aws
profile runs on Postgres; the shared RecordWriter is tested on both engines
in tests/test_buffered_sink.py).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import pytest

from tests.test_aws_sqs import aws_env, drain  # noqa: F401  (fixture)
from tests.test_aws_sqs import sqs as sqs  # the fixture
from tests.test_buffered_sink import NOTE_A, NOTE_B, NOTES, Kit
from tests.test_buffered_sink import kit as kit  # the fixture
from trace_aws.sqs_buffer import (
    BufferMessage,
    SqsBufferSink,
    SqsDatasetBuffer,
    SqsSinkSettings,
    buffer_bodies,
    parse_buffer_message,
)
from trace_core.authoring.events import AcceptResult, DatasetEvent
from trace_core.errors import ConfigurationError, InvalidInput, NotFound
from trace_lite.buffered import RecordWriter

if TYPE_CHECKING:
    from mypy_boto3_sqs import SQSClient

pytestmark = pytest.mark.anyio


@pytest.fixture
def engine() -> str:
    """Postgres only: the aws profile's state and buffered-data databases."""
    return "postgres"


class Crash(BaseException):
    """The sink process dying at a chosen point (nothing catches it)."""


class Queues:
    """A buffer queue whose redrive policy names a dead-letter queue."""

    def __init__(self, client: SQSClient) -> None:
        self.sqs = sqs = client
        self.dlq = sqs.create_queue(QueueName="notes-dlq")["QueueUrl"]
        arn = sqs.get_queue_attributes(QueueUrl=self.dlq, AttributeNames=["QueueArn"])
        redrive = json.dumps(
            {"deadLetterTargetArn": arn["Attributes"]["QueueArn"], "maxReceiveCount": "5"}
        )
        self.url = sqs.create_queue(QueueName="notes", Attributes={"RedrivePolicy": redrive})[
            "QueueUrl"
        ]

    def dead(self) -> list[tuple[str, str]]:
        """``(body, trace-error)`` of every dead-lettered message (received, not deleted)."""
        got = self.sqs.receive_message(
            QueueUrl=self.dlq, MaxNumberOfMessages=10, MessageAttributeNames=["All"]
        )
        return [
            (m["Body"], m["MessageAttributes"]["trace-error"]["StringValue"])
            for m in got.get("Messages", [])
        ]

    def left(self) -> int:
        attrs = self.sqs.get_queue_attributes(
            QueueUrl=self.url,
            AttributeNames=[
                "ApproximateNumberOfMessages",
                "ApproximateNumberOfMessagesNotVisible",
            ],
        )["Attributes"]
        return sum(int(v) for v in attrs.values())


@pytest.fixture
def queues(sqs: SQSClient) -> Queues:
    return Queues(sqs)


def buffer_of(kit: Kit, queues: Queues) -> SqsDatasetBuffer:
    return SqsDatasetBuffer(queues.sqs, {kit.notes: queues.url})


def sink_of(
    kit: Kit,
    queues: Queues,
    *,
    client: Any = None,
    gateway: Any = None,
    visibility_seconds: int = 60,
) -> SqsBufferSink:
    return SqsBufferSink(
        cast("SQSClient", client or queues.sqs),
        RecordWriter(kit.data, kit.repo, [NOTES], clock=kit.dispatcher.clock),
        SqsSinkSettings(queues.url, visibility_seconds=visibility_seconds),
        gateway=gateway or kit.dispatcher.gateway,
    )


async def publish(kit: Kit, queues: Queues, records: Sequence[dict[str, Any]], **kw: Any) -> None:
    await buffer_of(kit, queues).publish(
        kit.notes,
        records,
        producer_task_id=kw.get("producer", kit.producer),
        attempt=1,
        schema_hash=kw.get("schema_hash", NOTES.schema_hash),
    )


def send_raw(queues: Queues, body: str) -> None:
    queues.sqs.send_message(QueueUrl=queues.url, MessageBody=body)


# --- the message body ---------------------------------------------------------------


async def test_a_published_batch_is_one_message_in_the_contracts_shape(
    kit: Kit,
    queues: Queues,
) -> None:
    await publish(kit, queues, [NOTE_A, NOTE_B])
    [body] = drain(queues.sqs, queues.url)
    assert json.loads(body) == {
        "dataset_uuid": str(kit.notes),
        "schema_hash": NOTES.schema_hash,
        "records": [NOTE_A, NOTE_B],
        "producer_task_id": str(kit.producer),
        "attempt": 1,
    }
    assert parse_buffer_message(body).records == [NOTE_A, NOTE_B]


def test_a_large_batch_is_split_over_messages_that_each_fit() -> None:
    records = [{"dedupe_key": f"k{i}", "text": "x" * 100} for i in range(40)]
    batch = BufferMessage(uuid.UUID(int=1), "sha256:ab", records, uuid.UUID(int=2), 3)
    bodies = buffer_bodies(batch, max_bytes=1_000)
    assert len(bodies) > 1
    assert all(len(b.encode()) <= 1_000 for b in bodies)
    parts = [parse_buffer_message(b) for b in bodies]
    assert [r for p in parts for r in p.records] == records
    assert {(p.dataset_uuid, p.schema_hash, p.producer_task_id, p.attempt) for p in parts} == {
        (uuid.UUID(int=1), "sha256:ab", uuid.UUID(int=2), 3)
    }
    with pytest.raises(InvalidInput, match=r"records\[1\].*does not fit"):
        buffer_bodies(
            BufferMessage(
                batch.dataset_uuid, "sha256:ab", [{}, {"t": "x" * 2_000}], batch.producer_task_id, 1
            ),
            max_bytes=1_000,
        )


@pytest.mark.parametrize(
    ("body", "field", "reason"),
    [
        ("not json", "body", "not JSON"),
        ("[]", "body", "not a JSON object"),
        (
            '{"schema_hash": "s", "records": [], "producer_task_id": "x", "attempt": 1}',
            "body.dataset_uuid",
            "missing",
        ),
        (
            '{"dataset_uuid": "nope", "schema_hash": "s", "records": [],'
            ' "producer_task_id": "x", "attempt": 1}',
            "body.dataset_uuid",
            "not a UUID",
        ),
        (
            '{"dataset_uuid": "00000000-0000-0000-0000-000000000001", "schema_hash": "s",'
            ' "records": {}, "producer_task_id": "00000000-0000-0000-0000-000000000002",'
            ' "attempt": 1}',
            "body.records",
            "not a list",
        ),
        (
            '{"dataset_uuid": "00000000-0000-0000-0000-000000000001", "schema_hash": "s",'
            ' "records": [], "producer_task_id": "00000000-0000-0000-0000-000000000002",'
            ' "attempt": 0}',
            "body.attempt",
            "not a positive integer",
        ),
    ],
)
def test_a_malformed_body_names_the_field(body: str, field: str, reason: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        parse_buffer_message(body)
    assert caught.value.field == field
    assert reason in str(caught.value)


# --- the sink -----------------------------------------------------------------------


async def test_the_sink_writes_commits_emits_then_deletes(kit: Kit, queues: Queues) -> None:
    await publish(kit, queues, [NOTE_A, NOTE_B])
    report = await sink_of(kit, queues).run_once()

    assert (report.batches, report.rows_written, report.events, report.dead) == (1, 2, 1, 0)
    org = str(kit.org_id)
    assert await kit.rows() == [(org, "a", "first", 1), (org, "b", "second", 2)]
    [cursor] = await kit.events()
    assert uuid.UUID(str(cursor))  # the message id
    assert queues.left() == 0


async def test_a_republished_batch_adds_no_rows_and_no_event(kit: Kit, queues: Queues) -> None:
    await publish(kit, queues, [NOTE_A])
    await publish(kit, queues, [NOTE_A])  # the producer's retry: a new message
    report = await sink_of(kit, queues).run_once()
    assert (report.batches, report.rows_written, report.duplicates, report.events) == (2, 1, 1, 1)
    assert len(await kit.rows()) == 1
    assert len(await kit.events()) == 1


class DeleteCrashes:
    """The SQS client of a sink that dies after the event, before the delete."""

    def __init__(self, client: SQSClient) -> None:
        self._sqs = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sqs, name)

    def delete_message(self, **_: Any) -> None:
        raise Crash("killed before DeleteMessage")


class GatewayCrashes:
    """The gateway of a sink that dies after the commit, before the event."""

    async def accept(self, events: Sequence[DatasetEvent], **_: Any) -> AcceptResult:
        raise Crash("killed before the event")


@pytest.mark.parametrize("crash_at", ["before-event", "before-delete"])
async def test_a_crash_after_the_commit_redelivers_idempotently(
    kit: Kit,
    queues: Queues,
    crash_at: str,
) -> None:
    await publish(kit, queues, [NOTE_A, NOTE_B])
    # Visibility 0: the crashed sink's message is visible again at once
    # (instead of after a timeout the test would have to wait for).
    crashing = (
        sink_of(kit, queues, gateway=GatewayCrashes(), visibility_seconds=0)
        if crash_at == "before-event"
        else sink_of(kit, queues, client=DeleteCrashes(queues.sqs), visibility_seconds=0)
    )
    with pytest.raises(Crash):
        await crashing.run_once()
    assert len(await kit.rows()) == 2  # committed...
    assert len(await kit.events()) == (0 if crash_at == "before-event" else 1)
    assert queues.left() == 1  # ...but the message is still there

    report = await sink_of(kit, queues).run_once()  # the restarted sink
    assert (report.batches, report.rows_written, report.duplicates) == (1, 0, 2)
    assert len(await kit.rows()) == 2  # no row twice
    assert len(await kit.events()) == 1  # the event exactly once (same cursor)
    assert queues.left() == 0


async def test_malformed_messages_go_to_the_dead_letter_queue(kit: Kit, queues: Queues) -> None:
    send_raw(queues, "not json")
    send_raw(queues, json.dumps({"dataset_uuid": str(kit.notes)}))
    await publish(kit, queues, [NOTE_A])  # a good message behind them

    report = await sink_of(kit, queues).run_once()
    assert (report.dead, report.rows_written) == (2, 1)
    dead = dict(queues.dead())
    assert dead["not json"] == "body: not JSON"
    assert dead[json.dumps({"dataset_uuid": str(kit.notes)})] == "body.attempt: missing"
    assert queues.left() == 0
    assert len(await kit.events()) == 1


async def test_a_schema_mismatch_is_dead_lettered_with_a_clear_error(
    kit: Kit,
    queues: Queues,
) -> None:
    await publish(kit, queues, [NOTE_A], schema_hash="sha256:" + "0" * 64)
    await publish(kit, queues, [{**NOTE_B, "level": "high"}])
    await publish(kit, queues, [{**NOTE_B, "colour": "red"}])

    report = await sink_of(kit, queues).run_once()
    assert (report.dead, report.rows_written, report.events) == (3, 0, 0)
    errors = sorted(error for _, error in queues.dead())
    assert len(errors) == 3
    assert any("records[0].colour" in e and "not a column of notes" in e for e in errors)
    assert any("records[0].level" in e and "must be int" in e for e in errors)
    assert any("schema_hash" in e and "not a known schema" in e for e in errors)
    assert queues.left() == 0


async def test_a_queue_without_a_dead_letter_queue_is_refused_before_receiving(
    kit: Kit,
    queues: Queues,
) -> None:
    bare = queues.sqs.create_queue(QueueName="bare")["QueueUrl"]
    send_raw(queues, "not json")
    sink = SqsBufferSink(
        queues.sqs,
        RecordWriter(kit.data, kit.repo, [NOTES]),
        SqsSinkSettings(bare),
        gateway=kit.dispatcher.gateway,
    )
    with pytest.raises(ConfigurationError, match="bare: no RedrivePolicy"):
        await sink.run_once()


async def test_publishing_needs_the_datasets_queue(kit: Kit, queues: Queues) -> None:
    other = kit.deployed.datasets["other_notes"].dataset_uuid
    with pytest.raises(ConfigurationError, match=f"dataset {other}: no buffer queue"):
        await buffer_of(kit, queues).publish(
            other, [NOTE_A], producer_task_id=kit.producer, attempt=1, schema_hash="s"
        )
    queues.sqs.delete_queue(QueueUrl=queues.url)
    with pytest.raises(NotFound, match="SendMessage"):
        await publish(kit, queues, [NOTE_A])


async def test_a_deleted_buffer_queue_is_not_found_for_the_sink(kit: Kit, queues: Queues) -> None:
    sink = sink_of(kit, queues)
    assert (await sink.run_once()).batches == 0  # the queue works, and is empty
    queues.sqs.delete_queue(QueueUrl=queues.url)
    with pytest.raises(NotFound, match="ReceiveMessage"):
        await sink.run_once()
