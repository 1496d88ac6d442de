"""Operator state for a task's worker: ``/v1/task/state/read`` and ``/write``.

A worker without database credentials (the AWS profile's) reads and writes
its job's ``operator_state`` here, authorized by the attempt's capability
token like every ``/v1/task`` route (:mod:`~trace_core.api.task_scoped`).

=================================  ======================================  ===========
route                              answer                                  errors
=================================  ======================================  ===========
``POST /v1/task/state/read``       200 ``{state_key, state, version}``     400, 409
                                   (``state``/``version`` null: none yet)
``POST /v1/task/state/write``      200 ``{state_key, version}``            400, 409
=================================  ======================================  ===========

Every route also answers 401 (token), 413 (body cap) and 503 (database, or
JWKS). The org and the job are the token's task's, never the body's: a body
names only ``task_id`` and ``attempt`` (the token must be for exactly that
attempt: 401 ``wrong_task``), the ``state_key`` and, to write, the
``state`` and the ``expected_version`` read before (``null``: create).

Both routes act only while the attempt holds the task's lease, judged in the
same transaction as the read or write
(:meth:`~trace_core.dispatcher.operator_state.OperatorStateStore.put_for_attempt`):
the token of a finished, timed-out or superseded attempt, still valid until
it expires, gets 409 ``stale`` and reaches nothing. A lost version check is
409 ``conflict`` with ``expected_version`` and ``actual_version``
(:class:`StateConflictBody`), so the client raises
:class:`~trace_core.authoring.state.StateConflict`. A state over
:data:`~trace_core.limits.MAX_OPERATOR_STATE_BYTES` of JSON is a 400 naming
``state``.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, Field

from trace_core.api.capability import TaskCapability, bind_capability
from trace_core.api.errors import answer_doc
from trace_core.api.fields import Attempt, JsonObject, Name, Request
from trace_core.api.models import ErrorBody
from trace_core.api.task_scoped import TASK_ERROR_RESPONSES
from trace_core.authoring.state import DEFAULT_STATE_KEY, StateConflict
from trace_core.dispatcher.service import Dispatcher
from trace_core.limits import MAX_BIGINT, MAX_OPERATOR_STATE_BYTES

__all__ = [
    "StateConflictBody",
    "StateReadRequest",
    "StateReadResponse",
    "StateWriteRequest",
    "StateWriteResponse",
    "task_state_router",
]


def _bounded(value: dict[str, Any]) -> dict[str, Any]:
    size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))
    if size > MAX_OPERATOR_STATE_BYTES:
        raise ValueError(f"must be at most {MAX_OPERATOR_STATE_BYTES} bytes of JSON, got {size}")
    return value


OperatorState = Annotated[JsonObject, AfterValidator(_bounded)]
"""A JSON object of at most :data:`~trace_core.limits.MAX_OPERATOR_STATE_BYTES`."""
Version = Annotated[int, Field(strict=True, ge=1, le=MAX_BIGINT)]


class StateReadRequest(Request):
    """``POST /v1/task/state/read``: the state ``state_key`` of the token's job."""

    task_id: uuid.UUID
    attempt: Attempt
    state_key: Name = DEFAULT_STATE_KEY


class StateReadResponse(BaseModel):
    """The stored state and its version; both ``null`` when there is none yet."""

    state_key: str
    state: dict[str, Any] | None
    version: int | None


class StateWriteRequest(Request):
    """``POST /v1/task/state/write``: replace the state if its version is
    ``expected_version`` (required; ``null`` creates it, none may exist)."""

    task_id: uuid.UUID
    attempt: Attempt
    state_key: Name = DEFAULT_STATE_KEY
    state: OperatorState
    expected_version: Version | None


class StateWriteResponse(BaseModel):
    """The state was written; ``version`` is the one to name in the next write."""

    state_key: str
    version: int


class StateConflictBody(ErrorBody):
    """A 409 of a write: ``conflict`` (the stored version is not the expected
    one; ``null``: none stored, or "create" expected; re-read and try again),
    or ``stale`` (without the versions)."""

    expected_version: int | None = None
    actual_version: int | None = None


_WRITE_RESPONSES: dict[int | str, dict[str, Any]] = {
    409: answer_doc(
        "`stale`: the attempt does not hold the lease (finished, timed out or "
        "superseded); `conflict`: the stored version is not `expected_version`",
        StateConflictBody,
    )
}
_READ_RESPONSES: dict[int | str, dict[str, Any]] = {
    409: answer_doc(
        "`stale`: the attempt does not hold the lease (finished, timed out or superseded)"
    )
}


def task_state_router(dispatcher: Dispatcher) -> APIRouter:
    """The routes of the module docstring, on ``dispatcher.state``."""
    router = APIRouter(prefix="/v1/task/state", tags=["task"], responses=TASK_ERROR_RESPONSES)
    store = dispatcher.state

    @router.post("/read", responses=_READ_RESPONSES)
    async def read_state(request: StateReadRequest, claims: TaskCapability) -> StateReadResponse:
        """Read the operator state ``state_key`` of the token's job."""
        bind_capability(claims, request.task_id, request.attempt)
        found = await store.get_for_attempt(request.task_id, request.attempt, request.state_key)
        return StateReadResponse(
            state_key=request.state_key,
            state=None if found is None else found.state,
            version=None if found is None else found.version,
        )

    @router.post("/write", response_model=StateWriteResponse, responses=_WRITE_RESPONSES)
    async def write_state(
        request: StateWriteRequest, claims: TaskCapability
    ) -> StateWriteResponse | JSONResponse:
        """Write the operator state ``state_key`` of the token's job, compare-and-swap."""
        bind_capability(claims, request.task_id, request.attempt)
        try:
            written = await store.put_for_attempt(
                request.task_id,
                request.attempt,
                request.state,
                state_key=request.state_key,
                expected_version=request.expected_version,
            )
        except StateConflict as exc:
            body = StateConflictBody(
                error="conflict",
                reason=str(exc),
                field="expected_version",
                expected_version=exc.expected_version,
                actual_version=exc.actual_version,
            )
            return JSONResponse(body.model_dump(mode="json"), status_code=409)
        return StateWriteResponse(state_key=request.state_key, version=written.version)

    return router
