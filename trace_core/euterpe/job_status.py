"""What a status read shows of an inbox job (euterpe-contract.md §6).

The stage, both counters with their budgets, the timestamps, the outputs once
succeeded, the normalized error once failed or dead-lettered, the history of
stages and where each webhook event stands. Never the request's credentials:
they are not read.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from trace_core.errors import NotFound
from trace_core.euterpe.events import NormalizedError
from trace_core.euterpe.job_records import parse_error
from trace_core.storage.ports.inbox import (
    EventDelivery,
    HistoryEntry,
    JobStatusRecord,
    Tombstone,
)

__all__ = ["JobPruned", "JobStatus", "job_status_of"]


class JobPruned(NotFound):
    """The job existed but was removed by retention pruning (HTTP 410 Gone)."""

    def __init__(self, tombstone: Tombstone) -> None:
        super().__init__(
            f"inbox job {tombstone.job_id} was pruned at {tombstone.pruned_at.isoformat()} "
            f"(final status {tombstone.final_status})"
        )
        self.tombstone = tombstone


@dataclass(frozen=True)
class JobStatus:
    """The status read model of one job."""

    job_id: uuid.UUID
    requester_id: str
    status: str
    attempt_count: int
    max_attempts: int
    credential_refresh_count: int
    created_at: datetime
    updated_at: datetime
    """When the job entered its current status (its last history row)."""
    finished_at: datetime | None
    next_attempt_at: datetime | None
    """When a ``queued`` or ``failed`` job may next be claimed."""
    outputs: list[dict[str, Any]] | None
    error: NormalizedError | None
    history: list[HistoryEntry]
    events: list[EventDelivery]

    def as_json(self) -> dict[str, Any]:
        """The JSON body of ``GET /transcode/status``."""
        body: dict[str, Any] = {
            "job_id": str(self.job_id),
            "status": self.status,
            "attempt_count": self.attempt_count,
            "max_attempts": self.max_attempts,
            "credential_refresh_count": self.credential_refresh_count,
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
            "finished_at": self.finished_at.isoformat() if self.finished_at else None,
            "next_attempt_at": self.next_attempt_at.isoformat() if self.next_attempt_at else None,
            "history": [
                {
                    "from": h.from_status,
                    "to": h.to_status,
                    "at": h.at.isoformat(),
                    "attempt_count": h.attempt_count,
                    "reason": h.reason,
                }
                for h in self.history
            ],
            "webhooks": [
                {
                    "event_id": str(e.event_id),
                    "sequence": e.sequence,
                    "event_type": e.event_type,
                    "status": e.status,
                    "attempts": e.attempts,
                }
                for e in self.events
            ],
        }
        if self.outputs is not None:
            body["outputs"] = self.outputs
        if self.error is not None:
            body["error"] = self.error.as_json()
        return body


def job_status_of(found: JobStatusRecord) -> JobStatus:
    """The read model of a job's stored row, history and events."""
    job = found.job
    waiting = job.status in ("queued", "failed")
    return JobStatus(
        job_id=job.job_id,
        requester_id=job.requester_id,
        status=job.status,
        attempt_count=job.attempt_count,
        max_attempts=job.max_attempts,
        credential_refresh_count=job.credential_refresh_count,
        created_at=job.created_at,
        updated_at=found.history[-1].at if found.history else job.created_at,
        finished_at=job.finished_at if job.status in ("succeeded", "dead_letter") else None,
        next_attempt_at=job.available_at if waiting else None,
        outputs=list(job.outputs) if job.status == "succeeded" and job.outputs else None,
        error=parse_error(job.last_error) if job.status in ("failed", "dead_letter") else None,
        history=found.history,
        events=found.events,
    )
