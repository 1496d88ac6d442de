"""What every transition of an inbox job writes beside the status change.

euterpe-contract.md §8: "state transition and outbox insert must occur in the
same DB transaction". A :class:`Transition` names the statuses one job just
passed through (one step, or ``failed`` then ``dead_letter``); :func:`record`
writes, in the caller's transaction, one history row per step and, for a job
with a webhook URL, one ``job_outbox_events`` row per step whose body is
:func:`~trace_core.euterpe.events.event_body`. Called after the protocol's
write, it reads the job's new values under the row lock, which also makes its
``sequence`` numbers safe (see ``InboxOps.lock_jobs_for_transition``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from trace_core.errors import ConfigurationError, NotFound
from trace_core.euterpe.events import NormalizedError, event_body, event_type
from trace_core.model import Fence, Lease
from trace_core.storage.ports.inbox import HistoryEntry, JobSnapshot, NewJobEvent
from trace_core.storage.protocol import Transaction

__all__ = [
    "EVENTS_CHANNEL",
    "Transition",
    "chain",
    "error_text",
    "job_id_of",
    "parse_error",
    "record",
]

EVENTS_CHANNEL = "euterpe_job_events"
"""Notified at the commit of every transaction that wrote job events, so a
deliverer subscribed to it (in this process, or any on Postgres) polls at once."""


@dataclass(frozen=True)
class Transition:
    """The statuses one job just passed through, and what its events carry."""

    job_id: uuid.UUID
    steps: Sequence[tuple[str | None, str]]
    """``(from, to)`` pairs in order; ``from`` is ``None`` for the insert."""
    reason: str | None = None
    error: NormalizedError | None = None
    outputs: Sequence[Mapping[str, Any]] | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)


def job_id_of(item: Fence | Lease | object) -> uuid.UUID:
    """The job id of a fence, a lease or a protocol answer (inbox ids are UUIDs)."""
    value = item.item_id if isinstance(item, (Fence, Lease)) else item
    if not isinstance(value, uuid.UUID):
        raise ConfigurationError(f"an inbox job id is a UUID, got {value!r}")
    return value


def chain(source: str, path: Sequence[str]) -> list[tuple[str | None, str]]:
    """The steps ``source -> path[0] -> path[1] …`` (a failure's
    :attr:`~trace_core.leasing.FailOutcome.path` from the stage it left)."""
    steps: list[tuple[str | None, str]] = []
    for target in path:
        steps.append((source, target))
        source = target
    return steps


def error_text(error: NormalizedError) -> str:
    """How a normalized error is kept in ``inbox_jobs.last_error`` (its JSON)."""
    return json.dumps(error.as_json(), sort_keys=True)


def parse_error(text: str | None) -> NormalizedError | None:
    """The normalized error of ``last_error``; text that is not one (written
    before Euterpe, or by hand) becomes an ``unknown`` error carrying it."""
    if not text:
        return None
    try:
        data = json.loads(text)
        return NormalizedError(
            code=str(data["code"]),
            message=str(data["message"]),
            retryable=bool(data["retryable"]),
            http_status=data.get("http_status"),
        )
    except (ValueError, KeyError, TypeError):
        return NormalizedError(code="unknown", message=text, retryable=False)


async def record(
    t: Transaction,
    transitions: Sequence[Transition],
    *,
    now: datetime,
    event_max_attempts: int,
    new_event_id: Callable[[], uuid.UUID] = uuid.uuid4,
) -> list[uuid.UUID]:
    """Write the history rows and events of ``transitions`` in ``t``; the ids
    of the events written, in order. The jobs' rows must have been changed in
    ``t`` already (their new values are what the rows and bodies carry)."""
    if not transitions:
        return []
    snapshots = await t.inbox.lock_jobs_for_transition({tr.job_id for tr in transitions})
    history: list[HistoryEntry] = []
    events: list[NewJobEvent] = []
    sequences: dict[uuid.UUID, int] = {}
    for tr in transitions:
        snap = snapshots.get(tr.job_id)
        if snap is None:  # the protocol's write just matched it: cannot happen
            raise NotFound(f"inbox job {tr.job_id} vanished inside its own transition")
        for source, target in tr.steps:
            history.append(
                HistoryEntry(
                    job_id=tr.job_id,
                    from_status=source,
                    to_status=target,
                    claim_version=snap.claim_version,
                    attempt_count=snap.attempt_count,
                    worker_id=snap.worker_id,
                    reason=tr.reason,
                    at=now,
                )
            )
            if snap.status_webhook_url is None:
                continue  # a requester that polls only (§14): nothing to deliver
            sequence = sequences.get(tr.job_id, snap.next_sequence)
            sequences[tr.job_id] = sequence + 1
            events.append(
                _event(tr, snap, target, new_event_id(), sequence, now, event_max_attempts)
            )
    await t.inbox.append_history(history)
    await t.inbox.insert_events(events, now=now)
    if events:
        t.notify(EVENTS_CHANNEL)
    return [ev.event_id for ev in events]


def _event(
    tr: Transition,
    snap: JobSnapshot,
    status: str,
    event_id: uuid.UUID,
    sequence: int,
    now: datetime,
    max_attempts: int,
) -> NewJobEvent:
    # Not the worker's id: a pod or host name is the operator's, not the requester's.
    metadata: dict[str, Any] = {
        "claim_version": snap.claim_version,
        "max_attempts": snap.max_attempts,
        "credential_refresh_count": snap.credential_refresh_count,
    }
    if tr.reason is not None:
        metadata["reason"] = tr.reason
    if status in ("failed", "queued") and snap.status == status:
        # a retry's (or a hand-back's) next claim is not before this time
        metadata["available_at"] = snap.available_at.isoformat()
    metadata.update(tr.metadata)
    body = event_body(
        event_id=event_id,
        job_id=tr.job_id,
        sequence=sequence,
        status=status,
        occurred_at=now,
        attempt_count=snap.attempt_count,
        metadata=metadata,
        outputs=tr.outputs,
        error=tr.error,
    )
    return NewJobEvent(
        event_id=event_id,
        job_id=tr.job_id,
        sequence=sequence,
        event_type=event_type(status),
        payload=body,
        available_at=now,
        max_attempts=max_attempts,
    )
