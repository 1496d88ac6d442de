"""Operations: explain a job, scrape metrics, trigger a manual source, health.

=============================  ==============================================
route                          answers
=============================  ==============================================
``GET /internal/explain``      200 the explanation of ``dag``/``job`` (of
                               ``org``, default ``default``); 404 no such job
``GET /internal/metrics``      200 Prometheus text, ``text/plain;
                               version=0.0.4``
``POST /internal/pause``       200 ``{dag, job, org?, by}``: pause the live
                               job by hand (as ``POST /v1/dags/{dag}/jobs/
                               {job}/pause``); 404 no such job
``POST /internal/resume``      200 the same body: lift only a manual pause
``POST /internal/trigger``     200 ``{job, key}``: the manual task
                               (``created``, or ``refused`` under
                               backpressure); ``{events}``: the accepted
                               manual events; 400 (neither or both, not a
                               manual source, ambiguous name); 404 no such job
``GET /healthz``               200 ``{"status": "alive"}``: liveness. The
                               process serves requests; it reads no database,
                               so an outage does not make an orchestrator
                               restart a server that will recover by itself.
``GET /readyz``                200 ready, else 503 with ``Retry-After``:
                               readiness. The state database answers a
                               ``SELECT 1`` and, when the app runs the
                               Dispatcher, every service loop runs and its
                               last round succeeded; the body gives
                               ``database`` and each service's state
=============================  ==============================================

Why both, and why a service failure is a readiness matter: no service loop
of the Dispatcher ends on an error (each backs off and carries on by itself,
:class:`~trace_core.outage.LoopHealth`), so a process is never left serving
HTTP with a dead Dispatcher behind it; a loop that keeps failing shows in
``/readyz`` (``healthy: false``, ``failures``, the type of ``last_error``;
the message is in the log, not in the answer). Both routes are behind the
internal token like every other (a probe sends the header).
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse, PlainTextResponse

from trace_core.api.errors import ERROR_RESPONSES, answer_doc
from trace_core.api.fields import Name
from trace_core.api.internal import to_events
from trace_core.api.models import PauseRequest, TriggerRequest, TriggerResponse
from trace_core.api.people_data_models import PauseOut
from trace_core.dispatcher.explain import Explanation
from trace_core.dispatcher.metrics import CONTENT_TYPE
from trace_core.dispatcher.service import Dispatcher
from trace_core.errors import ConfigurationError, DatabaseUnavailable, InvalidInput

__all__ = ["health_router", "ops_router"]

_NOT_FOUND: dict[int | str, dict[str, Any]] = {404: answer_doc("No such job")}


class _Metrics(PlainTextResponse):
    media_type = CONTENT_TYPE


def ops_router(dispatcher: Dispatcher) -> APIRouter:
    """The routes of the module docstring, on ``dispatcher``."""
    router = APIRouter(prefix="/internal", tags=["ops"], responses=ERROR_RESPONSES)

    @router.get("/explain", responses=_NOT_FOUND)
    async def explain(
        dag: Annotated[Name, Query()],
        job: Annotated[Name, Query()],
        org: Annotated[Name, Query()] = "default",
    ) -> Explanation:
        """Why ``dag/job`` did or did not run (its live version, else the newest).

        The answer is the :class:`~trace_core.dispatcher.explain.Explanation`
        itself: FastAPI validates and documents the dataclass as it is.
        """
        return await dispatcher.explain(dag, job, org_slug=org)

    @router.get(
        "/metrics",
        response_class=_Metrics,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    async def metrics() -> _Metrics:
        """Queue depth and age, pauses and in-flight counts (Prometheus text 0.0.4)."""
        return _Metrics(await dispatcher.metrics())

    async def pause_or_resume(request: PauseRequest, *, pause: bool) -> PauseOut:
        pauses = dispatcher.pauses
        job_ids = await pauses.live_job_ids(request.org, request.dag, request.job)
        act = pauses.pause if pause else pauses.resume
        changes = await act(job_ids, by=request.by)
        return PauseOut.of(request.dag, request.job, changes)

    @router.post("/pause", response_model=PauseOut, responses=_NOT_FOUND)
    async def pause(request: PauseRequest) -> PauseOut:
        """Pause the live job by hand: no new task until it is resumed; backpressure
        never lifts this pause."""
        return await pause_or_resume(request, pause=True)

    @router.post("/resume", response_model=PauseOut, responses=_NOT_FOUND)
    async def resume(request: PauseRequest) -> PauseOut:
        """Lift the job's manual pause; a pause by backpressure stays."""
        return await pause_or_resume(request, pause=False)

    @router.post("/trigger", responses=_NOT_FOUND)
    async def trigger(request: TriggerRequest) -> TriggerResponse:
        """Start a manual source's task for ``key`` (the same key, the same task)
        or emit manual ``events`` (routed like a worker's)."""
        by_key = request.job is not None or request.key is not None
        if by_key == (request.events is not None):
            raise InvalidInput("body", "give either 'job' and 'key', or 'events'")
        if request.events is not None:
            accepted = await dispatcher.manual.emit(to_events(request.events, "events"))
            return TriggerResponse(
                event_ids=accepted.event_ids, new=accepted.new, duplicates=accepted.duplicates
            )
        if request.job is None:
            raise InvalidInput("job", "is required with 'key'")
        if request.key is None:
            raise InvalidInput("key", "is required with 'job'")
        job: str | uuid.UUID = request.job
        with contextlib.suppress(ValueError):  # else a name, or dag/name
            job = uuid.UUID(request.job)
        try:
            run = await dispatcher.manual.create_task(job, request.key)
        except InvalidInput:
            raise
        except ConfigurationError as exc:
            raise InvalidInput("job", str(exc)) from None
        return TriggerResponse(
            job_id=run.job_id, task_id=run.task_id, created=run.created, refused=run.refused
        )

    return router


def health_router(
    dispatcher: Dispatcher, *, services_required: bool, retry_after_seconds: int
) -> APIRouter:
    """``/healthz`` and ``/readyz`` (the module docstring) on ``dispatcher``.

    ``services_required``: the app runs the Dispatcher's services, so
    readiness requires them; otherwise they are reported only.
    """
    router = APIRouter(tags=["health"], responses=ERROR_RESPONSES)

    @router.get("/healthz")
    async def healthz() -> dict[str, str]:
        """Liveness: the process answers (no database read)."""
        return {"status": "alive"}

    @router.get(
        "/readyz",
        responses={503: {"description": "Not ready: database down or a service failing"}},
    )
    async def readyz() -> JSONResponse:
        """Readiness: the database answers and the Dispatcher's services run."""
        try:
            await dispatcher.repo.ping()
            database = "ok"
        except DatabaseUnavailable:
            database = "unavailable"
        services = {
            name: {**state, "last_error": _error_type(state["last_error"])}
            for name, state in dispatcher.health().items()
        }
        ready = database == "ok" and (
            not services_required or all(state["healthy"] for state in services.values())
        )
        body = {
            "status": "ready" if ready else "not_ready",
            "database": database,
            "services": services,
        }
        headers = None if ready else {"Retry-After": str(retry_after_seconds)}
        return JSONResponse(body, status_code=200 if ready else 503, headers=headers)

    return router


def _error_type(last_error: str | None) -> str | None:
    """Only the exception's type: its message may name hosts and paths."""
    return None if last_error is None else last_error.partition(":")[0]
