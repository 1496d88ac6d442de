"""Bodies of the Euterpe HTTP API (``/transcode``): what the OpenAPI document
describes and what :mod:`trace_core.api.transcode` parses.

The request body of ``POST /transcode`` is
:class:`~trace_core.euterpe.requests.TranscodeRequest` itself (one model, one
set of rules); the answers are described here. The status body mirrors
:meth:`~trace_core.euterpe.job_status.JobStatus.as_json`, which produces it.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trace_core.api.errors import field_path
from trace_core.errors import InvalidInput
from trace_core.euterpe.requests import CredentialsBody

__all__ = [
    "CredentialRefreshRequest",
    "CredentialsRefreshed",
    "HistoryItem",
    "JobError",
    "JobStatusBody",
    "OutputItem",
    "TranscodeAccepted",
    "WebhookItem",
    "parse_refresh_request",
]


class TranscodeAccepted(BaseModel):
    """``202``: the job is queued (or was, for a replayed request)."""

    job_id: str
    status_url: str
    """Where to read the job's status: ``/transcode/status?job_id=…``."""
    replayed: bool
    """True when this answers an earlier request with the same ``Idempotency-Key``
    and body (the ``Idempotent-Replayed: true`` header says so too)."""


class HistoryItem(BaseModel):
    """One status the job entered."""

    model_config = ConfigDict(populate_by_name=True)

    from_: str | None = Field(alias="from")
    to: str
    at: str
    attempt_count: int
    reason: str | None


class WebhookItem(BaseModel):
    """Where one webhook event of the job stands."""

    event_id: str
    sequence: int
    event_type: str
    status: str
    """``pending``, ``leased``, ``delivered`` or ``dead_letter``."""
    attempts: int


class OutputItem(BaseModel):
    """One output object of a succeeded job."""

    key: str
    """Its ``s3://`` URI under the output prefix."""
    preset: str
    size: int
    sha256: str


class JobError(BaseModel):
    """The normalized error of a failed or dead-lettered job."""

    code: str
    message: str
    retryable: bool
    http_status: int | None
    """The upstream HTTP status that caused it, when there was one."""


class JobStatusBody(BaseModel):
    """``200`` of ``GET /transcode/status``."""

    job_id: str
    status: str
    """``queued``, ``claimed``, ``fetching``, ``processing``, ``uploading``,
    ``succeeded``, ``failed`` or ``dead_letter``."""
    attempt_count: int
    max_attempts: int
    credential_refresh_count: int
    created_at: str
    updated_at: str
    finished_at: str | None
    next_attempt_at: str | None
    history: list[HistoryItem]
    webhooks: list[WebhookItem]
    outputs: list[OutputItem] | None = None
    """Present once the job succeeded."""
    error: JobError | None = None
    """Present when the job is ``failed`` or ``dead_letter``."""


class CredentialRefreshRequest(BaseModel):
    """The body of ``PUT /transcode/{job_id}/credentials``: the requester's
    answer to a refresh call (§7 step 2)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    credential_version: Annotated[int, Field(ge=0)]
    """The version the new credentials replace (the one the refresh call named)."""
    storage_credentials: CredentialsBody


class CredentialsRefreshed(BaseModel):
    """``200``: the new credentials are stored, sealed, under ``credential_version``."""

    job_id: str
    credential_version: int


def parse_refresh_request(body: bytes) -> CredentialRefreshRequest:
    """``body`` as a :class:`CredentialRefreshRequest`; the first problem as
    :class:`InvalidInput` naming the field (never quoting a value)."""
    try:
        return CredentialRefreshRequest.model_validate_json(body)
    except ValidationError as exc:
        first: Any = exc.errors(include_url=False, include_input=False, include_context=False)[0]
        loc = [part for part in first["loc"] if not str(part).startswith("function-")]
        field = "body" if first["type"] == "json_invalid" else field_path(loc)
        reason = str(first["msg"]).removeprefix("Value error, ")
        raise InvalidInput(field, reason) from None
