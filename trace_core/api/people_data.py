"""People's data routes under ``/v1``: DAGs, datasets, tasks, explain, lineage, queries.

Authorized like the other people routes (:mod:`trace_core.api.people`): a
person's bearer JWT, checked by :class:`~trace_core.api.people.PeopleAuth`
for the prefixes :data:`DATA_PREFIXES`; the internal token does not open them.

======================================  ========  ====================================
route                                   needs     answers
======================================  ========  ====================================
``GET /v1/dags``                        read      the org's DAGs
``GET /v1/dags/{dag}``                  read      its versions (visible datasets only)
``POST /v1/dags``                       write     deploy ``{yaml}`` into the org
``POST /v1/dags/{dag}/rollback``        write     undo the DAG's last deploy
``GET /v1/dags/{dag}/jobs/{job}/        read      why the job did or did not run
explain``
``POST /v1/dags/{dag}/jobs/{job}/       write     start a manual source's task
trigger``                                         for ``{key}``
``GET /v1/datasets``                    read      the datasets the caller may see
``GET /v1/datasets/{name}``             read      one, with versions and coverage
``GET /v1/datasets/{name}/rows``        read      its live version's rows (``limit``)
``POST /v1/query``                      read      ``{sql, limit}`` over the visible
                                                  datasets (the query service)
``GET /v1/tasks``                       read      visible tasks (``dag``, ``job``,
                                                  ``status``, ``limit``)
``GET /v1/tasks/{task_id}``             read      one, with its attempts and errors
``GET /v1/lineage``                     read      upstream/downstream of ``dataset``
                                                  (``column``) through visible datasets
======================================  ========  ====================================

The writer's controls (pause and resume a job by hand, rematerialize a
dataset) are :mod:`trace_core.api.people_control`'s, under the same prefixes.

Everything is scoped to the caller's org, and within it to what the caller
may see (:mod:`trace_core.people.visibility`): something invisible answers
404 with the very body of a missing one. A reader's writing request is 403
before anything is read or changed. The handlers only translate: the reads
are :class:`~trace_core.people.catalog.PeopleCatalog`'s, deploy, rollback,
explain and trigger the Dispatcher's (as for the machine routes), queries
the :class:`~trace_core.api.query.QueryService`'s.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Response
from fastapi.responses import JSONResponse

from trace_core.api.errors import ERROR_RESPONSES, Forbidden, answer_doc, error_response
from trace_core.api.fields import Name
from trace_core.api.models import TriggerResponse
from trace_core.api.people import Who
from trace_core.api.people_data_models import (
    DagOut,
    DagVersionsOut,
    DatasetOut,
    DatasetVersionsOut,
    DeployIn,
    DeployOut,
    LineageEdgeOut,
    LineageOut,
    PersonQuery,
    RollbackOut,
    TaskDetailOut,
    TaskOut,
    TriggerIn,
)
from trace_core.api.query import (
    DEFAULT_QUERY_LIMIT,
    MAX_QUERY_LIMIT,
    NotAttached,
    QueryResponse,
    QueryService,
)
from trace_core.dag import parse_dag
from trace_core.dispatcher.explain import Explanation
from trace_core.dispatcher.service import Dispatcher
from trace_core.errors import ConfigurationError, InvalidInput
from trace_core.people.access import Caller, NotAllowed, Permission
from trace_core.people.catalog import PeopleCatalog
from trace_core.security.claims import DatasetInput

__all__ = ["DATA_PREFIXES", "deploy_yaml", "need_write", "people_data_router"]

DATA_PREFIXES = ("/v1/dags", "/v1/datasets", "/v1/tasks", "/v1/lineage", "/v1/query")
"""Paths of these routes: authorized by a person's token only."""

MAX_TASKS = 1000
"""The most tasks ``GET /v1/tasks`` answers at once."""
MAX_LINEAGE_DEPTH = 50

_TASK_STATUS = Literal["Queued", "Running", "Completed", "Failed", "Canceled"]
_Answers = dict[int | str, dict[str, Any]]
MISSING: _Answers = {404: answer_doc("No such object in the caller's org, or not visible")}
WRITER: _Answers = {403: answer_doc("The caller's platform role may not write")}
_NOT_VISIBLE_SQL = "the query may read only the datasets you may see"


async def deploy_yaml(
    dispatcher: Dispatcher, catalog: PeopleCatalog, who: Caller, text: str
) -> DeployOut:
    """Deploy DAG YAML ``text`` into the caller's org: the one deploy path of
    people's routes (``POST /v1/dags``, a rematerialization). The caller's
    write permission is checked by the route."""
    known = {d.name for d in await catalog.datasets(who)}
    document = parse_dag(
        text,
        file="yaml",
        operators=dispatcher.operators.names(),
        runtimes=dispatcher.runtimes.names(),
        known_datasets=known,
    )
    if document.spec.org is not None and document.spec.org != who.org_slug:
        raise InvalidInput("yaml", "org: names another org than the caller's")
    await catalog.check_deploy(who, document.spec)
    done = await dispatcher.deploy(document, org_slug=who.org_slug)
    return DeployOut(
        dag_version_id=done.dag_version_id,
        dag_name=done.dag_name,
        yaml_hash=done.yaml_hash,
        status=done.status,
        changed=done.changed,
        abandoned_version_ids=list(done.abandoned_version_ids),
        canceled_task_ids=list(done.canceled_task_ids),
    )


def need_write(who: Caller) -> None:
    """A reader's writing request ends here, before anything is read or changed."""
    if not who.may(Permission.WRITE):
        raise Forbidden("forbidden", str(NotAllowed(Permission.WRITE)))


def people_data_router(
    dispatcher: Dispatcher, catalog: PeopleCatalog, query: QueryService | None = None
) -> APIRouter:
    """The routes of the module docstring (``/v1/query`` and ``rows`` only with ``query``)."""
    router = APIRouter(prefix="/v1", tags=["people data"], responses=ERROR_RESPONSES)

    @router.get("/dags", response_model=list[DagOut])
    async def list_dags(who: Who) -> list[DagOut]:
        """The DAGs of the caller's org."""
        return [DagOut.of(d) for d in await catalog.dags(who)]

    @router.get("/dags/{dag}", response_model=DagVersionsOut, responses=MISSING)
    async def get_dag(who: Who, dag: str) -> DagVersionsOut:
        """A DAG's versions, newest first, each with the visible datasets it points at."""
        return DagVersionsOut.of(await catalog.dag(who, dag))

    @router.post("/dags", response_model=DeployOut, responses=WRITER)
    async def deploy(who: Who, body: DeployIn) -> DeployOut:
        """Deploy a DAG file into the caller's org (writer). Every existing dataset
        it names, and every dataset the DAG produces today, must be one the
        caller may see."""
        need_write(who)
        return await deploy_yaml(dispatcher, catalog, who, body.yaml)

    @router.post("/dags/{dag}/rollback", response_model=RollbackOut, responses=WRITER | MISSING)
    async def rollback(who: Who, dag: str) -> RollbackOut:
        """Undo the DAG's last deploy (writer); abandoned work is canceled."""
        need_write(who)
        await catalog.dag(who, dag)  # 404 for no such DAG in the org
        await catalog.check_dag_writable(who, dag)
        done = await dispatcher.rollback(dag, org_slug=who.org_slug)
        return RollbackOut(
            dag_name=done.dag_name,
            current_version_id=done.current_version_id,
            abandoned_version_ids=list(done.abandoned_version_ids),
            canceled_task_ids=list(done.canceled_task_ids),
        )

    @router.get("/dags/{dag}/jobs/{job}/explain", responses=MISSING)
    async def explain(who: Who, dag: str, job: str) -> Explanation:
        """Why the job did or did not run (its live version, else the newest)."""
        await catalog.check_job(who, dag, job)
        return await dispatcher.explain(dag, job, org_slug=who.org_slug)

    @router.post(
        "/dags/{dag}/jobs/{job}/trigger",
        response_model=TriggerResponse,
        responses=WRITER | MISSING,
    )
    async def trigger(who: Who, dag: str, job: str, body: TriggerIn) -> TriggerResponse:
        """Start the live manual source's task for ``key`` (writer; the same key,
        the same task)."""
        need_write(who)
        job_id = await catalog.live_job(who, dag, job)
        try:
            run = await dispatcher.manual.create_task(job_id, body.key)
        except ConfigurationError as exc:
            raise InvalidInput("job", str(exc)) from None
        return TriggerResponse(
            job_id=run.job_id, task_id=run.task_id, created=run.created, refused=run.refused
        )

    @router.get("/datasets", response_model=list[DatasetOut])
    async def list_datasets(who: Who) -> list[DatasetOut]:
        """The datasets of the caller's org that the caller may see."""
        return [DatasetOut.of(d) for d in await catalog.datasets(who)]

    @router.get("/datasets/{name}", response_model=DatasetVersionsOut, responses=MISSING)
    async def get_dataset(who: Who, name: str) -> DatasetVersionsOut:
        """A dataset with its versions (newest first) and their coverage."""
        return DatasetVersionsOut.detail(await catalog.dataset(who, name))

    @router.get("/tasks", response_model=list[TaskOut])
    async def list_tasks(
        who: Who,
        dag: Annotated[Name | None, Query()] = None,
        job: Annotated[Name | None, Query()] = None,
        status: Annotated[_TASK_STATUS | None, Query()] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_TASKS)] = 100,
    ) -> list[TaskOut]:
        """Tasks of the jobs the caller may see, most recently queued first."""
        found = await catalog.tasks(who, dag=dag, job=job, status=status, limit=limit)
        return [TaskOut.of(task, of_job) for task, of_job in found]

    @router.get("/tasks/{task_id}", response_model=TaskDetailOut, responses=MISSING)
    async def get_task(who: Who, task_id: uuid.UUID) -> TaskDetailOut:
        """A task with its attempts, their results and errors."""
        return TaskDetailOut.detail(await catalog.task(who, task_id))

    @router.get("/lineage", response_model=LineageOut, responses=MISSING)
    async def lineage(
        who: Who,
        dataset: Annotated[Name, Query()],
        column: Annotated[Name | None, Query()] = None,
        direction: Annotated[Literal["up", "down", "both"], Query()] = "both",
        depth: Annotated[int, Query(ge=1, le=MAX_LINEAGE_DEPTH)] = 10,
    ) -> LineageOut:
        """Where ``dataset`` (or its ``column``) comes from and goes, only through
        datasets the caller may see."""
        found = await catalog.lineage(who, dataset, column, depth=depth, direction=direction)
        return LineageOut(
            dataset=dataset,
            column=column,
            direction=direction,
            upstream=[LineageEdgeOut.of(r) for r in found.upstream],
            downstream=[LineageEdgeOut.of(r) for r in found.downstream],
        )

    if query is not None:
        _query_routes(router, catalog, query)
    return router


def _query_routes(router: APIRouter, catalog: PeopleCatalog, service: QueryService) -> None:
    """``GET /v1/datasets/{name}/rows`` and ``POST /v1/query``."""

    async def run(
        who: Caller, views: dict[str, DatasetInput], sql: str, limit: int, response: Response
    ) -> QueryResponse | JSONResponse:
        try:
            result = await service.query_views(views, sql, limit=limit, org_id=who.org_id)
        except NotAttached:
            # The same answer whether the name is invisible, of another org or nothing.
            return error_response(404, "not_found", _NOT_VISIBLE_SQL, field="sql")
        response.headers["Cache-Control"] = "no-store"
        return QueryResponse(
            columns=list(result.columns), rows=result.rows, truncated=result.truncated
        )

    @router.get("/datasets/{name}/rows", response_model=QueryResponse, responses=MISSING)
    async def rows(
        who: Who,
        name: str,
        response: Response,
        limit: Annotated[int, Query(ge=1, le=MAX_QUERY_LIMIT)] = DEFAULT_QUERY_LIMIT,
    ) -> QueryResponse | JSONResponse:
        """The rows of the dataset's live version, at most ``limit`` (through the
        query service)."""
        item = await catalog.dataset_view(who, name)
        # One fixed view name: any dataset name is read, whatever its characters.
        return await run(who, {"dataset": item}, "SELECT * FROM dataset", limit, response)

    @router.post("/query", response_model=QueryResponse, responses=MISSING)
    async def query(
        who: Who, body: PersonQuery, response: Response
    ) -> QueryResponse | JSONResponse:
        """One read-only SQL query over the datasets the caller may see (each a
        view named by the dataset, lowercase)."""
        views = await catalog.views(who)
        return await run(who, views, body.sql, body.limit, response)
