"""Worker identity: ``POD_NAME`` -> ``HOSTNAME`` -> boot UUID (euterpe-contract.md §2)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping

__all__ = ["boot_id", "worker_id"]

_boot: tuple[int, str] | None = None


def boot_id() -> str:
    """A logical identity that is new for every process start.

    Keyed by pid so that a forked child (multiprocessing) gets its own id
    instead of inheriting its parent's.
    """
    global _boot
    pid = os.getpid()
    if _boot is None or _boot[0] != pid:
        _boot = (pid, f"boot-{uuid.uuid4()}")
    return _boot[1]


def worker_id(environ: Mapping[str, str] | None = None) -> str:
    """Return the worker id: ``POD_NAME``, else ``HOSTNAME``, else :func:`boot_id`.

    Empty or blank values count as missing.
    """
    env = os.environ if environ is None else environ
    for name in ("POD_NAME", "HOSTNAME"):
        value = env.get(name, "").strip()
        if value:
            return value
    return boot_id()
