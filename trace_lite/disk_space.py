"""A full data directory: told apart from every other failure, and stopped on.

On a full disk nothing the lite platform writes can succeed: the SQLite
state and data databases refuse every write ("database or disk is full"),
Spark's Parquet writes fail, so does the lock file. Left running, the
services would retry their writes (harmless: SQLite rolls each one back, the
database stays intact) but every task attempt would fail and spend one of
its attempts, until tasks were dead-lettered for want of space.
So the platform checks the free space of the data directory's filesystem:
before it starts, and while ``trace-lite run`` follows a run. Below
:data:`MIN_FREE_BYTES` it stops at once with :class:`DataDirectoryFull`
(no drain: a drain would only write) and the next start takes over what was
in flight (:mod:`trace_lite.takeover`) once there is space again.
"""

from __future__ import annotations

import os
from pathlib import Path

from trace_core.errors import TraceError

__all__ = ["MIN_FREE_BYTES", "DataDirectoryFull", "check_free_space", "free_bytes"]

MIN_FREE_BYTES = 8 * 1024 * 1024
"""Below this much free space the data directory counts as full: SQLite
needs room for its journal and Spark for a partition's staging files."""


class DataDirectoryFull(TraceError):
    """The data directory's filesystem has no room left; the message names the
    directory, the free space and what to do."""


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged writer may still use on ``directory``'s filesystem."""
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def check_free_space(directory: Path, minimum: int = MIN_FREE_BYTES) -> None:
    """Raise :class:`DataDirectoryFull` when ``directory``'s filesystem has less
    than ``minimum`` bytes free (``minimum`` 0: never)."""
    if minimum <= 0:
        return
    free = free_bytes(directory)
    if free < minimum:
        raise DataDirectoryFull(
            f"data directory {directory} is full: {free:,} bytes free, "
            f"at least {minimum:,} needed; free some space and run again "
            "(the run resumes where it stopped)"
        )
