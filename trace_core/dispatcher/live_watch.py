"""Wake the loops that act on live jobs when the live set changes, wherever it changed.

A deploy, a promotion or a rollback notifies
:data:`~trace_core.dag.LIVE_JOBS_CHANNEL` in its transaction.
:class:`LiveJobsWatcher` subscribes to that channel and calls ``on_change``
for every commit it hears of: the Dispatcher then wakes its source
supervisor, cron, backfill and promoter, so an always-on source starts now
rather than at the end of an interval.

The subscription is in effect once :meth:`LiveJobsWatcher.start` returns. On
Postgres it hears commits of other processes too (``LISTEN``), such as a
``trace-lite dag deploy`` run next to a serving platform; on SQLite only
commits made in this process wake it, and the loops' own intervals pick up
the rest. A wake-up is a hint, never the truth: the woken loops read the
database.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio
import anyio.abc

from trace_core.dag import LIVE_JOBS_CHANNEL
from trace_core.outage import LoopHealth
from trace_core.storage.protocol import Repository
from trace_core.wakeup import Subscription

__all__ = ["LiveJobsWatcher"]

log = logging.getLogger(__name__)


class LiveJobsWatcher:
    """Calls ``on_change`` after each commit that changed the live jobs (see module doc)."""

    def __init__(self, repo: Repository, on_change: Callable[[], None]) -> None:
        self.repo = repo
        self.on_change = on_change
        self._scope: anyio.CancelScope | None = None
        self._stopped: anyio.Event | None = None
        self.health = LoopHealth("live jobs watcher", logger=log)
        """Whether the watch runs. It reads no database (the wake-ups come from
        the in-process hub, fed by the listener), so an outage does not touch it."""

    async def start(self, task_group: anyio.abc.TaskGroup) -> None:
        """Subscribe (in effect on return), then watch in ``task_group``."""
        subscription = await self.repo.subscribe(LIVE_JOBS_CHANNEL)
        self._scope = anyio.CancelScope()
        self._stopped = anyio.Event()
        task_group.start_soon(self._watch, subscription, self._scope, self._stopped)

    async def _watch(
        self, subscription: Subscription, scope: anyio.CancelScope, stopped: anyio.Event
    ) -> None:
        self.health.running = True
        try:
            with scope:
                while True:
                    # The bound only keeps the wait finite; a timeout means nothing.
                    if not await subscription.wait(3600.0):
                        continue
                    try:
                        self.on_change()
                        self.health.succeeded()
                    except Exception as exc:
                        # A wake-up is a hint: the woken loops catch up on
                        # their interval anyway. Watching goes on.
                        self.health.failed(exc)
        finally:
            self.health.running = False
            stopped.set()

    async def stop(self) -> None:
        """Stop watching; returns once the watch has ended."""
        if self._scope is None or self._stopped is None:
            return
        self._scope.cancel()
        await self._stopped.wait()
