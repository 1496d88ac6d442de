"""Operators for ``tests/test_outage_pg.py`` (``--operators tests.outage_operators:OPERATORS``).

``tick`` runs in-process (``runtime: dispatcher``): it emits one cursor
event (the task id) on its output, which routing turns into a ``mark`` task.
``mark`` runs in ``trace-lite worker`` processes and records
``done-<task>-<attempt>`` (holding the worker's pid) in the job's
``config.marker_dir``. The test learns what ran where from those files and
from the database, never by sleeping.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from trace_core.authoring.context import OperatorResult
from trace_core.authoring.events import DatasetEvent
from trace_core.authoring.operators import OperatorRegistry, OperatorSpec

__all__ = ["OPERATORS", "mark", "tick"]


def tick(ctx: Any) -> OperatorResult:
    """One cursor event on the first output: routed into a ``mark`` task."""
    out = ctx.outputs[0]
    event = DatasetEvent(
        uuid.UUID(str(out["dataset_uuid"])),
        uuid.UUID(str(out["dataset_version"])),
        cursor=str(ctx.task_id),
    )
    return OperatorResult(events=[event])


def mark(ctx: Any) -> OperatorResult:
    """Record that this attempt ran, and in which process."""
    marker_dir = Path(str(ctx.config["marker_dir"]))
    (marker_dir / f"done-{ctx.task_id}-{ctx.attempt}").write_text(str(os.getpid()))
    return OperatorResult()


OPERATORS = OperatorRegistry([OperatorSpec("tick", tick, source=True), OperatorSpec("mark", mark)])
