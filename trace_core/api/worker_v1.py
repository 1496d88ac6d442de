"""The v1 worker contract (worker-control-plane-v1.md) on Trace tasks.

A v1 *job* is a Trace task (``job_id`` = ``task_id``), an *attempt* one
execution of it, kept as a ``job_attempts`` record (``attempt_id`` names it
by its number, or by the record's UUID), a *stream* a worker queue (see
:mod:`trace_core.api.streams`). The database is the truth; the stream
message is transport, and ``ack`` tells the worker when it may drop it.

=====================================  ==========================================
route                                  answers
=====================================  ==========================================
``POST /internal/worker/claim``        200 ``{claimed: false}`` after the wait, or
                                       the lease + payload; 400 (unknown stream,
                                       ``max_wait_ms`` out of range)
``POST /internal/worker/heartbeat``    200 ``{ok, lease_expires_at, directive}``;
                                       404 unknown job or attempt; 409 stale,
                                       or another worker's attempt
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

The message (decision): complete and fail send back the ``stream`` and
``message_id`` their claim answered. When a stream message delivered the
attempt (its record names it), a report naming another one answers **409**
``{"ok": false, "ack": false, "error": "wrong_message"}`` and nothing changes:
it is a worker's bug, and acknowledging the named message could drop another
job's. Database-fallback and in-process claims answer an opaque
``message_id`` (no message exists); it is not checked.

The lease holder (decision): heartbeat, complete and fail name a
``worker_id``; another worker than the one the attempt was claimed by gets
**409** ``{"ok": false, "ack": false, "error": "wrong_worker"}`` and nothing
changes, whatever token it presents. ``ack`` is false: the message is the
holder's, whose own report decides it.

Records: the claim opens the attempt's record; completion closes it with
the result (everything but ``events``, which are stored as events), failure
with the structured ``error {code, message, stack, retryable}``, in the
transaction that writes the final status and releases the lease. ``requeued``
and ``dlq`` say what that transaction did (``retryable: false``, or an
exhausted retry budget, dead-letters through the retry policy).

Cost (the hot path): a heartbeat or a completion that names its attempt by
number is ONE fenced statement, which checks the worker and the stream
message in its own ``WHERE`` (:class:`~trace_core.model.Holder`). Only when
that write is refused does the route take the checked path (read the
attempt's record, check it, write again), whose refusal says precisely why,
with the same answers as ever. Answers are serialized once by their model
(no second validation pass by the framework).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from trace_core.api.errors import ERROR_RESPONSES, answer_doc
from trace_core.api.internal import to_events
from trace_core.api.models import WorkerRefusal
from trace_core.api.reports import (
    NotLeaseHolder,
    WrongMessage,
    check_message,
    complete_attempt,
    complete_held,
    fail_attempt,
    holder_attempt,
)
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
from trace_core.model import Fence, Holder

__all__ = ["worker_router"]

T = TypeVar("T")

_REFUSALS: dict[int | str, dict[str, Any]] = {
    404: answer_doc("No such job", WorkerRefusal),
    409: answer_doc(
        "Stale attempt or lease, a contradicting report, another worker's attempt, "
        "or another stream message than the attempt's",
        WorkerRefusal,
    ),
}


def _refusal(status: int, error: str, exc: Exception, *, ack: bool = True) -> JSONResponse:
    body = WorkerRefusal(ack=ack, error=error, reason=str(exc))
    return JSONResponse(body.model_dump(mode="json"), status_code=status)


def _refused(exc: Exception) -> JSONResponse:
    """The answer to a report refused by the database's state (module docstring)."""
    if isinstance(exc, NotFound):
        return _refusal(404, "not_found", exc)
    if isinstance(exc, NotLeaseHolder):
        # Not this worker's message to acknowledge: the holder's report decides.
        return _refusal(409, "wrong_worker", exc, ack=False)
    if isinstance(exc, WrongMessage):
        # The named message did not deliver this attempt: nothing says it may go.
        return _refusal(409, "wrong_message", exc, ack=False)
    if isinstance(exc, StaleClaim):
        return _refusal(409, "stale", exc)
    return _refusal(409, "invalid_transition", exc)


_REFUSED = (NotFound, StaleClaim, InvalidTransition)


def _answer(body: BaseModel) -> Response:
    """``body`` as JSON, serialized once by its own model: FastAPI would
    validate a returned model again against the route's response model."""
    return Response(body.model_dump_json(), media_type="application/json")


async def _unless_refused(write: Awaitable[T]) -> T | None:
    """``write``'s result, or ``None`` when the database refused it (the
    caller then takes the checked path, which says why)."""
    try:
        return await write
    except _REFUSED:
        return None


def worker_router(dispatcher: Dispatcher, claimer: StreamClaimer, *, max_wait_ms: int) -> APIRouter:
    """The routes of the module docstring; claims wait at most ``max_wait_ms``."""
    router = APIRouter(prefix="/internal/worker", tags=["worker v1"], responses=ERROR_RESPONSES)
    control = dispatcher.control

    @router.post("/claim", response_model=WorkerClaimResponse)
    async def claim(request: WorkerClaimRequest) -> Any:
        """Claim the next job of the first stream (in priority order) that has
        one, long-polling up to ``max_wait_ms``."""
        if request.max_wait_ms > max_wait_ms:
            raise InvalidInput("max_wait_ms", f"must be <= {max_wait_ms} on this server")
        found = await claimer.claim(
            request.worker_id, request.streams, max_wait=request.max_wait_ms / 1000
        )
        if found is None:
            return _answer(WorkerClaimResponse(claimed=False))
        lease = found.claimed.outcome.lease
        assert lease is not None
        ttl = max(0.0, (lease.expires_at - dispatcher.clock.now()).total_seconds())
        job_id = lease.item_id
        assert isinstance(job_id, uuid.UUID)  # task ids are UUIDs
        answer = WorkerClaimResponse.model_construct(
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
        return _answer(answer)

    @router.post("/heartbeat", responses=_REFUSALS, response_model=WorkerHeartbeatResponse)
    async def heartbeat(request: WorkerHeartbeatRequest) -> Any:
        """Extend the lease the token names (of ``attempt_id``, if given), for
        the worker the attempt was claimed by."""
        job_id, attempt = request.job_id, request.attempt_id
        try:
            expires = None
            if isinstance(attempt, int):
                fence = Fence(job_id, attempt, request.lease_token)
                holder = Holder(request.worker_id)
                expires = await _unless_refused(control.heartbeat(fence, holder=holder))
            if expires is None:
                held = await holder_attempt(dispatcher, job_id, attempt, request.worker_id)
                fence = Fence(job_id, held.number, request.lease_token)
                expires = await control.heartbeat(fence)
        except _REFUSED as exc:
            return _refused(exc)
        directive = await control.directive(job_id)
        return _answer(
            WorkerHeartbeatResponse(ok=True, lease_expires_at=expires, directive=directive)
        )

    @router.post("/complete", responses=_REFUSALS, response_model=WorkerAck)
    async def complete(request: WorkerCompleteRequest) -> Any:
        """Commit the result (final ``events`` and ``outputs``, the rest kept on
        the attempt's record) and complete the job."""
        events = to_events(request.result.events, "result.events")
        outputs, kept = request.result.outputs, request.result.kept()
        job_id, attempt = request.job_id, request.attempt_id
        try:
            done = None
            if isinstance(attempt, int):
                holder = Holder(request.worker_id, request.stream, request.message_id)
                fence = Fence(job_id, attempt, request.lease_token)
                done = await _unless_refused(
                    complete_held(
                        dispatcher, fence, holder, events=events, outputs=outputs, result=kept
                    )
                )
            if done is None:
                held = await holder_attempt(dispatcher, job_id, attempt, request.worker_id)
                check_message(held, request.stream, request.message_id)
                fence = Fence(job_id, held.number, request.lease_token)
                done = await complete_attempt(
                    dispatcher,
                    fence,
                    events=events,
                    outputs=outputs,
                    result=kept,
                    record=held.record,
                )
        except _REFUSED as exc:
            return _refused(exc)
        return _answer(WorkerAck(ok=True, ack=True, duplicate=done.duplicate))

    @router.post("/fail", responses=_REFUSALS, response_model=WorkerFailResponse)
    async def fail(request: WorkerFailRequest) -> Any:
        """Fail the attempt: requeued (a retry is scheduled) or dead-lettered;
        the error is kept structured on the attempt's record."""
        error = request.error
        try:
            held = await holder_attempt(
                dispatcher, request.job_id, request.attempt_id, request.worker_id
            )
            check_message(held, request.stream, request.message_id)
            fence = Fence(request.job_id, held.number, request.lease_token)
            failed = await fail_attempt(
                dispatcher,
                fence,
                f"{error.code}: {error.message}",
                retryable=error.retryable,
                detail=error.model_dump(mode="json"),
                record=held.record,
            )
        except _REFUSED as exc:
            return _refused(exc)
        return WorkerFailResponse(
            ok=True,
            ack=True,
            requeued=failed.retrying,
            dlq=not failed.retrying,
            duplicate=failed.duplicate,
        )

    return router
