"""Bodies of the internal task and operations endpoints, and of errors."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from trace_core.api.fields import (
    MAX_EVENTS,
    Attempt,
    CapabilityToken,
    JsonObject,
    LongText,
    Name,
    Offset,
    Request,
    StrictBool,
    check_cursor,
)

__all__ = [
    "ErrorBody",
    "EventIn",
    "Events",
    "EventsRequest",
    "EventsResponse",
    "FieldError",
    "HeartbeatRequest",
    "HeartbeatResponse",
    "JwksDocument",
    "PauseRequest",
    "TaskClaimRequest",
    "TaskClaimResponse",
    "TaskClaimed",
    "TaskCompleteRequest",
    "TaskCompleteResponse",
    "TaskHeartbeatRequest",
    "TaskNotClaimed",
    "TriggerRequest",
    "TriggerResponse",
    "WorkerRefusal",
]

# --- errors ------------------------------------------------------------------


class FieldError(BaseModel):
    """One invalid field of a request."""

    field: str
    reason: str


class ErrorBody(BaseModel):
    """Every error answer: a stable ``error`` code, a human ``reason`` and, for
    malformed requests, the ``field`` at fault (``events[0].cursor``)."""

    error: str
    reason: str
    field: str | None = None
    errors: list[FieldError] | None = None


class WorkerRefusal(BaseModel):
    """A v1 worker call refused by the task's state (409) or for an unknown job (404).

    ``ack`` tells the worker whether to acknowledge its stream message: true
    when the database already holds the job's outcome or another attempt owns
    it, so a redelivery could only be refused again.
    """

    ok: Literal[False] = False
    ack: bool
    error: str
    reason: str


# --- events ------------------------------------------------------------------


class EventIn(Request):
    """An upstream event: a cursor or a (block-range) partition of a dataset version."""

    dataset_uuid: uuid.UUID
    dataset_version: uuid.UUID
    cursor: Annotated[int | str | None, BeforeValidator(check_cursor)] = None
    partition_key: Name | None = None
    start: Offset | None = None
    end: Offset | None = None


Events = Annotated[list[EventIn], Field(max_length=MAX_EVENTS)]


# --- internal task endpoints -------------------------------------------------


class TaskClaimRequest(Request):
    """``POST /internal/task-claim``."""

    task_id: uuid.UUID
    worker_id: Name


class TaskClaimed(BaseModel):
    """The lease of the task's current attempt, and its full payload."""

    status: Literal["Claimed"] = "Claimed"
    attempt: int
    lease_token: uuid.UUID
    lease_expires_at: datetime
    task: dict[str, Any]


class TaskNotClaimed(BaseModel):
    """Why the task was not claimed; the worker must not run it."""

    status: Literal["NotClaimed"] = "NotClaimed"
    reason: str


TaskClaimResponse = Annotated[TaskClaimed | TaskNotClaimed, Field(discriminator="status")]


class TaskHeartbeatRequest(Request):
    """``POST /v1/task/heartbeat`` (the capability token is the request's header)."""

    task_id: uuid.UUID
    attempt: Attempt
    lease_token: uuid.UUID


class HeartbeatRequest(TaskHeartbeatRequest):
    """``POST /internal/heartbeat``."""

    capability_token: CapabilityToken | None = Field(
        default=None,
        description="The attempt's current capability token, if it has one: when less than "
        "the server's refresh fraction (a third by default) of its lifetime is left, the "
        "answer carries a renewed one. Never logged.",
    )


class HeartbeatResponse(BaseModel):
    """The extended lease, what a source should do (``run``/``pause``/``stop``)
    and, when the attempt's capability token was due, its renewal."""

    ok: bool
    lease_expires_at: datetime
    directive: str
    capability_token: str | None = Field(
        default=None,
        description="A renewed capability token for the same task attempt and the same "
        "grants (new jti, iat, nbf and exp), issued when the presented token had less than "
        "the refresh fraction of its lifetime left; null otherwise. Replace the old token "
        "with it, and mint new scoped credentials from it.",
    )


class TaskCompleteRequest(Request):
    """``POST /internal/task-complete``.

    ``lease_token`` is required for ``Completed`` and ``Failed``; a wrapper
    acknowledging a ``Canceled`` task it never claimed has none.
    """

    task_id: uuid.UUID
    attempt: Attempt
    lease_token: uuid.UUID | None = None
    status: Literal["Completed", "Failed", "Canceled"]
    events: Events = Field(default_factory=list)
    outputs: Annotated[list[JsonObject], Field(max_length=MAX_EVENTS)] | None = None
    error_message: LongText | None = None
    retryable: StrictBool = True


class TaskCompleteResponse(BaseModel):
    """The task's status after the report.

    ``duplicate`` marks a repeated report of an attempt whose outcome was
    already recorded (nothing changed); ``retrying`` says, for ``Failed``,
    whether a retry is scheduled.
    """

    ok: bool
    task_id: uuid.UUID
    status: str
    duplicate: bool = False
    retrying: bool | None = None
    event_ids: list[uuid.UUID] = Field(default_factory=list)


class EventsRequest(Request):
    """``POST /internal/events`` (single, partitioned or batch shape)."""

    task_id: uuid.UUID
    attempt: Attempt
    events: Annotated[list[EventIn], Field(min_length=1, max_length=MAX_EVENTS)]


class EventsResponse(BaseModel):
    """Stored event ids in request order; how many were new and how many redeliveries."""

    ok: bool
    event_ids: list[uuid.UUID]
    new: int
    duplicates: int


class JwksDocument(BaseModel):
    """The JWKS that verifies task capability tokens."""

    model_config = ConfigDict(extra="allow")

    keys: list[dict[str, Any]]


# --- ops ---------------------------------------------------------------------


class TriggerRequest(Request):
    """``POST /internal/trigger``: ``{job, key}`` starts a manual source's task
    (idempotent per key); ``{events}`` emits manual events."""

    job: Name | None = None
    key: Name | None = None
    events: Annotated[list[EventIn], Field(min_length=1, max_length=MAX_EVENTS)] | None = None


class PauseRequest(Request):
    """``POST /internal/pause`` and ``/internal/resume``: the live job ``dag/job``
    of ``org``, paused or resumed by hand on behalf of ``by``."""

    dag: Name
    job: Name
    org: Name = "default"
    by: Name
    """Who, for the pause reason (``manual by <by>``)."""


class TriggerResponse(BaseModel):
    """A manual task (``task_id``, ``created``, or ``refused`` under backpressure)
    or accepted manual events (``event_ids``, ``new``, ``duplicates``)."""

    job_id: uuid.UUID | None = None
    task_id: uuid.UUID | None = None
    created: bool = False
    refused: str | None = None
    event_ids: list[uuid.UUID] = Field(default_factory=list)
    new: int = 0
    duplicates: int = 0
