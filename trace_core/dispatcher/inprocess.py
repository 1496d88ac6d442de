"""In-process implementations of the ports, for tests and the lite profile."""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio

from trace_core.errors import ConfigurationError

__all__ = ["InProcessLambdaInvoker", "InProcessWakeupQueue"]


class InProcessWakeupQueue:
    """Named FIFO queues of task-id wake-ups in memory (the SQS stand-in)."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[uuid.UUID]] = {}
        self._arrived = anyio.Event()

    async def send(self, queue: str, task_ids: Sequence[uuid.UUID]) -> None:
        """Append one wake-up per task to ``queue``."""
        self._queues.setdefault(queue, deque()).extend(task_ids)
        self._arrived.set()
        self._arrived = anyio.Event()

    def pending(self, queue: str) -> list[uuid.UUID]:
        """The wake-ups waiting on ``queue``, oldest first (not removed)."""
        return list(self._queues.get(queue, ()))

    async def receive(
        self, queue: str, *, max_messages: int = 10, wait: float = 0.0
    ) -> list[uuid.UUID]:
        """Take up to ``max_messages`` wake-ups, waiting up to ``wait`` seconds for one."""
        with anyio.move_on_after(wait):
            while not self._queues.get(queue):
                await self._arrived.wait()
        waiting = self._queues.get(queue, deque())
        return [waiting.popleft() for _ in range(min(max_messages, len(waiting)))]


LambdaFunction = Callable[[Mapping[str, Any]], Awaitable[None]]


class InProcessLambdaInvoker:
    """Functions by name, invoked in the caller's task (no retries, like
    a Lambda with retries off); records every invocation."""

    def __init__(self, functions: Mapping[str, LambdaFunction] | None = None) -> None:
        self.functions = dict(functions or {})
        self.invocations: list[tuple[str, dict[str, Any]]] = []

    async def invoke(self, function: str, payload: Mapping[str, Any]) -> None:
        """Run ``function`` with ``payload``; unknown functions are an error."""
        self.invocations.append((function, dict(payload)))
        handler = self.functions.get(function)
        if handler is None:
            if self.functions:
                raise ConfigurationError(f"no in-process function named {function!r}")
            return  # recording only
        await handler(payload)
