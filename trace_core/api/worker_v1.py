"""The v1 worker contract (worker-control-plane-v1.md) on Trace tasks.

A v1 *job* is a Trace task (``job_id`` = ``task_id``), an *attempt* its
attempt number (``attempt_id``), a *stream* a worker queue (see
:mod:`trace_core.api.streams`). The database is the truth; the stream
message is transport, and ``ack`` tells the worker when it may drop it.

=====================================  ==========================================
route                                  answers
=====================================  ==========================================
``POST /internal/worker/claim``        200 ``{claimed: false}`` after the wait, or
                                       the lease + payload; 400 (unknown stream,
                                       ``max_wait_ms`` out of range)
``POST /internal/worker/heartbeat``    200 ``{ok, lease_expires_at, directive}``;
                                       404 unknown job; 409 stale
``POST /internal/worker/complete``     200 ``{ok, ack, duplicate}``; 404; 409
``POST /internal/worker/fail``         200 ``{ok, ack, requeued, dlq,
                                       duplicate}``; 404; 409
=====================================  ==========================================

Idempotency: complete and fail are idempotent by ``(job_id, attempt_id)``
and guarded by ``lease_token``. Repeating the report that was recorded
answers 200 with ``duplicate: true`` and changes nothing.

Stale reports (decision): an attempt that is no longer current (a newer
attempt claimed the job, or it was canceled) answers **409**
``{"ok": false, "ack": true, "error": "stale"}`` and changes nothing. ``ack``
is true: the job's fate belongs to the newer attempt (which has its own
message) or is final, so redelivering this message could only be refused
again. A report that contradicts the recorded outcome of the same attempt
(fail after complete) answers 409 ``invalid_transition``, also with
``ack: true``. An unknown job answers 404 with ``ack: true``. A malformed
request (400) carries no ``ack``: the worker must fix the call; the lease
expires and the reaper retries the job meanwhile.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from trace_core.api.errors import ERROR_RESPONSES, answer_doc
from trace_core.api.internal import to_events
from trace_core.api.models import WorkerRefusal
from trace_core.api.reports import complete_attempt, fail_attempt
from trace_core.api.streams import StreamClaimer
from trace_core.api.worker_models import (
    WorkerAck,
    WorkerClaimRequest,
    WorkerClaimResponse,
    WorkerCompleteRequest,
    WorkerFailRequest,
    WorkerFailResponse,
    WorkerHeartbeatRequest,
    WorkerHeartbeatResponse,
)
from trace_core.dispatcher.service import Dispatcher
from trace_core.errors import InvalidInput, InvalidTransition, NotFound, StaleClaim
from trace_core.model import Fence

__all__ = ["worker_router"]

_REFUSALS: dict[int | str, dict[str, Any]] = {
    404: answer_doc("No such job", WorkerRefusal),
    409: answer_doc("Stale attempt or lease, or a contradicting report", WorkerRefusal),
}


def _refusal(status: int, error: str, exc: Exception) -> JSONResponse:
    body = WorkerRefusal(ack=True, error=error, reason=str(exc))
    return JSONResponse(body.model_dump(mode="json"), status_code=status)


def worker_router(dispatcher: Dispatcher, claimer: StreamClaimer, *, max_wait_ms: int) -> APIRouter:
    """The routes of the module docstring; claims wait at most ``max_wait_ms``."""
    router = APIRouter(prefix="/internal/worker", tags=["worker v1"], responses=ERROR_RESPONSES)
    control = dispatcher.control

    @router.post("/claim")
    async def claim(request: WorkerClaimRequest) -> WorkerClaimResponse:
        """Claim the next job of the first stream (in priority order) that has
        one, long-polling up to ``max_wait_ms``."""
        if request.max_wait_ms > max_wait_ms:
            raise InvalidInput("max_wait_ms", f"must be <= {max_wait_ms} on this server")
        found = await claimer.claim(
            request.worker_id, request.streams, max_wait=request.max_wait_ms / 1000
        )
        if found is None:
            return WorkerClaimResponse(claimed=False)
        lease = found.claimed.outcome.lease
        assert lease is not None
        ttl = max(0.0, (lease.expires_at - dispatcher.clock.now()).total_seconds())
        job_id = lease.item_id
        assert isinstance(job_id, uuid.UUID)  # task ids are UUIDs
        return WorkerClaimResponse(
            claimed=True,
            job_id=job_id,
            attempt_id=lease.attempt,
            lease_token=lease.lease_token,
            lease_expires_at=lease.expires_at,
            stream=found.stream,
            # The transport's own id; a database-fallback claim has no message.
            message_id=found.message_id or f"{found.source}-{job_id}-{lease.attempt}",
            source=found.source,
            payload=found.claimed.task,
            lease_ttl_seconds=ttl,
            heartbeat_interval_seconds=ttl / 3,
        )

    @router.post("/heartbeat", responses=_REFUSALS, response_model=WorkerHeartbeatResponse)
    async def heartbeat(request: WorkerHeartbeatRequest) -> Any:
        """Extend the lease the token names (of ``attempt_id``, if given)."""
        try:
            attempt = request.attempt_id
            if attempt is None:
                attempt = (await dispatcher.tasks.leases.inspect(request.job_id)).attempt
            fence = Fence(request.job_id, attempt, request.lease_token)
            expires = await control.heartbeat(fence)
        except NotFound as exc:
            return _refusal(404, "not_found", exc)
        except StaleClaim as exc:
            return _refusal(409, "stale", exc)
        directive = await control.directive(request.job_id)
        return WorkerHeartbeatResponse(ok=True, lease_expires_at=expires, directive=directive)

    @router.post("/complete", responses=_REFUSALS, response_model=WorkerAck)
    async def complete(request: WorkerCompleteRequest) -> Any:
        """Commit the result (final ``events`` and ``outputs``) and complete the job."""
        fence = Fence(request.job_id, request.attempt_id, request.lease_token)
        events = to_events(request.result.events, "result.events")
        try:
            done = await complete_attempt(
                dispatcher, fence, events=events, outputs=request.result.outputs
            )
        except NotFound as exc:
            return _refusal(404, "not_found", exc)
        except StaleClaim as exc:
            return _refusal(409, "stale", exc)
        except InvalidTransition as exc:
            return _refusal(409, "invalid_transition", exc)
        return WorkerAck(ok=True, ack=True, duplicate=done.duplicate)

    @router.post("/fail", responses=_REFUSALS, response_model=WorkerFailResponse)
    async def fail(request: WorkerFailRequest) -> Any:
        """Fail the attempt: requeued (a retry is scheduled) or dead-lettered."""
        fence = Fence(request.job_id, request.attempt_id, request.lease_token)
        error = request.error
        text = f"{error.code}: {error.message}"
        if error.stack:
            text += f"\n{error.stack}"
        try:
            failed = await fail_attempt(dispatcher, fence, text, retryable=error.retryable)
        except NotFound as exc:
            return _refusal(404, "not_found", exc)
        except StaleClaim as exc:
            return _refusal(409, "stale", exc)
        except InvalidTransition as exc:
            return _refusal(409, "invalid_transition", exc)
        return WorkerFailResponse(
            ok=True,
            ack=True,
            requeued=failed.retrying,
            dlq=not failed.retrying,
            duplicate=failed.duplicate,
        )

    return router
