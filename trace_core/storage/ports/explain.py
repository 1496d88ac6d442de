"""The explain area of the repository port: what operators read to see why a
job did or did not run, and how much work there is.

Reached as ``tx.explain`` on any :class:`~trace_core.storage.protocol.Transaction`.
Serves :func:`~trace_core.dispatcher.explain.explain_job` and the task totals
of :func:`~trace_core.dispatcher.metrics.render_metrics`. Everything here is
read as the Dispatcher stored it; nothing is recomputed.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

__all__ = ["ExplainOps", "ExplainedJob", "FailedAttempt", "InputEvent", "JobStateFlags"]


@dataclass(frozen=True)
class ExplainedJob:
    """A job as ``explain`` shows it, with the status of its DAG version."""

    job_id: uuid.UUID
    dag_version_id: uuid.UUID
    version_status: str
    activation: str
    operator: str
    runtime: str
    input_datasets: tuple[uuid.UUID, ...]


@dataclass(frozen=True)
class JobStateFlags:
    """What a job's ``job_states`` row says about whether it runs."""

    paused: bool
    pause_reason: str | None
    source_status: str | None
    scale_state: str | None


@dataclass(frozen=True)
class FailedAttempt:
    """A task whose last attempt recorded an error."""

    task_id: uuid.UUID
    attempt: int
    status: str
    error: str
    next_retry_at: datetime | None


@dataclass(frozen=True)
class InputEvent:
    """A stored event on a dataset, with what routing recorded for it."""

    received_at: datetime
    dataset: str
    dataset_version: uuid.UUID
    unit: str
    deliveries: int
    route_status: str
    route_detail: dict[str, Any] | None
    """``{job name: decision}`` as routing wrote it; ``None`` before routing."""


class ExplainOps(Protocol):
    """Reads for ``explain`` and metrics, inside one transaction."""

    async def find_job(self, org_slug: str, dag_name: str, job_name: str) -> ExplainedJob | None:
        """Job ``job_name`` of DAG ``dag_name`` in the org with ``org_slug``, in the
        DAG's ``current`` version, else its ``building`` one, else its newest
        (by creation); ``None`` when no version has such a job."""
        ...

    async def job_state(self, job_id: uuid.UUID) -> JobStateFlags | None:
        """The job's state row, or ``None`` when it has none yet."""
        ...

    async def task_status_counts(self, job_id: uuid.UUID | None = None) -> dict[str, int]:
        """How many tasks are in each status (statuses with none are absent): of
        ``job_id``, or of every job when it is ``None``."""
        ...

    async def failed_attempts(self, job_id: uuid.UUID, *, limit: int) -> list[FailedAttempt]:
        """Up to ``limit`` tasks of ``job_id`` that recorded an error (whatever
        their status now), newest task first."""
        ...

    async def recent_input_events(
        self, dataset_uuids: Collection[uuid.UUID], *, limit: int
    ) -> list[InputEvent]:
        """Up to ``limit`` events on any of ``dataset_uuids``, newest received
        first; empty for an empty input."""
        ...
