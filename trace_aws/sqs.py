"""SQS wake-ups: the :class:`~trace_core.ports.WakeupQueue` on SQS, and its message body.

A wake-up is exactly ``{"task_id": "<uuid>"}`` (interface-contracts.md,
"SQS -> Worker"). :class:`SqsWakeupQueue` sends them with
``SendMessageBatch`` in groups of ten; an entry SQS reports as failed is sent
again (with backoff) until it is accepted or the attempts run out, and then
the call raises, so the Dispatcher's outbox retries the whole wake-up: a
wake-up is never dropped silently, and a duplicate is harmless (workers claim
before they run). The worker side is :mod:`trace_aws.sqs_worker`.

boto3 is synchronous: every call runs in a worker thread
(:func:`anyio.to_thread.run_sync`), on one client per adapter.
"""

from __future__ import annotations

import json
import logging
import random
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread
from botocore.exceptions import BotoCoreError, ClientError

from trace_aws.errors import AwsRequestFailed, AwsUnavailable, aws_error, error_code
from trace_core.errors import ConfigurationError, InvalidInput, NotFound
from trace_core.retry import Backoff

if TYPE_CHECKING:
    from mypy_boto3_sqs import SQSClient
    from mypy_boto3_sqs.type_defs import SendMessageBatchRequestEntryTypeDef

__all__ = [
    "BATCH_LIMIT",
    "SqsWakeupQueue",
    "call_sqs",
    "parse_wakeup",
    "sqs_client",
    "wakeup_body",
]

log = logging.getLogger(__name__)

BATCH_LIMIT = 10
"""SQS's limit of entries per ``SendMessageBatch`` (and messages per receive)."""

MISSING_QUEUE_CODES = frozenset({"AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist"})

SEND_BACKOFF = Backoff(base_seconds=0.1, factor=2.0, cap_seconds=5.0, jitter=1.0)

T = TypeVar("T")


def sqs_client(region: str, endpoint_url: str | None = None) -> SQSClient:
    """An SQS client for ``region`` (explicit), at ``endpoint_url`` when given
    (a moto server, LocalStack). Clients are thread-safe: build one per adapter."""
    import boto3

    if not region:
        raise ConfigurationError("region: an AWS region is required (e.g. us-east-1)")
    return boto3.client("sqs", region_name=region, endpoint_url=endpoint_url or None)


async def call_sqs(
    operation: str, call: Callable[..., T], /, *, abandon_on_cancel: bool = False, **kwargs: Any
) -> T:
    """``call(**kwargs)`` in a worker thread, its failures translated (:mod:`trace_aws.errors`;
    a queue that does not exist is :class:`~trace_core.errors.NotFound`).

    With ``abandon_on_cancel`` a cancelled caller stops waiting at once (for a
    long-poll: the thread finishes it alone, and what it received reappears
    after the visibility timeout).
    """

    def run() -> T:
        try:
            return call(**kwargs)
        except ClientError as exc:
            code = error_code(exc)
            if code in MISSING_QUEUE_CODES:
                raise NotFound(f"sqs {operation}: the queue does not exist ({code})") from None
            raise aws_error(f"sqs {operation}", exc) from None
        except BotoCoreError as exc:
            raise aws_error(f"sqs {operation}", exc) from None

    return await anyio.to_thread.run_sync(run, abandon_on_cancel=abandon_on_cancel)


def wakeup_body(task_id: uuid.UUID) -> str:
    """The message body of a wake-up: ``{"task_id": "<uuid>"}``."""
    return json.dumps({"task_id": str(task_id)})


def json_object(body: str) -> dict[str, Any]:
    """A message body that must be one JSON object; :class:`InvalidInput`
    naming ``body`` otherwise."""
    try:
        message = json.loads(body)
    except ValueError:
        raise InvalidInput("body", "not JSON") from None
    if not isinstance(message, dict):
        raise InvalidInput("body", "not a JSON object")
    return message


def parse_wakeup(body: str) -> uuid.UUID:
    """The task id of a wake-up body; :class:`InvalidInput` naming what is wrong."""
    message = json_object(body)
    if set(message) != {"task_id"}:
        extra = sorted(set(message) - {"task_id"})
        reason = f"unexpected keys {extra}" if extra else "missing"
        raise InvalidInput("body.task_id" if not extra else "body", reason)
    value = message["task_id"]
    if not isinstance(value, str):
        raise InvalidInput("body.task_id", "not a string")
    try:
        return uuid.UUID(value)
    except ValueError:
        raise InvalidInput("body.task_id", "not a UUID") from None


class SqsWakeupQueue:
    """The :class:`~trace_core.ports.WakeupQueue` port on SQS.

    ``queue_urls`` maps the runtimes' queue names (``trace-ecs-platform``) to
    queue URLs; a name not in it is resolved once with ``GetQueueUrl``.
    ``max_attempts`` bounds the sends of one batch's failed entries; ``sleep``
    and ``rng`` pace the backoff between them (tests inject both).
    """

    def __init__(
        self,
        client: SQSClient,
        *,
        queue_urls: Mapping[str, str] | None = None,
        max_attempts: int = 5,
        backoff: Backoff = SEND_BACKOFF,
        sleep: Callable[[float], Awaitable[None]] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if max_attempts < 1:
            raise ConfigurationError("SqsWakeupQueue.max_attempts must be >= 1")
        self.client = client
        self._urls = dict(queue_urls or {})
        self.max_attempts = max_attempts
        self.backoff = backoff
        self._sleep = sleep or anyio.sleep
        self._rng = rng
        self.resends = 0
        """Entries sent again after SQS reported them failed (for tests and metrics)."""

    async def queue_url(self, queue: str) -> str:
        """The URL of ``queue`` (configured, or looked up once);
        :class:`~trace_core.errors.NotFound` if SQS has no such queue."""
        url = self._urls.get(queue)
        if url is None:
            answer = await call_sqs("GetQueueUrl", self.client.get_queue_url, QueueName=queue)
            url = self._urls[queue] = answer["QueueUrl"]
        return url

    async def send(self, queue: str, task_ids: Sequence[uuid.UUID]) -> None:
        """Enqueue one wake-up per task id on ``queue``, ten per request.

        Returns once SQS accepted every message. Raises
        :class:`~trace_aws.errors.AwsUnavailable` when entries still failed
        after ``max_attempts`` (or the call itself failed transiently), and
        :class:`~trace_aws.errors.AwsRequestFailed` at once for an entry SQS
        blames on the sender (retrying cannot fix it).
        """
        if not task_ids:
            return
        url = await self.queue_url(queue)
        for start in range(0, len(task_ids), BATCH_LIMIT):
            await self._send_batch(url, task_ids[start : start + BATCH_LIMIT])

    async def _send_batch(self, url: str, task_ids: Sequence[uuid.UUID]) -> None:
        pending: list[SendMessageBatchRequestEntryTypeDef] = [
            {"Id": str(i), "MessageBody": wakeup_body(task_id)}
            for i, task_id in enumerate(task_ids)
        ]
        attempt = 0
        while True:
            attempt += 1
            answer = await call_sqs(
                "SendMessageBatch", self.client.send_message_batch, QueueUrl=url, Entries=pending
            )
            failed = answer.get("Failed", [])
            if not failed:
                return
            fatal = [f for f in failed if f.get("SenderFault")]
            if fatal:
                raise AwsRequestFailed("sqs SendMessageBatch", str(fatal[0].get("Code")))
            codes = sorted({str(f.get("Code")) for f in failed})
            if attempt >= self.max_attempts:
                raise AwsUnavailable(
                    "sqs SendMessageBatch",
                    f"{len(failed)} wake-up(s) still failed after {attempt} attempts: {codes}",
                )
            ids = {f["Id"] for f in failed}
            pending = [entry for entry in pending if entry["Id"] in ids]
            delay = self.backoff.delay(attempt, self._rng).total_seconds()
            log.info(
                "sqs: %d wake-up(s) failed (%s); sending again in %.2fs", len(ids), codes, delay
            )
            self.resends += len(pending)
            await self._sleep(delay)
