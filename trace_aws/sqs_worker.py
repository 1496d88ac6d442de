"""The SQS worker loop: long-poll wake-ups, run each through the worker wrapper, delete.

:class:`SqsWorker` receives wake-ups (``WaitTimeSeconds`` up to 20, never
more messages than it has free slots, at most ten) and hands each task id to
:meth:`~trace_core.worker.WorkerWrapper.handle_wakeup`, which claims the
task and runs it under its lease. The message is deleted once the wrapper has
finished with it, whatever the outcome: completed, failed, canceled, stale, or
not claimed (``AlreadyRunning``, ``Completed``... the contract: do not run,
delete). Only when the claim itself could not be made (the control plane is
unreachable or refused the worker) is the wake-up kept: it is sent again as a
new message, delayed by ``requeue_delay_seconds``, and the received one is
deleted. A new message starts a new receive count, so wake-ups kept through a
long outage do not reach the dead-letter queue (whose redrive policy counts
receives); if the send fails, the received message is left to reappear after
its visibility timeout.

While a task runs, its message's visibility is extended every
``extend_seconds`` (``ChangeMessageVisibility`` to ``visibility_seconds``),
so SQS does not hand a live task to another worker. A worker that dies stops
extending: the message reappears and the next claim is decided by the lease
(``AlreadyRunning`` while the dead worker's lease lasts, a new attempt after
the reaper retried it).

A body that is not a wake-up is sent to the queue's dead-letter queue (the
``deadLetterTargetArn`` of its redrive policy, or ``dead_letter_url``), with
the reason as a message attribute, then deleted from the queue; the loop
carries on. If the dead-letter send fails, the message is left alone and the
redrive policy moves it after ``maxReceiveCount`` receives.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

from trace_aws.errors import AwsUnavailable
from trace_aws.sqs import BATCH_LIMIT, call_sqs, parse_wakeup, wakeup_body
from trace_aws.sqs_dead_letter import DeadLetterQueue
from trace_core.errors import ConfigurationError, InvalidInput, TraceError
from trace_core.outage import LoopHealth
from trace_core.worker import ControlPlaneRejected, ControlPlaneUnavailable, WorkerWrapper

if TYPE_CHECKING:
    from mypy_boto3_sqs import SQSClient
    from mypy_boto3_sqs.type_defs import MessageTypeDef

__all__ = ["KEPT", "MALFORMED", "SqsWorker", "SqsWorkerSettings"]

log = logging.getLogger(__name__)

MALFORMED = "malformed"
"""The outcome of a body that is not a wake-up (sent to the dead-letter queue)."""
KEPT = "kept"
"""The outcome of a wake-up whose claim could not be made (requeued, delayed)."""

MAX_WAIT_SECONDS = 20
"""SQS's longest long-poll."""
MAX_DELAY_SECONDS = 900
"""SQS's longest message delay."""


@dataclass(frozen=True)
class SqsWorkerSettings:
    """What one :class:`SqsWorker` polls and how.

    ``visibility_seconds`` is what each extension sets the running task's
    message visibility to; ``extend_seconds`` (default a third of it) is how
    often. ``requeue_delay_seconds`` delays a kept wake-up (module
    docstring). ``concurrency`` is how many tasks run at once (and so the
    most messages held invisible at a time).
    """

    queue_url: str
    wait_seconds: int = MAX_WAIT_SECONDS
    concurrency: int = 1
    visibility_seconds: int = 60
    extend_seconds: float | None = None
    dead_letter_url: str | None = None
    requeue_delay_seconds: int = 30

    def __post_init__(self) -> None:
        if not self.queue_url:
            raise ConfigurationError("queue_url: the worker's SQS queue URL is required")
        if not 0 <= self.wait_seconds <= MAX_WAIT_SECONDS:
            raise ConfigurationError(f"wait_seconds must be within 0..{MAX_WAIT_SECONDS}")
        if self.concurrency < 1:
            raise ConfigurationError("concurrency must be >= 1")
        if not 1 <= self.visibility_seconds <= 43_200:
            raise ConfigurationError("visibility_seconds must be within 1..43200 (SQS's limit)")
        if (
            self.extend_seconds is not None
            and not 0 < self.extend_seconds < self.visibility_seconds
        ):
            raise ConfigurationError("extend_seconds must be > 0 and below visibility_seconds")
        if not 0 <= self.requeue_delay_seconds <= MAX_DELAY_SECONDS:
            raise ConfigurationError(
                f"requeue_delay_seconds must be within 0..{MAX_DELAY_SECONDS} (SQS's limit)"
            )

    @property
    def extend_every(self) -> float:
        """Seconds between visibility extensions of a running task's message."""
        return self.extend_seconds or self.visibility_seconds / 3


class SqsWorker:
    """Runs the wake-ups of one SQS queue through a :class:`WorkerWrapper`.

    ``sleep`` paces the visibility extensions and ``health`` the backoff after
    a failed round (tests inject both). :attr:`outcomes` counts what happened
    to each message, by outcome.
    """

    def __init__(
        self,
        client: SQSClient,
        wrapper: WorkerWrapper,
        settings: SqsWorkerSettings,
        *,
        sleep: Callable[[float], Awaitable[None]] | None = None,
        health: LoopHealth | None = None,
    ) -> None:
        self.client = client
        self.wrapper = wrapper
        self.settings = settings
        self._sleep = sleep or anyio.sleep
        self.health = health or LoopHealth(
            f"sqs worker {wrapper.worker_id}",
            logger=log,
            unavailable=(AwsUnavailable, ControlPlaneUnavailable),
        )
        self.outcomes: dict[str, int] = {}
        self._dead_letters = DeadLetterQueue(client, settings.queue_url, settings.dead_letter_url)
        self._running = 0
        self._slot_freed = anyio.Event()
        self._stopping = False
        self._idle = anyio.CancelScope()

    async def dead_letter_url(self) -> str:
        """The dead-letter queue's URL: configured, or from the queue's redrive policy
        (a :class:`ConfigurationError` naming the queue if it has none)."""
        return await self._dead_letters.url()

    async def receive(self, max_messages: int) -> list[MessageTypeDef]:
        """One long-poll for up to ``max_messages`` (at most ten) wake-ups."""
        answer = await call_sqs(
            "ReceiveMessage",
            self.client.receive_message,
            abandon_on_cancel=True,
            QueueUrl=self.settings.queue_url,
            MaxNumberOfMessages=max(1, min(max_messages, BATCH_LIMIT)),
            WaitTimeSeconds=self.settings.wait_seconds,
            VisibilityTimeout=self.settings.visibility_seconds,
        )
        return list(answer.get("Messages", []))

    async def poll_once(self) -> int:
        """Receive up to ``concurrency`` wake-ups and handle them side by side;
        how many messages were received. Errors of the receive are raised."""
        messages = await self.receive(self.settings.concurrency)
        async with anyio.create_task_group() as group:
            for message in messages:
                group.start_soon(self.handle, message)
        return len(messages)

    async def run(self, *, max_messages: int | None = None) -> None:
        """Poll and handle until :meth:`stop` (or ``max_messages`` were received).

        Running tasks are finished and their messages deleted before it
        returns. A failed receive (SQS or the network is down) backs off and
        polls again; a queue that does not exist ends the loop with
        :class:`~trace_core.errors.NotFound`.
        """
        await self.dead_letter_url()
        received = 0
        fatal: TraceError | None = None
        self.health.running = True
        try:
            async with anyio.create_task_group() as group:
                while not self._stopping and (max_messages is None or received < max_messages):
                    free = self.settings.concurrency - self._running
                    if max_messages is not None:
                        free = min(free, max_messages - received)
                    if free <= 0:
                        await self._slot_freed.wait()
                        self._slot_freed = anyio.Event()
                        continue
                    messages: list[MessageTypeDef] = []
                    with anyio.CancelScope() as self._idle:
                        try:
                            messages = await self.receive(free)
                            self.health.succeeded()
                        except AwsUnavailable as exc:
                            await self.health.backoff_after(exc)
                        except TraceError as exc:
                            # Not transient (the queue is gone, access denied):
                            # finish the running tasks, then raise it as is.
                            fatal = exc
                            break
                    for message in messages:
                        received += 1
                        self._running += 1
                        group.start_soon(self._handle_in_slot, message)
        finally:
            self.health.running = False
        if fatal is not None:
            raise fatal

    def stop(self) -> None:
        """Stop polling (an idle long-poll is abandoned at once); running tasks finish.

        A poll abandoned in flight may have received messages: they reappear
        after their visibility timeout, for any worker.
        """
        self._stopping = True
        self._idle.cancel()
        self._slot_freed.set()

    async def _handle_in_slot(self, message: MessageTypeDef) -> None:
        try:
            await self.handle(message)
        finally:
            self._running -= 1
            self._slot_freed.set()

    async def handle(self, message: MessageTypeDef) -> str:
        """Handle one received message; its outcome (also counted in :attr:`outcomes`).

        Never raises for a task's or a message's failure: those are logged
        and the loop carries on.
        """
        outcome = await self._handle(message)
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        return outcome

    async def _handle(self, message: MessageTypeDef) -> str:
        receipt = message["ReceiptHandle"]
        try:
            task_id = parse_wakeup(message.get("Body", ""))
        except InvalidInput as exc:
            await self._dead_letter(message, str(exc))
            return MALFORMED
        outcome = KEPT
        async with anyio.create_task_group() as group:
            group.start_soon(self._keep_invisible, receipt, str(task_id))
            try:
                outcome = await self.wrapper.handle_wakeup(task_id)
            except (ControlPlaneUnavailable, ControlPlaneRejected) as exc:
                # The claim was not made: keep the message, it comes back after
                # its visibility timeout and is claimed then.
                log.warning("task %s: claim not made, wake-up kept: %s", task_id, exc)
            except Exception:
                # A bug must not end the loop: the wake-up comes back, and the
                # lease decides what the next claim may do.
                log.exception("task %s: the wrapper raised; wake-up kept", task_id)
            finally:
                group.cancel_scope.cancel()
        if outcome != KEPT:
            await self._delete(receipt, f"task {task_id}")
        else:
            await self._requeue(message, task_id)
        log.info("task %s: %s", task_id, outcome)
        return outcome

    async def _keep_invisible(self, receipt: str, what: str) -> None:
        """Extend the message's visibility until cancelled (the task finished)."""
        while True:
            await self._sleep(self.settings.extend_every)
            try:
                await call_sqs(
                    "ChangeMessageVisibility",
                    self.client.change_message_visibility,
                    QueueUrl=self.settings.queue_url,
                    ReceiptHandle=receipt,
                    VisibilityTimeout=self.settings.visibility_seconds,
                )
            except AwsUnavailable as exc:
                log.warning("%s: visibility not extended, trying again: %s", what, exc)
            except TraceError as exc:
                # The receipt is no longer valid (or the 12-hour limit is
                # reached): the message may be redelivered; the lease still
                # fences a second worker.
                log.warning("%s: visibility can no longer be extended: %s", what, exc)
                return

    async def _requeue(self, message: MessageTypeDef, task_id: uuid.UUID) -> None:
        """Send the wake-up again as a new (delayed) message, then delete the received one."""
        try:
            await call_sqs(
                "SendMessage",
                self.client.send_message,
                QueueUrl=self.settings.queue_url,
                MessageBody=wakeup_body(task_id),
                DelaySeconds=self.settings.requeue_delay_seconds,
            )
        except TraceError as exc:
            log.warning("task %s: wake-up not requeued, it reappears later: %s", task_id, exc)
            return
        await self._delete(message["ReceiptHandle"], f"task {task_id}")

    async def _delete(self, receipt: str, what: str) -> None:
        try:
            await call_sqs(
                "DeleteMessage",
                self.client.delete_message,
                QueueUrl=self.settings.queue_url,
                ReceiptHandle=receipt,
            )
        except TraceError as exc:
            # Not fatal: the wake-up comes back and its claim is refused.
            log.warning("%s: wake-up not deleted (it will be redelivered): %s", what, exc)

    async def _dead_letter(self, message: MessageTypeDef, reason: str) -> None:
        await self._dead_letters.move(message, reason)
