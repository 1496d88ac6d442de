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

from collections.abc import Callable

import anyio
import anyio.abc

from trace_core.dag import LIVE_JOBS_CHANNEL
from trace_core.storage.protocol import Repository
from trace_core.wakeup import Subscription

__all__ = ["LiveJobsWatcher"]


class LiveJobsWatcher:
    """Calls ``on_change`` after each commit that changed the live jobs (see module doc)."""

    def __init__(self, repo: Repository, on_change: Callable[[], None]) -> None:
        self.repo = repo
        self.on_change = on_change
        self._scope: anyio.CancelScope | None = None
        self._stopped: anyio.Event | None = None

    async def start(self, task_group: anyio.abc.TaskGroup) -> None:
        """Subscribe (in effect on return), then watch in ``task_group``."""
        subscription = await self.repo.subscribe(LIVE_JOBS_CHANNEL)
        self._scope = anyio.CancelScope()
        self._stopped = anyio.Event()
        task_group.start_soon(self._watch, subscription, self._scope, self._stopped)

    async def _watch(
        self, subscription: Subscription, scope: anyio.CancelScope, stopped: anyio.Event
    ) -> None:
        try:
            with scope:
                while True:
                    # The bound only keeps the wait finite; a timeout means nothing.
                    if await subscription.wait(3600.0):
                        self.on_change()
        finally:
            stopped.set()

    async def stop(self) -> None:
        """Stop watching; returns once the watch has ended."""
        if self._scope is None or self._stopped is None:
            return
        self._scope.cancel()
        await self._stopped.wait()
