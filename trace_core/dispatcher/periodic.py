"""The loop shared by the Dispatcher's sweepers: ``run_once()`` on an interval.

The reaper, the retry scheduler, the source supervisor, cron, the idle
scaler, the version promoter and the backpressure monitor are all a
:class:`PeriodicService`: one pass is :meth:`~PeriodicService.run_once` (what
tests and ``Dispatcher.run_once`` call), the loop repeats it until stopped.
:meth:`~PeriodicService.wake` starts the next pass now instead of at the end
of the interval: the Dispatcher calls it when something a service acts on
changed (a deploy, a rollback, a promotion), so nothing waits for a tick.

Each of them is a :class:`DispatcherService`, which wires what every sweeper
shares once: the repository, the clock (the one given, else the shared task
queue's), the task queue and the claim-order handicap of priority tiers.
"""

from __future__ import annotations

import functools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc

from trace_core.clock import Clock, SystemClock
from trace_core.errors import ConfigurationError
from trace_core.outage import LoopHealth
from trace_core.storage.protocol import Repository
from trace_core.tasks import TaskQueue

__all__ = [
    "DispatcherService",
    "Handicap",
    "PeriodicService",
    "no_handicap",
    "require_positive",
    "service_clock",
]

Handicap = Callable[[str], float]
"""Seconds a priority tier's new tasks are pushed back in claim order (the
backpressure monitor's :meth:`handicap_seconds`)."""


def service_clock(clock: Clock | None, tasks: TaskQueue | None) -> Clock:
    """A Dispatcher service's clock: the one given, else its task queue's (so
    a test's manual clock reaches every service through the shared queue),
    else the system's."""
    return clock or (tasks.clock if tasks is not None else SystemClock())


def no_handicap(tier: str) -> float:
    """The handicap of a Dispatcher without backpressure: none for every tier."""
    return 0.0


log = logging.getLogger(__name__)


def require_positive(name: str, value: float) -> None:
    """Raise :class:`ConfigurationError` ``"{name} must be > 0"`` unless ``value > 0``."""
    if value <= 0:
        raise ConfigurationError(f"{name} must be > 0")


class PeriodicService(ABC):
    """The shape of every Dispatcher sweeper: ``run_once()`` on an interval.

    ``start(task_group)`` runs the loop, ``stop()`` ends it after the current
    pass, ``wake()`` makes the next pass start now. A failing pass never ends
    the loop: a database outage (or a bug) must not end the Dispatcher's reaper
    for good. The loop backs off with jitter instead of waiting its interval
    (:class:`~trace_core.outage.LoopHealth`: the first failure of a streak is
    logged, not every retry) and carries on by itself once a pass succeeds
    again; :attr:`health` is what the readiness endpoint reports.
    """

    def __init__(self, interval_seconds: float) -> None:
        self._interval = interval_seconds
        # anyio primitives are made inside the loop: a service may be built
        # before any event loop runs (configuration, tests).
        self._stop_requested = False
        self._wake_requested = False
        self._waiting: anyio.CancelScope | None = None
        self._stopped: anyio.Event | None = None
        self.health = LoopHealth(type(self).__name__, logger=log)
        """The loop's failure streak and backoff (its ``sleep`` may be replaced by tests)."""

    def stopping(self) -> bool:
        """Whether :meth:`stop` was called (a call: it changes while ``run`` awaits)."""
        return self._stop_requested

    @abstractmethod
    async def run_once(self) -> Any:
        """One pass; tests call this directly."""

    async def run(self) -> None:
        """Call :meth:`run_once` every interval until :meth:`stop`."""
        self._stopped = anyio.Event()
        self.health.running = True
        try:
            while not self.stopping():
                # Cleared before the pass, not after: a wake-up that arrives
                # while the pass runs may concern what it has already read.
                self._wake_requested = False
                failure: Exception | None = None
                try:
                    await self.run_once()
                    self.health.succeeded()
                except Exception as exc:
                    failure = exc
                if self.stopping():
                    break
                if failure is None and self._wake_requested:
                    continue
                with anyio.CancelScope() as self._waiting:
                    if failure is not None:
                        # Not the interval: the database may be back in a
                        # second, and the reaper must not wait a minute for it.
                        await self.health.backoff_after(failure)
                    else:
                        await anyio.sleep(self._interval)
                self._waiting = None
        finally:
            self.health.running = False
            self._stopped.set()

    def wake(self) -> None:
        """Start the next pass now rather than at the end of the interval.

        A wake-up during a pass is not lost: another pass follows at once.
        Before the loop starts it changes nothing (the first pass runs at
        once anyway). Call it from the event loop the service runs in.
        """
        self._wake_requested = True
        if self._waiting is not None:
            self._waiting.cancel()

    async def start(self, task_group: anyio.abc.TaskGroup) -> None:
        """Run :meth:`run` in ``task_group``."""
        task_group.start_soon(self.run)

    async def stop(self) -> None:
        """Ask the loop to exit after its current pass; wait for it if it runs."""
        self._stop_requested = True
        if self._waiting is not None:
            self._waiting.cancel()
        if self._stopped is not None:
            await self._stopped.wait()


class DispatcherService(PeriodicService):
    """A :class:`PeriodicService` of the Dispatcher: it works on ``repo`` with
    the Dispatcher's clock, task queue and claim-order handicap, wired here
    once for every sweeper (each given one, or a default)."""

    def __init__(
        self,
        repo: Repository,
        interval_seconds: float,
        *,
        clock: Clock | None = None,
        tasks: TaskQueue | None = None,
        handicap: Handicap | None = None,
    ) -> None:
        self.repo = repo
        self.clock = service_clock(clock, tasks)
        self.handicap: Handicap = handicap or no_handicap
        """Claim-order handicap of a priority tier, for the tasks a pass creates."""
        self._given_tasks = tasks
        super().__init__(interval_seconds)

    @functools.cached_property
    def tasks(self) -> TaskQueue:
        """The task queue the service writes through: the Dispatcher's shared
        one when given, else its own on the same repository and clock."""
        return self._given_tasks or self._own_task_queue()

    def _own_task_queue(self) -> TaskQueue:
        return TaskQueue(self.repo, clock=self.clock)
