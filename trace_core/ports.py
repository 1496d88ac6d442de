"""Ports: what the core needs from the outside world, as small protocols.

Each has an in-process implementation (``trace_core.dispatcher.inprocess``)
that tests and the lite profile use; ``trace_aws`` adapts them to SQS and
Lambda.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = ["LambdaInvoker", "WakeupQueue"]


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
