"""Operators for ``tests/test_e2e_http.py`` (``--operators tests.e2e_operators:OPERATORS``).

``gate`` records that it started (``started-<task>-<attempt>`` in the job's
``config.marker_dir``, holding the worker's pid), then waits until the file
``release`` exists there, bounded by ``config.max_wait_seconds``; then it
records ``done-<task>-<attempt>`` and completes. The test controls when work
may finish, and learns which worker process holds which attempt, without
sleeping as synchronization.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from trace_core.authoring.context import OperatorError, OperatorResult
from trace_core.authoring.operators import OperatorRegistry, OperatorSpec

__all__ = ["OPERATORS", "RELEASE", "gate"]

RELEASE = "release"
_POLL_SECONDS = 0.02


def gate(ctx: Any) -> OperatorResult:
    """Mark the start, wait for the release file, mark the end (see the module docstring)."""
    marker_dir = Path(str(ctx.config["marker_dir"]))
    limit = float(ctx.config.get("max_wait_seconds", 60))
    name = f"{ctx.task_id}-{ctx.attempt}"
    _mark(marker_dir / f"started-{name}")
    deadline = time.monotonic() + limit
    while not (marker_dir / RELEASE).exists():
        if time.monotonic() > deadline:
            raise OperatorError(f"no release file within {limit}s")
        ctx.check()  # raises once the lease is lost
        time.sleep(_POLL_SECONDS)
    _mark(marker_dir / f"done-{name}")
    return OperatorResult()


def _mark(path: Path) -> None:
    """Write this process's pid to ``path`` atomically: the tests wait for the
    file to exist and then read the pid, so it must never exist empty (a
    plain ``write_text`` creates the file before it writes; on a loaded
    machine a test read it in between)."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(str(os.getpid()))
    os.replace(partial, path)


OPERATORS = OperatorRegistry([OperatorSpec("gate", gate, source=True)])
