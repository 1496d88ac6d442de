"""What a lite platform does once it holds its data directory lock.

The lock (:mod:`trace_lite.data_dir_lock`) proves that every earlier process
of the directory is gone, so their work in progress is known to be dead:

- its leases are taken back at once (the running tasks of its in-process
  workers, the always-on source run among them, and the outbox rows its relay
  had claimed), through the ownership protocol's fenced writes with their
  ``claim_version`` bumped, instead of waiting for each lease to expire (the
  chain example's source holds a 60 s lease);
- the Spark staging directories its writes left (``._staging-*`` next to a
  destination, see :func:`~trace_lite.pipeline.transforms.commit_parquet`)
  are removed: a staging directory belongs to a write in progress, and no
  write is in progress before the platform starts.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from trace_core.dispatcher.service import Dispatcher
from trace_lite.data_dir_lock import DataDirLock
from trace_lite.pipeline.transforms import STAGING_PREFIX

__all__ = ["Takeover", "reclaim_previous_leases", "sweep_staging"]

log = logging.getLogger(__name__)


@dataclass
class Takeover:
    """What a start took over from the previous process of its data directory."""

    tasks: int = 0
    """Running tasks of the previous process failed at once (retried with backoff)."""
    outbox: int = 0
    """Outbox rows its relay had claimed, handed back at once."""
    staging: list[Path] = field(default_factory=list)
    """Stale staging directories removed."""
    previous_pid: int | None = None
    """The pid of the directory's previous process."""

    @property
    def any(self) -> bool:
        """Whether anything was taken over (the previous process did not stop cleanly)."""
        return bool(self.tasks or self.outbox or self.staging)

    def describe(self) -> str:
        """One line for the run's output."""
        who = f"pid {self.previous_pid}" if self.previous_pid is not None else "a process"
        return (
            f"restart after {who}: took back {self.tasks} task lease(s) and "
            f"{self.outbox} outbox lease(s) at once, removed {len(self.staging)} "
            "stale staging director" + ("y" if len(self.staging) == 1 else "ies")
        )


def sweep_staging(objects: Path) -> list[Path]:
    """Remove every ``._staging-*`` directory under ``objects``; those removed.

    Only while no write can be in progress (the data directory lock is held
    and the platform's workers are not started yet).
    """
    removed: list[Path] = []
    if not objects.is_dir():
        return removed
    for root, dirs, _files in os.walk(objects):
        for name in [d for d in dirs if d.startswith(STAGING_PREFIX)]:
            path = Path(root) / name
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            dirs.remove(name)  # not descended into: it is gone
    return removed


async def reclaim_previous_leases(dispatcher: Dispatcher, lock: DataDirLock) -> Takeover:
    """Take back the leases the directory's earlier processes held (the
    dispatcher must not be started yet: its own workers share the prefix)."""
    who = f"pid {lock.previous_pid}" if lock.previous_pid is not None else "a process"
    reason = (
        f"lease reclaimed at restart: its holder ({who} of data directory {lock.directory}) is gone"
    )
    tasks = await dispatcher.reaper.reclaim_held_by(lock.worker_prefix, reason)
    outbox = await dispatcher.relay.leases.reclaim_held_by(lock.worker_prefix, reason=reason)
    taken = Takeover(
        tasks=tasks.expired,
        outbox=len(outbox.retried) + len(outbox.dead_lettered),
        previous_pid=lock.previous_pid,
    )
    if taken.tasks or taken.outbox:
        log.info("took back %d task and %d outbox lease(s) of %s", taken.tasks, taken.outbox, who)
    return taken
