"""Moving a message SQS cannot use to its queue's dead-letter queue.

Shared by the SQS worker loop (a body that is not a wake-up) and the dataset
buffer's sink (a batch it refuses). The dead-letter queue is the
``deadLetterTargetArn`` of the source queue's redrive policy, or a URL given
explicitly. The message body is sent there unchanged, with the reason and the
source queue as message attributes, and only then deleted from the source
queue; if the send fails, the message is left alone and the redrive policy
moves it after ``maxReceiveCount`` receives.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from trace_aws.sqs import call_sqs
from trace_core.errors import ConfigurationError, TraceError

if TYPE_CHECKING:
    from mypy_boto3_sqs import SQSClient
    from mypy_boto3_sqs.type_defs import MessageTypeDef

__all__ = ["DeadLetterQueue"]

log = logging.getLogger(__name__)


class DeadLetterQueue:
    """The dead-letter queue of ``queue_url`` (``dead_letter_url`` when given)."""

    def __init__(
        self, client: SQSClient, queue_url: str, dead_letter_url: str | None = None
    ) -> None:
        self.client = client
        self.queue_url = queue_url
        self._url = dead_letter_url

    async def url(self) -> str:
        """The dead-letter queue's URL: configured, or from the queue's redrive policy.

        A queue without one is a :class:`ConfigurationError` naming the queue:
        a poison message must have somewhere to go.
        """
        if self._url is None:
            url = self.queue_url
            answer = await call_sqs(
                "GetQueueAttributes",
                self.client.get_queue_attributes,
                QueueUrl=url,
                AttributeNames=["RedrivePolicy"],
            )
            policy = answer.get("Attributes", {}).get("RedrivePolicy")
            if not policy:
                raise ConfigurationError(
                    f"queue {url}: no RedrivePolicy (set a dead-letter queue, or dead_letter_url)"
                )
            try:
                arn = str(json.loads(policy)["deadLetterTargetArn"])
                # arn:aws:sqs:<region>:<account>:<name>
                account, name = arn.split(":")[4:6]
            except (ValueError, KeyError, TypeError):
                raise ConfigurationError(
                    f"queue {url}: RedrivePolicy has no valid deadLetterTargetArn"
                ) from None
            found = await call_sqs(
                "GetQueueUrl",
                self.client.get_queue_url,
                QueueName=name,
                QueueOwnerAWSAccountId=account,
            )
            self._url = found["QueueUrl"]
        return self._url

    async def move(self, message: MessageTypeDef, reason: str) -> bool:
        """Send ``message`` to the dead-letter queue with ``reason``, then delete it
        from the source queue; whether it was moved (a failure is logged, not raised)."""
        message_id = message.get("MessageId", "?")
        try:
            await call_sqs(
                "SendMessage",
                self.client.send_message,
                QueueUrl=await self.url(),
                MessageBody=message.get("Body") or "(empty)",
                MessageAttributes={
                    "trace-error": {"DataType": "String", "StringValue": reason},
                    "trace-source-queue": {"DataType": "String", "StringValue": self.queue_url},
                },
            )
        except TraceError as exc:
            log.error("message %s is refused (%s); not dead-lettered: %s", message_id, reason, exc)
            return False
        log.warning(
            "message %s is refused (%s): moved to the dead-letter queue", message_id, reason
        )
        try:
            await call_sqs(
                "DeleteMessage",
                self.client.delete_message,
                QueueUrl=self.queue_url,
                ReceiptHandle=message["ReceiptHandle"],
            )
        except TraceError as exc:
            # It comes back and is dead-lettered again: a duplicate in the DLQ.
            log.warning("message %s: not deleted (it will be redelivered): %s", message_id, exc)
        return True
