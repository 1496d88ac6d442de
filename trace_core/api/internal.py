"""The internal task endpoints (interface-contracts.md, "Worker -> Dispatcher").

=================================  =====================================  ==============
route                              answer                                 errors
=================================  =====================================  ==============
``POST /internal/task-claim``      200 ``Claimed`` (lease + payload) or   400
                                   200 ``NotClaimed`` with the reason
``GET /internal/task-fetch``       200 payload (with ``status``)          400, 404
``POST /internal/heartbeat``       200 ``{ok, lease_expires_at,           400, 404, 409
                                   directive}``
``POST /internal/task-complete``   200 ``{ok, status, duplicate, ...}``   400, 404, 409
``POST /internal/events``          200 ``{ok, event_ids, new,             400, 409
                                   duplicates}``
``GET /internal/jwks/task``        200 the JWKS document
=================================  =====================================  ==============

Every route also answers 401 (token), 413 (body cap) and 503 (database).

A heartbeat that presents the attempt's capability token gets a renewed one
(``capability_token``) once the presented one has less than the issuer's
refresh fraction of its lifetime left; the renewal happens only after the
fenced lease extension succeeded, so a stale attempt gets its 409 and nothing
else.
The handlers only translate: the semantics live in
:class:`~trace_core.dispatcher.control.TaskControl` and
:mod:`trace_core.api.reports`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from typing import Annotated, Any

from fastapi import APIRouter, Query

from trace_core.api.errors import ERROR_RESPONSES, Conflict, answer_doc
from trace_core.api.models import (
    EventIn,
    EventsRequest,
    EventsResponse,
    HeartbeatRequest,
    HeartbeatResponse,
    JwksDocument,
    TaskClaimed,
    TaskClaimRequest,
    TaskClaimResponse,
    TaskCompleteRequest,
    TaskCompleteResponse,
    TaskHeartbeatRequest,
    TaskNotClaimed,
)
from trace_core.api.reports import complete_attempt, fail_attempt
from trace_core.authoring.events import DatasetEvent, parse_events
from trace_core.dispatcher.service import Dispatcher
from trace_core.errors import InvalidInput
from trace_core.model import Fence
from trace_core.security.claims import CapabilityClaims

__all__ = [
    "emit_task_events",
    "heartbeat_task",
    "internal_router",
    "report_task",
    "to_events",
]

_NOT_FOUND: dict[int | str, dict[str, Any]] = {404: answer_doc("No such task")}
_STALE: dict[int | str, dict[str, Any]] = {
    409: answer_doc("Stale attempt or lease, or a refused transition")
}


def to_events(events: list[EventIn], field: str) -> list[DatasetEvent]:
    """Validated request events as core events; semantic errors name ``field[i]``."""
    if not events:
        return []
    return parse_events([e.model_dump(mode="json", exclude_none=True) for e in events], field)


def _only_completed_carries_results(request: TaskCompleteRequest) -> None:
    if request.events:
        raise InvalidInput("events", f"a {request.status} report carries no final events")
    if request.outputs:
        raise InvalidInput("outputs", f"a {request.status} report carries no outputs")


def internal_router(
    dispatcher: Dispatcher, *, jwks: Callable[[], Mapping[str, Any]] | None = None
) -> APIRouter:
    """The routes of the module docstring, on ``dispatcher``."""
    router = APIRouter(prefix="/internal", tags=["tasks"], responses=ERROR_RESPONSES)
    control = dispatcher.control

    @router.post("/task-claim", response_model=TaskClaimResponse)
    async def task_claim(request: TaskClaimRequest) -> TaskClaimed | TaskNotClaimed:
        """Claim a task: a lease on its next attempt and the full payload.

        Not claimed (with the reason) is a normal answer: the worker must not
        run the task and should drop its wake-up.
        """
        claimed = await control.claim(request.task_id, request.worker_id)
        lease = claimed.outcome.lease
        if lease is None or claimed.task is None:
            reason = claimed.outcome.reason
            return TaskNotClaimed(reason=str(reason.value) if reason else "NotReady")
        return TaskClaimed(
            attempt=lease.attempt,
            lease_token=lease.lease_token,
            lease_expires_at=lease.expires_at,
            task=claimed.task,
        )

    @router.get("/task-fetch", responses=_NOT_FOUND)
    async def task_fetch(task_id: Annotated[uuid.UUID, Query()]) -> dict[str, Any]:
        """The task's full payload, read-only (``status`` may say ``Canceled``)."""
        return await control.fetch(task_id)

    @router.post("/heartbeat", responses=_NOT_FOUND | _STALE)
    async def heartbeat(request: HeartbeatRequest) -> HeartbeatResponse:
        """Extend the current attempt's lease; 409 for a stale attempt or lease."""
        return await heartbeat_task(dispatcher, request)

    @router.post("/task-complete", responses=_NOT_FOUND | _STALE)
    async def task_complete(request: TaskCompleteRequest) -> TaskCompleteResponse:
        """Report the attempt's outcome.

        ``Completed``: the final events and the completion commit together.
        ``Failed``: a retry with backoff (``retryable``, the default) or a
        terminal failure. ``Canceled``: the wrapper acknowledges a canceled
        task it did not run; 409 if the task is not canceled. A repeated
        report of the same attempt is answered ``duplicate: true``.
        """
        return await report_task(dispatcher, request)

    @router.post("/events", responses=_STALE)
    async def events(request: EventsRequest) -> EventsResponse:
        """Accept mid-task events of the task's current attempt (at-least-once:
        redeliveries are counted, not stored twice)."""
        return await emit_task_events(dispatcher, request)

    @router.get("/jwks/task", tags=["keys"])
    async def jwks_task() -> JwksDocument:
        """The public keys that verify task capability tokens (cache; refresh on
        an unknown ``kid``)."""
        document = dict(jwks()) if jwks is not None else {"keys": []}
        return JwksDocument.model_validate(document)

    return router


async def heartbeat_task(
    dispatcher: Dispatcher,
    request: TaskHeartbeatRequest,
    *,
    claims: CapabilityClaims | None = None,
) -> HeartbeatResponse:
    """Extend the attempt's lease (:class:`StaleClaim` if it is not current), say
    what a source should do and renew the attempt's capability token when due:
    the one the request presents (``capability_token``), or ``claims`` verified
    already (a task-scoped call's header)."""
    control = dispatcher.control
    fence = Fence(request.task_id, request.attempt, request.lease_token)
    expires = await control.heartbeat(fence)
    directive = await control.directive(request.task_id)
    # Only now, with the fence passed: the caller holds the current lease.
    if claims is not None:
        renewed = await control.renew_capability(claims)
    elif isinstance(request, HeartbeatRequest) and request.capability_token:
        renewed = await control.refresh_capability(
            request.task_id, request.attempt, request.capability_token
        )
    else:
        renewed = None
    return HeartbeatResponse(
        ok=True, lease_expires_at=expires, directive=directive, capability_token=renewed
    )


async def report_task(dispatcher: Dispatcher, request: TaskCompleteRequest) -> TaskCompleteResponse:
    """Record an attempt's reported outcome (see ``POST /internal/task-complete``)."""
    if request.status == "Canceled":
        return await _acknowledge_cancel(dispatcher, request)
    if request.lease_token is None:
        raise InvalidInput("lease_token", f"is required for status {request.status}")
    fence = Fence(request.task_id, request.attempt, request.lease_token)
    if request.status == "Completed":
        events = to_events(request.events, "events")
        done = await complete_attempt(dispatcher, fence, events=events, outputs=request.outputs)
        return TaskCompleteResponse(
            ok=True,
            task_id=request.task_id,
            status="Completed",
            duplicate=done.duplicate,
            event_ids=done.event_ids,
        )
    _only_completed_carries_results(request)
    failed = await fail_attempt(
        dispatcher,
        fence,
        request.error_message or "failed (no error message)",
        retryable=request.retryable,
    )
    return TaskCompleteResponse(
        ok=True,
        task_id=request.task_id,
        status=failed.status,
        duplicate=failed.duplicate,
        retrying=failed.retrying,
    )


async def _acknowledge_cancel(
    dispatcher: Dispatcher, request: TaskCompleteRequest
) -> TaskCompleteResponse:
    _only_completed_carries_results(request)
    state = await dispatcher.tasks.leases.inspect(request.task_id)
    if state.status != "Canceled":
        raise Conflict(
            "not_canceled",
            f"task {request.task_id} is {state.status}, not Canceled: nothing to acknowledge",
        )
    return TaskCompleteResponse(ok=True, task_id=request.task_id, status="Canceled")


async def emit_task_events(dispatcher: Dispatcher, request: EventsRequest) -> EventsResponse:
    """Accept mid-task events of the task's current attempt."""
    accepted = await dispatcher.control.emit(
        request.task_id, request.attempt, to_events(request.events, "events")
    )
    return EventsResponse(
        ok=True, event_ids=accepted.event_ids, new=accepted.new, duplicates=accepted.duplicates
    )
