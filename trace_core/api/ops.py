"""Operations: explain a job, scrape metrics, trigger a manual source.

=============================  ==============================================
route                          answers
=============================  ==============================================
``GET /internal/explain``      200 the explanation of ``dag``/``job`` (of
                               ``org``, default ``default``); 404 no such job
``GET /internal/metrics``      200 Prometheus text, ``text/plain;
                               version=0.0.4``
``POST /internal/trigger``     200 ``{job, key}``: the manual task
                               (``created``, or ``refused`` under
                               backpressure); ``{events}``: the accepted
                               manual events; 400 (neither or both, not a
                               manual source, ambiguous name); 404 no such job
=============================  ==============================================
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import PlainTextResponse

from trace_core.api.errors import ERROR_RESPONSES
from trace_core.api.fields import Name
from trace_core.api.internal import to_events
from trace_core.api.models import ErrorBody, TriggerRequest, TriggerResponse
from trace_core.dispatcher.explain import Explanation
from trace_core.dispatcher.metrics import CONTENT_TYPE
from trace_core.dispatcher.service import Dispatcher
from trace_core.errors import ConfigurationError, InvalidInput

__all__ = ["ops_router"]

_NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorBody, "description": "No such job"}
}


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
