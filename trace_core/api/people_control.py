"""People's control routes under ``/v1``: pause and resume a job, rematerialize a dataset.

Authorized like the other data routes (:mod:`trace_core.api.people_data`,
under its :data:`~trace_core.api.people_data.DATA_PREFIXES`): a writer's
bearer JWT. A reader's request is 403 before anything is read or changed; a
job or dataset the caller may not see answers 404 exactly like a missing one.

==============================================  ======  ==============================
route                                           needs   does
==============================================  ======  ==============================
``POST /v1/dags/{dag}/jobs/{job}/pause``        write   pause the live job by hand
``POST /v1/dags/{dag}/jobs/{job}/resume``       write   lift that manual pause only
``POST /v1/datasets/{name}/rematerialize``      write   rebuild the dataset (a deploy)
==============================================  ======  ==============================

The pause is :class:`~trace_core.dispatcher.manual_pause.ManualPause`'s (the
rule is there: backpressure never lifts it, a resume lifts nothing else). A
rematerialization is the producer DAG's newest live YAML with a fresh
``rematerialize`` token on the producing job
(:func:`~trace_core.dag.rematerialize.with_rematerialization`), deployed
through the very path of ``POST /v1/dags``
(:func:`~trace_core.api.people_data.deploy_yaml`).
"""

from __future__ import annotations

from fastapi import APIRouter

from trace_core.api.errors import ERROR_RESPONSES
from trace_core.api.people import Who
from trace_core.api.people_data import MISSING, WRITER, deploy_yaml, need_write
from trace_core.api.people_data_models import PauseOut, RematerializeOut
from trace_core.dag.rematerialize import with_rematerialization
from trace_core.dispatcher.service import Dispatcher
from trace_core.errors import ConfigurationError, InvalidInput
from trace_core.people.access import Caller
from trace_core.people.catalog import PeopleCatalog

__all__ = ["people_control_router"]


def _person(who: Caller) -> str:
    """Who a manual pause names: the user's email, else their IdP subject."""
    return who.email or who.external_id


def people_control_router(dispatcher: Dispatcher, catalog: PeopleCatalog) -> APIRouter:
    """The routes of the module docstring."""
    router = APIRouter(prefix="/v1", tags=["people data"], responses=ERROR_RESPONSES)

    @router.post(
        "/dags/{dag}/jobs/{job}/pause", response_model=PauseOut, responses=WRITER | MISSING
    )
    async def pause(who: Who, dag: str, job: str) -> PauseOut:
        """Pause the job by hand (writer): it gets no new task until a person
        resumes it; backpressure never lifts this pause."""
        need_write(who)
        job_ids = await catalog.live_jobs(who, dag, job)
        return PauseOut.of(dag, job, await dispatcher.pauses.pause(job_ids, by=_person(who)))

    @router.post(
        "/dags/{dag}/jobs/{job}/resume", response_model=PauseOut, responses=WRITER | MISSING
    )
    async def resume(who: Who, dag: str, job: str) -> PauseOut:
        """Lift the job's manual pause (writer); a pause by backpressure stays."""
        need_write(who)
        job_ids = await catalog.live_jobs(who, dag, job)
        return PauseOut.of(dag, job, await dispatcher.pauses.resume(job_ids, by=_person(who)))

    @router.post(
        "/datasets/{name}/rematerialize",
        response_model=RematerializeOut,
        responses=WRITER | MISSING,
    )
    async def rematerialize(who: Who, name: str) -> RematerializeOut:
        """Rebuild the dataset (writer): its producer and everything downstream get
        new versions, built beside the current ones and swapped in once caught up."""
        need_write(who)
        dag, text = await catalog.producer_yaml(who, name)
        token = dispatcher.clock.now().strftime("%Y%m%dT%H%M%S.%fZ")
        try:
            rebuilt = with_rematerialization(text, name, token)
        except ConfigurationError:
            # The DAG's newest live version (one being built) no longer produces it.
            raise InvalidInput("name", f"no live version of DAG {dag!r} produces it") from None
        done = await deploy_yaml(dispatcher, catalog, who, rebuilt)
        return RematerializeOut(dataset=name, **done.model_dump())

    return router
