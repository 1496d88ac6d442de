"""The in-process runner: tasks of ``runtime: dispatcher`` jobs.

The Dispatcher runs these operators itself (platform-only, trusted code), and
it does so through the same worker wrapper every other worker uses
(:class:`~trace_core.worker.WorkerWrapper` on an
:class:`~trace_core.worker.InProcessClient`): claim, run the operator with a
task context, heartbeat at a fraction of the lease while it runs, then
complete with its final events, or fail the attempt (retry with backoff) if
it raised. A stale lease (reclaimed, canceled, superseded) aborts the work:
the result is dropped and nothing is written. Synchronous operators run in a
worker thread, so a Spark job does not block the event loop.

Operators are written against :mod:`trace_core.authoring` (``TaskContext``,
``OperatorResult``), which neither this module nor the Dispatcher owns.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import anyio
import anyio.abc

from trace_core.authoring.operators import OperatorRegistry
from trace_core.dispatcher.control import TaskControl
from trace_core.dispatcher.inprocess_client import InProcessClient
from trace_core.errors import ConfigurationError
from trace_core.retry import Backoff
from trace_core.worker.client import ControlPlaneUnavailable
from trace_core.worker.retrying import RetryingClient
from trace_core.worker.wrapper import CredentialSource, WorkerWrapper

__all__ = ["UNAVAILABLE", "InProcessRunner", "RunnerConfig"]

UNAVAILABLE = "unavailable"
"""The outcome counted each time a hand-off met an outage and is tried again."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerConfig:
    """In-process runner settings."""

    concurrency: int = 4
    heartbeat_fraction: float = 1 / 3
    """Heartbeat every ``lease * heartbeat_fraction`` (a third by default)."""
    heartbeat_seconds: float | None = None
    """A fixed heartbeat period instead of one derived from the lease; keep it
    well under the lease."""
    retry_seconds: float = 30.0
    """How long a call to a briefly unavailable database is retried (SQLite
    locked past its busy timeout, a Postgres failover)."""
    again_seconds: float = 1.0
    """How long a task whose claim met a longer outage waits before it is
    handed over again (its wake-up is already acknowledged: the runner is the
    only one that will start it)."""

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ConfigurationError("RunnerConfig.concurrency must be >= 1")
        if self.heartbeat_seconds is not None and self.heartbeat_seconds <= 0:
            raise ConfigurationError("RunnerConfig.heartbeat_seconds must be > 0")
        if not 0 < self.heartbeat_fraction < 1:
            raise ConfigurationError("RunnerConfig.heartbeat_fraction must be within (0, 1)")
        if self.retry_seconds < 0:
            raise ConfigurationError("RunnerConfig.retry_seconds must be >= 0")
        if self.again_seconds <= 0:
            raise ConfigurationError("RunnerConfig.again_seconds must be > 0")


class InProcessRunner:
    """Claims and runs ``runtime: dispatcher`` tasks in this process.

    ``credentials`` gives each attempt its scoped object-store credentials
    (the lite profile mints them from the attempt's capability token).
    """

    def __init__(
        self,
        control: TaskControl,
        operators: OperatorRegistry,
        *,
        worker_id: str,
        config: RunnerConfig | None = None,
        credentials: CredentialSource | None = None,
    ) -> None:
        self.control = control
        self.operators = operators
        self.worker_id = worker_id
        self.config = config or RunnerConfig()
        client = RetryingClient(
            InProcessClient(control),
            backoff=Backoff(base_seconds=0.1, cap_seconds=5.0),
            max_elapsed_seconds=self.config.retry_seconds,
        )
        self.wrapper = WorkerWrapper(
            client,
            operators,
            worker_id=worker_id,
            heartbeat_fraction=self.config.heartbeat_fraction,
            heartbeat_seconds=self.config.heartbeat_seconds,
            # The lease is granted on the control plane's clock: read its TTL there.
            clock=control.clock,
            credentials=credentials,
        )
        self._limiter = anyio.CapacityLimiter(self.config.concurrency)
        self._group: anyio.abc.TaskGroup | None = None
        self._in_flight = 0
        self._idle: anyio.Event | None = None
        self.outcomes: dict[str, int] = {}

    async def start(self, task_group: anyio.abc.TaskGroup) -> None:
        """Run submitted tasks in ``task_group`` from now on."""
        self._group = task_group

    async def submit(self, task_ids: Sequence[uuid.UUID]) -> None:
        """Start ``task_ids`` (the launcher's in-process hand-off); runs them now
        when the runner is not started (tests, one-shot use)."""
        for task_id in task_ids:
            if self._group is not None:
                # Counted before it starts, so drain() cannot miss a task
                # handed over but not yet begun.
                self._in_flight += 1
                self._group.start_soon(self._run_counted, task_id)
            else:
                await self.run_task(task_id)

    @property
    def in_flight(self) -> int:
        """Tasks handed to the running runner and not finished yet."""
        return self._in_flight

    async def drain(self) -> None:
        """Wait until every submitted task has finished (stop the relay first,
        or new ones keep coming)."""
        while self._in_flight:
            self._idle = anyio.Event()
            await self._idle.wait()

    async def _run_counted(self, task_id: uuid.UUID) -> None:
        try:
            while True:
                try:
                    await self.run_task(task_id)
                    break
                except ControlPlaneUnavailable as exc:
                    # Past the client's own retries. Its wake-up is acknowledged,
                    # so a claim that could not be made must be tried again here
                    # or the task stays Queued; a report that could not be made
                    # is answered AlreadyRunning (its lease expires, the reaper
                    # retries it).
                    self._count(UNAVAILABLE)
                    log.warning(
                        "in-process task %s: control plane unavailable (%s); "
                        "handing it over again in %.1f s",
                        task_id,
                        exc,
                        self.config.again_seconds,
                    )
                    await anyio.sleep(self.config.again_seconds)
        except Exception as exc:
            # Runs in the Dispatcher's task group: an error escaping here would
            # cancel every other service. A claimed task's lease expires and the
            # reaper retries it, as after a crash of this process; one whose
            # claim could not be made stays Queued until a Dispatcher starts
            # (Dispatcher.start hands every Queued in-process task over again).
            self._count("errored")
            log.warning(
                "in-process task %s ended with %s: %s; left to its lease or the next start",
                task_id,
                type(exc).__name__,
                exc,
            )
        finally:
            self._in_flight -= 1
            if not self._in_flight and self._idle is not None:
                self._idle.set()

    async def run_task(self, task_id: uuid.UUID) -> str:
        """Claim and run one task; the outcome (``completed``, ``failed``,
        ``stale``, ``canceled``, ``abandoned``, or the claim refusal reason)."""
        async with self._limiter:
            outcome = await self.wrapper.handle_wakeup(task_id)
        self._count(outcome)
        return outcome

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
