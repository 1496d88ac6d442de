"""The task-scoped endpoints (dispatcher.md "Task capability token issuance").

Called by task code with its attempt's capability token in
``X-Trace-Task-Capability`` (verified in front of routing by
:class:`~trace_core.api.capability.CapabilityAuth`); the internal token is
not accepted here.

==================================  ===================================  ================
route                               answer                               errors
==================================  ===================================  ================
``POST /v1/task/heartbeat``         as ``/internal/heartbeat`` (the      400, 404, 409
                                    header's token is the one renewed)
``POST /v1/task/complete``          as ``/internal/task-complete``       400, 404, 409
``POST /v1/task/events``            as ``/internal/events``              400, 404, 409
``POST /v1/task/buffer-publish``    200 ``{ok, dataset_uuid, records}``  400, 403, 404,
                                                                         409
``POST /v1/task/credentials``       200 short-lived S3 credentials       400, 404, 409
``POST /v1/task/state/read|write``  the job's operator state (routes in  400, 404, 409
                                    :mod:`~trace_core.api.task_state`)
==================================  ===================================  ================

Every route also answers 401 (token), 413 (body cap) and 503 (database, or
JWKS). Each body names ``task_id`` and ``attempt``; the token must be for
exactly that attempt (``wrong_task`` otherwise) and the attempt must still
be the task's latest (``superseded`` otherwise: a reclaim revokes the old
attempt's token at once, without waiting for it to expire). Buffer-publish
and credentials also need the attempt to be running (409 ``not_running``):
a finished attempt publishes nothing and gets no credentials.

Heartbeat and a ``Completed`` or ``Failed`` report read the task for that
rule only when their fenced write is refused: a write that passes has proven
more (the attempt is the latest and holds the lease), so the hot path is one
statement, and a refused one answers ``superseded`` exactly as if the read
had come first.

Buffer-publish accepts only the task's own outputs stored as Postgres tables
(403 ``not_an_output`` or ``not_buffered``); S3 outputs are written directly
with the credentials. Which datasets a task outputs is read once per task
from the state database (a task's outputs never change).

Credentials are minted for the token's :meth:`~trace_core.security.CapabilityClaims.scope`
for ``duration_seconds`` (900, STS's minimum, by default; at most 3600) and
answered with ``Cache-Control: no-store``; they are never logged.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Response

from trace_core.api.capability import CapabilityRefused, TaskCapability, bind_capability
from trace_core.api.errors import Conflict, Forbidden, answer_doc
from trace_core.api.internal import emit_task_events, heartbeat_task, report_task
from trace_core.api.models import (
    ErrorBody,
    EventsRequest,
    EventsResponse,
    HeartbeatResponse,
    TaskCompleteRequest,
    TaskCompleteResponse,
    TaskHeartbeatRequest,
)
from trace_core.api.task_models import (
    BufferPublishRequest,
    BufferPublishResponse,
    CapabilityErrorBody,
    CredentialsRequest,
    CredentialsResponse,
)
from trace_core.dispatcher.buffer import DatasetBuffer
from trace_core.dispatcher.service import Dispatcher
from trace_core.security.claims import POSTGRES_TABLE_SCHEME, CapabilityClaims
from trace_core.security.minting import CredentialMinter

__all__ = ["TASK_ERROR_RESPONSES", "check_current_attempt", "task_router"]

_OUTPUTS_CACHE = 4096  # tasks
T = TypeVar("T")


def _doc(description: str, model: type[ErrorBody] = ErrorBody) -> dict[str, Any]:
    return answer_doc(description, model)


TASK_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _doc("Malformed request; `field` names the culprit"),
    401: _doc(
        "Missing or refused capability token, or a token of another or a superseded attempt",
        CapabilityErrorBody,
    ),
    404: _doc("No such task"),
    409: _doc("Stale lease, a refused transition, or the attempt is not running"),
    413: _doc("Request body over the cap"),
    503: _doc("State database or JWKS unavailable; retry after `Retry-After` seconds"),
}
"""The error answers every task-scoped route can give (OpenAPI ``responses``)."""

_FORBIDDEN: dict[int | str, dict[str, Any]] = {
    403: _doc("The dataset is not one of the task's buffered (Postgres) outputs")
}


async def check_current_attempt(
    dispatcher: Dispatcher,
    claims: CapabilityClaims,
    task_id: uuid.UUID,
    attempt: int,
    *,
    running: bool = False,
) -> None:
    """The rule of every ``/v1/task`` route: the token is for this attempt
    (401 ``wrong_task``), which is the task's latest (401 ``superseded``: a
    reclaim revokes the old attempt's token at once) and, with ``running``,
    still running (409 ``not_running``)."""
    bind_capability(claims, task_id, attempt)
    state = await dispatcher.tasks.leases.inspect(task_id)
    if state.attempt != attempt:
        raise CapabilityRefused(
            "superseded", "a newer attempt of the task has started; this token is revoked"
        )
    if running and state.status != "Running":
        raise Conflict(
            "not_running", f"task {task_id} attempt {attempt} is {state.status}, not Running"
        )


def task_router(
    dispatcher: Dispatcher,
    *,
    minter: CredentialMinter | None = None,
    buffer: DatasetBuffer | None = None,
) -> APIRouter:
    """The routes of the module docstring; buffer-publish and credentials only
    with a ``buffer`` and a ``minter``."""
    router = APIRouter(prefix="/v1/task", tags=["task"], responses=TASK_ERROR_RESPONSES)
    outputs: dict[uuid.UUID, dict[uuid.UUID, str | None]] = {}

    async def current(
        claims: CapabilityClaims, task_id: uuid.UUID, attempt: int, *, running: bool = False
    ) -> None:
        await check_current_attempt(dispatcher, claims, task_id, attempt, running=running)

    async def fenced_first(
        claims: CapabilityClaims,
        task_id: uuid.UUID,
        attempt: int,
        write: Callable[[], Awaitable[T]],
    ) -> T:
        """``write()`` (a fenced write of ``attempt``) under :func:`check_current_attempt`'s
        rule, with the read of that rule only when the write is refused.

        The token is bound to the attempt first, as always. A fenced write that
        succeeds proves more than the read would (the attempt is the task's
        latest *and* holds the lease), so the read only decides what a refused
        one answers: 401 ``superseded`` when a newer attempt exists, as if it
        had run first, else the write's own error.
        """
        bind_capability(claims, task_id, attempt)
        try:
            return await write()
        except Exception:
            await check_current_attempt(dispatcher, claims, task_id, attempt)
            raise

    async def outputs_of(task_id: uuid.UUID) -> dict[uuid.UUID, str | None]:
        found = outputs.get(task_id)
        if found is None:
            payload = await dispatcher.control.fetch(task_id)
            found = {
                uuid.UUID(item["dataset_uuid"]): item.get("location")
                for item in payload.get("outputs", ())
            }
            if len(outputs) >= _OUTPUTS_CACHE:
                outputs.clear()
            outputs[task_id] = found
        return found

    @router.post("/heartbeat")
    async def heartbeat(request: TaskHeartbeatRequest, claims: TaskCapability) -> HeartbeatResponse:
        """Extend the attempt's lease (as ``/internal/heartbeat``); the answer's
        ``capability_token`` renews the header's token once it is due."""
        return await fenced_first(
            claims,
            request.task_id,
            request.attempt,
            lambda: heartbeat_task(dispatcher, request, claims=claims),
        )

    @router.post("/complete")
    async def complete(
        request: TaskCompleteRequest, claims: TaskCapability
    ) -> TaskCompleteResponse:
        """Report the attempt's outcome (as ``/internal/task-complete``)."""
        if request.status == "Canceled":
            # No fenced write: acknowledging a cancel is a read, refused first.
            await current(claims, request.task_id, request.attempt)
            return await report_task(dispatcher, request)
        return await fenced_first(
            claims, request.task_id, request.attempt, lambda: report_task(dispatcher, request)
        )

    @router.post("/events")
    async def events(request: EventsRequest, claims: TaskCapability) -> EventsResponse:
        """Emit mid-task events of the attempt (as ``/internal/events``)."""
        await current(claims, request.task_id, request.attempt)
        return await emit_task_events(dispatcher, request)

    if buffer is not None:
        sink = buffer

        @router.post("/buffer-publish", responses=_FORBIDDEN)
        async def buffer_publish(
            request: BufferPublishRequest, claims: TaskCapability
        ) -> BufferPublishResponse:
            """Publish records to one of the task's Postgres-table outputs, through
            the dataset buffer (a sink writes the table and emits the event)."""
            await current(claims, request.task_id, request.attempt, running=True)
            dataset = request.dataset_uuid
            mine = await outputs_of(request.task_id)
            if dataset not in mine:
                raise Forbidden(
                    "not_an_output", f"dataset {dataset} is not an output of task {request.task_id}"
                )
            location = mine[dataset]
            if location is None or not location.startswith(POSTGRES_TABLE_SCHEME):
                raise Forbidden(
                    "not_buffered",
                    f"output {dataset} is not a postgres_table dataset; "
                    "write S3 outputs with /v1/task/credentials",
                )
            await sink.publish(
                dataset,
                request.records,
                producer_task_id=request.task_id,
                attempt=request.attempt,
                schema_hash=request.schema_hash,
            )
            return BufferPublishResponse(
                ok=True, dataset_uuid=dataset, records=len(request.records)
            )

    if minter is not None:
        issuer = minter

        @router.post("/credentials")
        async def credentials(
            request: CredentialsRequest, claims: TaskCapability, response: Response
        ) -> CredentialsResponse:
            """Exchange the token for short-lived S3 credentials limited to its prefixes."""
            await current(claims, request.task_id, request.attempt, running=True)
            minted = await issuer.mint(
                claims.scope(),
                session_name=f"task-{request.task_id.hex}-{request.attempt}",
                duration_seconds=request.duration_seconds,
            )
            response.headers["Cache-Control"] = "no-store"
            return CredentialsResponse(
                access_key_id=minted.access_key_id,
                secret_access_key=minted.secret_access_key,
                session_token=minted.session_token,
                expiration=minted.expiration,
            )

    return router
