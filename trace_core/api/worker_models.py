"""Bodies of the v1 worker contract (worker-control-plane-v1.md)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from trace_core.api.fields import (
    MAX_EVENTS,
    MAX_WAIT_MS,
    Attempt,
    JsonObject,
    LongText,
    Name,
    Request,
    StrictBool,
)
from trace_core.api.models import Events

__all__ = [
    "MAX_ERROR_MESSAGE",
    "MAX_STACK",
    "AttemptRef",
    "WorkerAck",
    "WorkerClaimRequest",
    "WorkerClaimResponse",
    "WorkerCompleteRequest",
    "WorkerError",
    "WorkerFailRequest",
    "WorkerFailResponse",
    "WorkerHeartbeatRequest",
    "WorkerHeartbeatResponse",
    "WorkerResult",
]


MAX_ERROR_MESSAGE = 8_192
"""Characters of an error ``message`` kept; a longer one is truncated."""
MAX_STACK = 65_536
"""Characters of an error ``stack`` kept: a longer one is truncated, keeping its
end (the innermost frames and the exception), never refused."""

_TRUNCATED = "[... {} characters truncated ...]\n"


def _keep_head(value: str) -> str:
    if len(value) <= MAX_ERROR_MESSAGE:
        return value
    return value[:MAX_ERROR_MESSAGE] + _TRUNCATED.format(len(value) - MAX_ERROR_MESSAGE).strip()


def _keep_tail(value: str) -> str:
    if len(value) <= MAX_STACK:
        return value
    return _TRUNCATED.format(len(value) - MAX_STACK) + value[-MAX_STACK:]


AttemptRef = Attempt | uuid.UUID
"""An attempt: its number (what the claim answers as ``attempt_id``) or the
id of its record (``job_attempts.attempt_id``)."""

_JSON_OBJECT: TypeAdapter[dict[str, Any]] = TypeAdapter(JsonObject)


class WorkerClaimRequest(Request):
    """``POST /internal/worker/claim``: streams in priority order, long-poll wait."""

    worker_id: Name
    streams: Annotated[list[Name], Field(min_length=1, max_length=16)]
    max_wait_ms: Annotated[int, Field(strict=True, ge=0, le=MAX_WAIT_MS)] = 0


class WorkerClaimResponse(BaseModel):
    """``claimed`` and, when claimed, the lease and the payload snapshot.

    ``job_id`` is the task id; ``attempt_id`` its attempt number.
    ``source`` says what found the job: ``stream`` (a stream transport
    message: ``message_id`` is its real id, e.g. a Redis Streams id
    ``1700000000000-0``), ``wakeup`` (the in-process queue) or ``database``
    (the fallback); for the last two ``message_id`` is an opaque token, as
    no transport message exists.
    """

    claimed: bool
    job_id: uuid.UUID | None = None
    attempt_id: int | None = None
    lease_token: uuid.UUID | None = None
    lease_expires_at: datetime | None = None
    stream: str | None = None
    message_id: str | None = None
    source: Literal["stream", "wakeup", "database"] | None = None
    payload: dict[str, Any] | None = None
    lease_ttl_seconds: float | None = None
    heartbeat_interval_seconds: float | None = None


class WorkerHeartbeatRequest(Request):
    """``POST /internal/worker/heartbeat``; ``attempt_id`` is optional (the lease
    token alone identifies the attempt: it is fresh per claim). ``worker_id``
    must be the worker the attempt was claimed by."""

    worker_id: Name
    job_id: uuid.UUID
    lease_token: uuid.UUID
    attempt_id: AttemptRef | None = None


class WorkerHeartbeatResponse(BaseModel):
    """The extended lease and the source directive."""

    ok: bool
    lease_expires_at: datetime
    directive: str


class WorkerResult(BaseModel):
    """A completion's result: final ``events`` and ``outputs`` are committed with
    the completion; the whole result but its ``events`` (stored as events),
    with any other members (artifact pointers, timings), is kept on the
    attempt's record. Its size is bounded by the request body limit."""

    model_config = ConfigDict(extra="allow")

    events: Events = Field(default_factory=list)
    outputs: Annotated[list[JsonObject], Field(max_length=MAX_EVENTS)] | None = None

    @model_validator(mode="after")
    def _storable_members(self) -> WorkerResult:
        # The other members are free-form: refuse what no engine can store
        # (NUL characters, NaN, nesting too deep), as for every JSON field.
        _JSON_OBJECT.validate_python(dict(self.model_extra or {}))
        return self

    def kept(self) -> dict[str, Any]:
        """What the attempt's record keeps: every member but ``events``."""
        return self.model_dump(mode="json", exclude={"events"}, exclude_none=True)


class _WorkerReport(Request):
    worker_id: Name
    job_id: uuid.UUID
    attempt_id: AttemptRef
    lease_token: uuid.UUID
    stream: Name
    message_id: Name


class WorkerCompleteRequest(_WorkerReport):
    """``POST /internal/worker/complete``."""

    result: WorkerResult = Field(default_factory=WorkerResult)


class WorkerError(Request):
    """A failure report; ``retryable`` false dead-letters the job at once.

    Kept as sent on the attempt's record, within bounds: a ``message`` longer
    than :data:`MAX_ERROR_MESSAGE` characters keeps its beginning, a ``stack``
    longer than :data:`MAX_STACK` its end; neither is refused for its length.
    """

    code: Name = "error"
    message: Annotated[LongText, AfterValidator(_keep_head)]
    stack: Annotated[LongText, AfterValidator(_keep_tail)] | None = None
    retryable: StrictBool = True


class WorkerFailRequest(_WorkerReport):
    """``POST /internal/worker/fail``."""

    error: WorkerError


class WorkerAck(BaseModel):
    """``ack``: the worker may acknowledge its stream message."""

    ok: bool
    ack: bool
    duplicate: bool = False


class WorkerFailResponse(BaseModel):
    """Where the failed job went: ``requeued`` (a retry is scheduled) or ``dlq``."""

    ok: bool
    ack: bool
    requeued: bool
    dlq: bool
    duplicate: bool = False
