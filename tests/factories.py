"""Rows the protocol tests need around a task."""

from __future__ import annotations

import uuid
from datetime import datetime

from trace_core.standalone import ensure_standalone_job
from trace_core.storage.sql import SqlRepository


async def make_job(
    repo: SqlRepository, now: datetime, *, max_attempts: int = 3, name: str = "noop"
) -> uuid.UUID:
    """A standalone job (org + DAG version + job); return its id."""
    return await ensure_standalone_job(repo, name, now=now, max_attempts=max_attempts)
