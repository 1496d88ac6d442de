"""The launch area of the repository port: which tasks a wake-up may start, and how.

Reached as ``tx.launch`` on any :class:`~trace_core.storage.protocol.Transaction`.
The task launcher (:mod:`trace_core.dispatcher.launcher`) decides where each
task starts; this area only reads the tasks and their job's runtime.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

__all__ = ["LaunchOps", "StartableTask"]


@dataclass(frozen=True)
class StartableTask:
    """A ``Queued`` task with the runtime and operator of its job."""

    task_id: uuid.UUID
    runtime: str
    operator: str


class LaunchOps(Protocol):
    """Task start lookups, inside one transaction."""

    async def startable_tasks(self, task_ids: Collection[uuid.UUID]) -> list[StartableTask]:
        """The ``Queued`` tasks among ``task_ids`` (one statement), in no
        particular order; tasks in any other status, and ids of no task, are
        left out. Empty for empty ``task_ids``."""
        ...
