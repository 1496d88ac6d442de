"""Buffered Postgres datasets on SQS: the :class:`DatasetBuffer` and its sink.

interface-contracts.md "Buffered Postgres Datasets": a producer publishes
records to its dataset's buffer (one SQS queue per dataset); a
platform-managed sink drains the queue, writes the dataset's Postgres table
idempotently (``UNIQUE (org_id, dedupe_key)``) and emits the dataset event
after the commit. Producers never hold Postgres credentials.

A message body is the contract's, plus the producing attempt the sink needs
to find the producer's org and dataset version (the lite buffer keeps the
same fields in its table)::

    {"dataset_uuid": "<uuid>", "schema_hash": "sha256:...", "records": [...],
     "producer_task_id": "<uuid>", "attempt": 1}

A batch too large for one message (SQS's 256 KiB) is split over several;
records are deduplicated one by one, so a split changes nothing.

:class:`SqsBufferSink` handles each received message in this order:

1. check it (:class:`~trace_lite.buffered.RecordWriter`, shared with the lite
   sink): a body that is not a buffer message, an unknown ``schema_hash``, a
   record that does not match its schema, another org's record or a dataset
   the task does not produce is moved to the queue's dead-letter queue with
   the reason (naming the field) as a message attribute — it never blocks the
   messages behind it;
2. insert its records in one Postgres transaction (``ON CONFLICT DO
   NOTHING``) and commit;
3. emit the dataset event, its cursor the SQS ``MessageId`` (the same for
   every delivery of a message), if the insert added rows or the message was
   delivered before (``ApproximateReceiveCount > 1``: the earlier delivery
   may have committed without emitting; the gateway deduplicates the event by
   its cursor);
4. delete the message.

A crash anywhere before step 4 leaves the message on the queue: it comes back
after its visibility timeout, its insert adds nothing, and its event is
emitted at most once more under the same cursor. The event comes before the
delete on purpose: the other order loses the event if the sink dies between
them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trace_aws.sqs import BATCH_LIMIT, call_sqs, json_object
from trace_aws.sqs_dead_letter import DeadLetterQueue
from trace_core.authoring.events import DatasetEvent
from trace_core.dispatcher.events import EventGateway
from trace_core.dispatcher.periodic import PeriodicService, require_positive
from trace_core.errors import ConfigurationError, InvalidInput
from trace_lite.buffered import RecordWriter, SinkReport

if TYPE_CHECKING:
    from mypy_boto3_sqs import SQSClient
    from mypy_boto3_sqs.type_defs import MessageTypeDef

__all__ = [
    "MAX_BODY_BYTES",
    "BufferMessage",
    "SqsBufferSink",
    "SqsDatasetBuffer",
    "SqsSinkSettings",
    "buffer_bodies",
    "parse_buffer_message",
]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 256 * 1024
"""SQS's classic message size limit (the larger limit is not on every endpoint)."""

_KEYS = frozenset({"dataset_uuid", "schema_hash", "records", "producer_task_id", "attempt"})


@dataclass(frozen=True)
class BufferMessage:
    """One buffer message: a batch (or part of one) of a producer's records."""

    dataset_uuid: uuid.UUID
    schema_hash: str
    records: list[Any]
    producer_task_id: uuid.UUID
    attempt: int


def _uuid(message: Mapping[str, Any], key: str) -> uuid.UUID:
    value = message[key]
    if not isinstance(value, str):
        raise InvalidInput(f"body.{key}", "not a string")
    try:
        return uuid.UUID(value)
    except ValueError:
        raise InvalidInput(f"body.{key}", "not a UUID") from None


def parse_buffer_message(body: str) -> BufferMessage:
    """The batch of a buffer message body; :class:`InvalidInput` naming what is wrong.

    Only the envelope is checked here; the records are checked against their
    schema by the sink.
    """
    message = json_object(body)
    missing, extra = sorted(_KEYS - set(message)), sorted(set(message) - _KEYS)
    if missing:
        raise InvalidInput(f"body.{missing[0]}", "missing")
    if extra:
        raise InvalidInput("body", f"unexpected keys {extra}")
    schema_hash, records, attempt = message["schema_hash"], message["records"], message["attempt"]
    if not isinstance(schema_hash, str) or not schema_hash:
        raise InvalidInput("body.schema_hash", "not a non-empty string")
    if not isinstance(records, list):
        raise InvalidInput("body.records", "not a list")
    if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 1:
        raise InvalidInput("body.attempt", "not a positive integer")
    return BufferMessage(
        _uuid(message, "dataset_uuid"),
        schema_hash,
        records,
        _uuid(message, "producer_task_id"),
        attempt,
    )


def _body(batch: BufferMessage) -> str:
    return json.dumps(
        {
            "dataset_uuid": str(batch.dataset_uuid),
            "schema_hash": batch.schema_hash,
            "records": batch.records,
            "producer_task_id": str(batch.producer_task_id),
            "attempt": batch.attempt,
        },
        separators=(",", ":"),
    )


def buffer_bodies(batch: BufferMessage, *, max_bytes: int = MAX_BODY_BYTES) -> list[str]:
    """The message bodies of ``batch``: one, or several that each fit ``max_bytes``.

    :class:`InvalidInput` naming the record if one alone does not fit, or if a
    record is not JSON.
    """
    bodies: list[str] = []
    chunk: list[Any] = []

    def encode(records: list[Any]) -> str:
        return _body(dataclasses.replace(batch, records=records))

    for i, record in enumerate(batch.records):
        try:
            alone = encode([record])
        except (TypeError, ValueError):
            raise InvalidInput(f"records[{i}]", "is not JSON-serialisable") from None
        if len(alone.encode()) > max_bytes:
            raise InvalidInput(f"records[{i}]", f"does not fit one SQS message ({max_bytes} bytes)")
        if chunk and len(encode([*chunk, record]).encode()) > max_bytes:
            bodies.append(encode(chunk))
            chunk = []
        chunk.append(record)
    if chunk or not bodies:
        bodies.append(encode(chunk))
    return bodies


class SqsDatasetBuffer:
    """The :class:`~trace_core.dispatcher.buffer.DatasetBuffer` port on SQS.

    ``queue_urls`` maps each buffered dataset to its queue's URL; publishing to
    a dataset without one is a :class:`ConfigurationError` naming it.
    """

    def __init__(self, client: SQSClient, queue_urls: Mapping[uuid.UUID, str]) -> None:
        self.client = client
        self.queue_urls = dict(queue_urls)

    async def publish(
        self,
        dataset_uuid: uuid.UUID,
        records: Sequence[Mapping[str, Any]],
        *,
        producer_task_id: uuid.UUID,
        attempt: int,
        schema_hash: str,
    ) -> None:
        """Send the batch (split to fit SQS's message size) to the dataset's queue.

        Returns once SQS accepted every part; on an error, parts may already be
        on the queue, and publishing the batch again is safe (the sink
        deduplicates records).
        """
        url = self.queue_urls.get(dataset_uuid)
        if url is None:
            raise ConfigurationError(f"dataset {dataset_uuid}: no buffer queue is configured")
        batch = BufferMessage(
            dataset_uuid, schema_hash, [dict(r) for r in records], producer_task_id, attempt
        )
        for body in buffer_bodies(batch):
            await call_sqs("SendMessage", self.client.send_message, QueueUrl=url, MessageBody=body)


@dataclass(frozen=True)
class SqsSinkSettings:
    """What one :class:`SqsBufferSink` drains and how.

    ``visibility_seconds`` hides a received message while the sink writes it
    (it reappears after that if the sink dies); ``wait_seconds`` is the
    long-poll of each receive; ``interval_seconds`` the pause between passes.
    """

    queue_url: str
    dead_letter_url: str | None = None
    visibility_seconds: int = 60
    wait_seconds: int = 0
    max_messages: int = 100
    """Messages per pass (received ten at a time)."""
    interval_seconds: float = 0.5

    def __post_init__(self) -> None:
        if not self.queue_url:
            raise ConfigurationError("queue_url: the buffer's SQS queue URL is required")
        if not 0 <= self.visibility_seconds <= 43_200:
            raise ConfigurationError("visibility_seconds must be within 0..43200 (SQS's limit)")
        if not 0 <= self.wait_seconds <= 20:
            raise ConfigurationError("wait_seconds must be within 0..20 (SQS's limit)")
        if self.max_messages < 1:
            raise ConfigurationError("max_messages must be >= 1")
        require_positive("SqsSinkSettings.interval_seconds", self.interval_seconds)


class SqsBufferSink(PeriodicService):
    """Drains one dataset buffer queue into Postgres (module docstring)."""

    def __init__(
        self,
        client: SQSClient,
        writer: RecordWriter,
        settings: SqsSinkSettings,
        *,
        gateway: EventGateway | None = None,
    ) -> None:
        super().__init__(settings.interval_seconds)
        self.client = client
        self.writer = writer
        self.settings = settings
        self.gateway = gateway or EventGateway(writer.state, clock=writer.clock)
        self.dead_letters = DeadLetterQueue(client, settings.queue_url, settings.dead_letter_url)

    async def receive(self, max_messages: int) -> list[MessageTypeDef]:
        """One receive of up to ``max_messages`` (at most ten) messages."""
        answer = await call_sqs(
            "ReceiveMessage",
            self.client.receive_message,
            QueueUrl=self.settings.queue_url,
            MaxNumberOfMessages=max(1, min(max_messages, BATCH_LIMIT)),
            WaitTimeSeconds=self.settings.wait_seconds,
            VisibilityTimeout=self.settings.visibility_seconds,
            MessageSystemAttributeNames=["ApproximateReceiveCount"],
        )
        return list(answer.get("Messages", []))

    async def run_once(self) -> SinkReport:
        """Receive and handle up to ``max_messages`` messages, one at a time."""
        await self.dead_letters.url()  # no dead-letter queue: refuse before taking anything
        report = SinkReport()
        left = self.settings.max_messages
        while left > 0:
            messages = await self.receive(left)
            if not messages:
                break
            left -= len(messages)
            for message in messages:
                await self.handle(message, report)
        return report

    async def handle(self, message: MessageTypeDef, report: SinkReport) -> None:
        """Check, write, emit, delete one message (module docstring). Errors of
        Postgres, the gateway or SQS are raised: the message stays and comes back."""
        message_id = message["MessageId"]
        try:
            batch = parse_buffer_message(message.get("Body", ""))
            checked = await self.writer.check(
                batch.dataset_uuid, batch.schema_hash, batch.records, batch.producer_task_id
            )
        except InvalidInput as exc:
            await self.dead_letters.move(message, str(exc))
            report.dead += 1
            return
        async with self.writer.data.engine.begin() as conn:
            inserted = await self.writer.insert(conn, checked)
        report.batches += 1
        report.rows_written += inserted
        report.duplicates += len(checked.values) - inserted
        receives = int(message.get("Attributes", {}).get("ApproximateReceiveCount", "1"))
        if inserted or receives > 1:
            event = DatasetEvent(
                batch.dataset_uuid, checked.producer.dataset_version, cursor=message_id
            )
            await self.gateway.accept([event], producer=None)
            report.events += 1
        await call_sqs(
            "DeleteMessage",
            self.client.delete_message,
            QueueUrl=self.settings.queue_url,
            ReceiptHandle=message["ReceiptHandle"],
        )
