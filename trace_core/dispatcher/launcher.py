"""Starting tasks: the ``enqueue_task`` outbox handler.

Reads the tasks of a wake-up row, skips those that can no longer run
(finished, canceled, already running), groups the rest by their job's runtime
and starts them: a wake-up on the runtime's queue (``ecs_*``), an
asynchronous Lambda invocation with the full task payload (``lambda``), or the
Dispatcher's in-process runner (``dispatcher``). Delivery is at-least-once:
workers claim before they run, so a repeated start is harmless.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from trace_core.dispatcher.payload import task_payloads
from trace_core.dispatcher.runtimes import RuntimeKind, RuntimeRegistry
from trace_core.ports import LambdaInvoker, WakeupQueue
from trace_core.storage.protocol import Repository

__all__ = ["InProcessStart", "TaskLauncher"]

InProcessStart = Callable[[Sequence[uuid.UUID]], Awaitable[None]]
"""Hands tasks of ``runtime: dispatcher`` jobs to the in-process runner."""


class TaskLauncher:
    """Starts tasks through their job's runtime (the ``enqueue_task`` handler)."""

    def __init__(
        self,
        repo: Repository,
        runtimes: RuntimeRegistry,
        *,
        wakeups: WakeupQueue,
        lambdas: LambdaInvoker,
        in_process: InProcessStart,
    ) -> None:
        self.repo = repo
        self.runtimes = runtimes
        self.wakeups = wakeups
        self.lambdas = lambdas
        self.in_process = in_process

    async def handle(self, payload: Mapping[str, Any]) -> None:
        """Outbox handler for ``{"task_ids": [...]}``; raises to be retried."""
        await self.start([uuid.UUID(str(t)) for t in payload["task_ids"]])

    async def start(self, task_ids: Sequence[uuid.UUID]) -> None:
        """Start the startable tasks among ``task_ids``."""
        async with self.repo.read() as tx:
            rows = await tx.launch.startable_tasks(task_ids)
            lambda_ids = [
                r.task_id for r in rows if self.runtimes.get(r.runtime).kind is RuntimeKind.LAMBDA
            ]
            payloads = await task_payloads(tx, lambda_ids) if lambda_ids else {}
        queues: dict[str, list[uuid.UUID]] = {}
        local: list[uuid.UUID] = []
        for row in rows:
            runtime = self.runtimes.get(row.runtime)
            if runtime.kind is RuntimeKind.QUEUE:
                queues.setdefault(runtime.target_for(row.operator), []).append(row.task_id)
            elif runtime.kind is RuntimeKind.LAMBDA:
                await self.lambdas.invoke(runtime.target_for(row.operator), payloads[row.task_id])
            else:
                local.append(row.task_id)
        for queue, ids in queues.items():
            await self.wakeups.send(queue, ids)
        if local:
            await self.in_process(local)

    async def start_queued_in_process(self, *, batch: int = 1000) -> int:
        """Hand every ``Queued`` task of an in-process runtime to the runner;
        how many were handed over (read in pages of ``batch``).

        The relay acknowledges an ``enqueue_task`` row once the runner holds
        the task in memory, before its claim (the runner may be at its
        concurrency). A process that dies in between takes those wake-ups with
        it, and nothing else would start such a task again: a job with a
        concurrency limit gets it back when a sibling finishes, one without
        never. So a starting Dispatcher calls this once. A task whose wake-up
        is still pending is handed over twice; claims are by id and atomic, so
        the second is refused and runs nothing.
        """
        runtimes = self.runtimes
        routes = [
            (name, None)
            for name in sorted(runtimes.names())
            if runtimes.get(name).kind is RuntimeKind.IN_PROCESS
        ]
        handed, after = 0, None
        while True:
            async with self.repo.read() as tx:
                ids = await tx.tasks.queued_in_id_order(routes, after=after, limit=batch)
            if ids:
                await self.in_process(ids)
                handed, after = handed + len(ids), ids[-1]
            if len(ids) < batch:
                return handed
