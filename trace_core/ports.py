"""Ports: what the core needs from the outside world, as small protocols.

Each has an in-process implementation (``trace_core.dispatcher.inprocess``)
that tests and the lite profile use; ``trace_aws`` adapts them to SQS and
Lambda.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "LambdaInvoker",
    "StreamMessage",
    "StreamTransport",
    "StreamTransportUnavailable",
    "WakeupQueue",
]


class WakeupQueue(Protocol):
    """Carries ``{"task_id": ...}`` wake-ups to workers (SQS in production).

    At-least-once: a wake-up may be delivered twice, or after the task was
    claimed through another wake-up; workers claim before running, so that is
    harmless. ``send`` returns once the queue has accepted every message.
    """

    async def send(self, queue: str, task_ids: Sequence[uuid.UUID]) -> None:
        """Enqueue one wake-up per task id on ``queue``."""
        ...


class LambdaInvoker(Protocol):
    """Invokes a function asynchronously with a full task payload.

    The function's own retries must be off: the Dispatcher owns attempts,
    leases and retries uniformly across runtimes. ``invoke`` returns once the
    invocation was accepted (not when the function finished).
    """

    async def invoke(self, function: str, payload: Mapping[str, Any]) -> None:
        """Start ``function`` with ``payload`` (the task-fetch shape)."""
        ...


class StreamTransportUnavailable(Exception):
    """The stream transport cannot be reached; claims fall back to the database."""


@dataclass(frozen=True)
class StreamMessage:
    """One delivered stream message: ``{job_id, enqueue_id}`` and where it is.

    ``job_id`` is ``None`` for a message whose body is unreadable (or was
    trimmed away while pending): it can only be acknowledged.
    """

    stream: str
    message_id: str
    job_id: uuid.UUID | None
    enqueue_id: str | None = None


@runtime_checkable
class StreamTransport(Protocol):
    """A :class:`WakeupQueue` whose messages are delivered to named consumers
    and stay pending until acknowledged (Redis Streams with consumer groups).

    Every method raises :class:`StreamTransportUnavailable` when the
    transport cannot be reached. Delivery is at-least-once; the database
    decides whether a message's job can run.
    """

    async def send(self, queue: str, task_ids: Sequence[uuid.UUID]) -> None:
        """Add one ``{job_id, enqueue_id}`` message per task to stream ``queue``."""
        ...

    async def read(
        self, consumer: str, streams: Sequence[str], *, wait: float
    ) -> list[StreamMessage]:
        """New messages for ``consumer`` (at most one per stream, in the
        order of ``streams``), waiting up to ``wait`` seconds for one."""
        ...

    async def pending(self, consumer: str, streams: Sequence[str]) -> list[StreamMessage]:
        """The messages delivered to ``consumer`` and not yet acknowledged."""
        ...

    async def take_over(self, consumer: str, streams: Sequence[str]) -> list[StreamMessage]:
        """Move to ``consumer`` the messages other consumers left pending too
        long (consumers that died), and return them."""
        ...

    async def ack(self, messages: Sequence[StreamMessage]) -> None:
        """Acknowledge ``messages``: they leave their pending lists for good."""
        ...

    async def dead_letter(self, message: StreamMessage, reason: str) -> None:
        """Record ``message`` on the dead-letter stream and acknowledge it (atomically)."""
        ...
