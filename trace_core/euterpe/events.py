"""The webhook events of an inbox job (euterpe-contract.md §8): their types and bodies.

One event per status a job enters. Its body is what the deliverer posts, byte
for byte, to ``status_webhook_url``: intermediate events carry the status and
metadata, ``succeeded`` its outputs, ``failed`` and ``dead_letter`` a
normalized error. ``event_id`` (the row's id) and ``sequence`` (its place
among the job's events) are stable, so a receiver dedupes and orders by them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

__all__ = ["EVENT_TYPE_PREFIX", "NormalizedError", "event_body", "event_type"]

EVENT_TYPE_PREFIX = "transcode."


def event_type(status: str) -> str:
    """The event type of entering ``status`` (``transcode.processing`` …)."""
    return EVENT_TYPE_PREFIX + status


@dataclass(frozen=True)
class NormalizedError:
    """An error as requesters see it: a stable code, a message, whether a retry may help."""

    code: str
    """Machine-readable: ``source_too_large``, ``storage_forbidden``, ``transcode_failed`` …"""
    message: str
    retryable: bool
    http_status: int | None = None
    """The upstream HTTP status that caused it, when there was one."""

    def as_json(self) -> dict[str, Any]:
        """The JSON form used in events and status reads."""
        return {
            "code": self.code,
            "message": self.message,
            "retryable": self.retryable,
            "http_status": self.http_status,
        }


def event_body(
    *,
    event_id: UUID,
    job_id: UUID,
    sequence: int,
    status: str,
    occurred_at: datetime,
    attempt_count: int,
    metadata: Mapping[str, Any] | None = None,
    outputs: Sequence[Mapping[str, Any]] | None = None,
    error: NormalizedError | None = None,
) -> dict[str, Any]:
    """The JSON body of one event; ``outputs`` only for ``succeeded``, ``error``
    only for ``failed`` and ``dead_letter``."""
    body: dict[str, Any] = {
        "event_id": str(event_id),
        "event_type": event_type(status),
        "job_id": str(job_id),
        "sequence": sequence,
        "status": status,
        "occurred_at": occurred_at.isoformat(),
        "attempt_count": attempt_count,
        "metadata": dict(metadata or {}),
    }
    if status == "succeeded":
        body["outputs"] = [dict(o) for o in outputs or ()]
    if status in ("failed", "dead_letter") and error is not None:
        body["error"] = error.as_json()
    return body
