"""Bodies of the task-scoped endpoints (``/v1/task/*``) that the internal ones lack.

Complete and events take the very bodies of their ``/internal`` twins,
heartbeat the internal body without ``capability_token`` (the header carries
it); all in :mod:`trace_core.api.models`.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, Field

from trace_core.api.fields import MAX_EVENTS, Attempt, JsonObject, Request
from trace_core.api.models import ErrorBody

__all__ = [
    "MAX_CREDENTIAL_SECONDS",
    "MIN_CREDENTIAL_SECONDS",
    "BufferPublishRequest",
    "BufferPublishResponse",
    "CapabilityErrorBody",
    "CredentialsRequest",
    "CredentialsResponse",
]

MIN_CREDENTIAL_SECONDS = 900
"""STS's shortest session, and the default: credentials outlive the token as little as possible."""
MAX_CREDENTIAL_SECONDS = 3600
"""STS's limit for a session assumed from role credentials (role chaining)."""


class CapabilityErrorBody(ErrorBody):
    """A refused capability: ``reason`` is a code (``expired``, ``wrong_task``,
    ``superseded``, ``missing``...), ``detail`` fixed text; never the token."""

    detail: str | None = None


class BufferPublishRequest(Request):
    """``POST /v1/task/buffer-publish``: records for one of the task's buffered outputs."""

    task_id: uuid.UUID
    attempt: Attempt
    dataset_uuid: uuid.UUID
    schema_hash: Annotated[str, Field(pattern=r"^sha256:[0-9a-f]{64}$")]
    records: Annotated[list[JsonObject], Field(min_length=1, max_length=MAX_EVENTS)]


class BufferPublishResponse(BaseModel):
    """The batch was accepted by the dataset buffer."""

    ok: bool
    dataset_uuid: uuid.UUID
    records: int


class CredentialsRequest(Request):
    """``POST /v1/task/credentials``."""

    task_id: uuid.UUID
    attempt: Attempt
    duration_seconds: Annotated[
        int, Field(strict=True, ge=MIN_CREDENTIAL_SECONDS, le=MAX_CREDENTIAL_SECONDS)
    ] = MIN_CREDENTIAL_SECONDS


class CredentialsResponse(BaseModel):
    """Short-lived object-store credentials limited to the token's S3 prefixes."""

    access_key_id: str
    secret_access_key: str
    session_token: str
    expiration: datetime
