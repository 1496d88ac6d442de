"""The in-process runner: tasks of ``runtime: dispatcher`` jobs.

The Dispatcher runs these operators itself (platform-only, trusted code):
claim, run the operator with a task context, heartbeat at a fraction of the
lease while it runs, then complete with its final events — or fail the
attempt (retry with backoff) if it raised. A stale lease (reclaimed,
canceled, superseded) aborts the work: the result is dropped and nothing is
written. Synchronous operators run in a worker thread, so a Spark job does not
block the event loop.
"""

from __future__ import annotations

import inspect
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread

from trace_core.dispatcher.control import TaskControl
from trace_core.dispatcher.events import AcceptResult, DatasetEvent
from trace_core.dispatcher.operators import OperatorRegistry
from trace_core.errors import ConfigurationError, StaleClaim
from trace_core.model import Fence

__all__ = ["InProcessRunner", "OperatorResult", "RunnerConfig", "TaskContext"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OperatorResult:
    """What an operator returns: final events and per-output metadata."""

    events: Sequence[DatasetEvent] = ()
    outputs: Sequence[Mapping[str, Any]] | None = None


@dataclass
class TaskContext:
    """What an operator gets: the task payload and the fenced calls it may make."""

    payload: dict[str, Any]
    fence: Fence
    control: TaskControl
    emitted: list[AcceptResult] = field(default_factory=list)

    @property
    def task_id(self) -> uuid.UUID:
        """The task (the producer run id of its events)."""
        return uuid.UUID(self.payload["task_id"])

    @property
    def attempt(self) -> int:
        """The attempt being run."""
        return int(self.payload["attempt"])

    @property
    def config(self) -> dict[str, Any]:
        """The job's operator config."""
        return dict(self.payload["config"])

    @property
    def inputs(self) -> list[dict[str, Any]]:
        """Pinned input versions with their ``where`` filters and unit of work."""
        return list(self.payload["inputs"])

    @property
    def outputs(self) -> list[dict[str, Any]]:
        """Output datasets with their version and location, by output index."""
        return list(self.payload["outputs"])

    async def directive(self) -> str:
        """For sources: ``run``, ``pause`` (emit nothing until resumed) or ``stop``
        (finish cleanly and return)."""
        return await self.control.directive(self.task_id)

    async def emit(self, events: Sequence[DatasetEvent]) -> AcceptResult:
        """Emit events mid-task (accepted only while this attempt is current)."""
        result = await self.control.emit(self.task_id, self.attempt, events)
        self.emitted.append(result)
        return result


@dataclass(frozen=True)
class RunnerConfig:
    """In-process runner settings."""

    concurrency: int = 4
    heartbeat_seconds: float = 10.0
    """Heartbeat period; keep it well under the lease (a third by default)."""

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ConfigurationError("RunnerConfig.concurrency must be >= 1")
        if self.heartbeat_seconds <= 0:
            raise ConfigurationError("RunnerConfig.heartbeat_seconds must be > 0")


class InProcessRunner:
    """Claims and runs ``runtime: dispatcher`` tasks in this process."""

    def __init__(
        self,
        control: TaskControl,
        operators: OperatorRegistry,
        *,
        worker_id: str,
        config: RunnerConfig | None = None,
    ) -> None:
        self.control = control
        self.operators = operators
        self.worker_id = worker_id
        self.config = config or RunnerConfig()
        self._limiter = anyio.CapacityLimiter(self.config.concurrency)
        self._group: anyio.abc.TaskGroup | None = None
        self.outcomes: dict[str, int] = {}

    async def start(self, task_group: anyio.abc.TaskGroup) -> None:
        """Run submitted tasks in ``task_group`` from now on."""
        self._group = task_group

    async def submit(self, task_ids: Sequence[uuid.UUID]) -> None:
        """Start ``task_ids`` (the launcher's in-process hand-off); runs them now
        when the runner is not started (tests, one-shot use)."""
        for task_id in task_ids:
            if self._group is not None:
                self._group.start_soon(self.run_task, task_id)
            else:
                await self.run_task(task_id)

    async def run_task(self, task_id: uuid.UUID) -> str:
        """Claim and run one task; the outcome (``completed``, ``failed``,
        ``stale``, or the claim refusal reason)."""
        async with self._limiter:
            claimed = await self.control.claim(task_id, self.worker_id)
            if claimed.outcome.lease is None or claimed.task is None:
                outcome = str(claimed.outcome.reason)
            else:
                fence = claimed.outcome.lease.fence
                ctx = TaskContext(claimed.task, fence, self.control)
                outcome = await self._run(ctx)
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        return outcome

    async def _run(self, ctx: TaskContext) -> str:
        spec = self.operators.get(ctx.payload["operator"])
        stale = False
        result: Any = None
        error: BaseException | None = None

        async def heartbeat(scope: anyio.CancelScope) -> None:
            nonlocal stale
            while True:
                await anyio.sleep(self.config.heartbeat_seconds)
                try:
                    await self.control.heartbeat(ctx.fence)
                except StaleClaim:
                    stale = True
                    scope.cancel()
                    return

        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as work:
                tg.start_soon(heartbeat, work)
                try:
                    if inspect.iscoroutinefunction(spec.run):
                        result = await spec.run(ctx)
                    else:
                        result = await anyio.to_thread.run_sync(spec.run, ctx)
                except StaleClaim:
                    stale = True
                except Exception as exc:
                    error = exc
            tg.cancel_scope.cancel()
        if stale:
            return "stale"
        try:
            if error is not None:
                log.warning("task %s attempt %d failed: %r", ctx.task_id, ctx.attempt, error)
                await self.control.fail(ctx.fence, f"{type(error).__name__}: {error}")
                return "failed"
            final = result if isinstance(result, OperatorResult) else OperatorResult()
            await self.control.complete(ctx.fence, events=final.events, outputs=final.outputs)
            return "completed"
        except StaleClaim:
            return "stale"
