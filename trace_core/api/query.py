"""The Query Service port and its task-scoped route, ``POST /v1/task/query``.

interface-contracts.md ("UDF Data Access Token"): task code reads its inputs
with ad-hoc SQL through the Query Service, and only the datasets in its
capability token are attached as views; anything else fails closed.

Request ``{task_id, attempt, sql, limit?}`` with the attempt's token in
``X-Trace-Task-Capability``; the token must be for that attempt, the attempt
the task's latest (401 ``wrong_task``/``superseded`` otherwise) and running
(409 ``not_running``), as for the other ``/v1/task`` routes. ``sql`` is one
read-only query (``SELECT``, ``WITH``, ``VALUES``, ``TABLE``, pipe syntax);
``limit`` caps the rows answered (default 1000, at most 10,000).

Answer 200 ``{columns: [{name, type}], rows: [[...]], truncated}``: ``rows``
are positional (column names may repeat), values as JSON (see the
implementation for the rendering of types); ``truncated`` says rows were
left out by ``limit`` (or a size cap). Errors: 400 naming ``sql`` for a
query that does not parse, is not a single read-only query, uses a
forbidden construct or function, fails to analyze or to run, or reads an
input that cannot be attached (``invalid_request``); 403 ``not_attached``
naming ``sql`` for a reference to any relation that is not one of the
token's datasets (another dataset, a catalog table, a file path) — the same
answer whether or not such a relation exists.

View names (:func:`dataset_views`), for the token's ``inputs`` in order:

* ``input_<i>`` — the ``i``-th input (0-based), always;
* ``ds_<dataset_uuid as 32 hex digits>`` — for a dataset read by exactly
  one input (a dataset read twice, e.g. with two filters, only has its
  ``input_<i>`` names);
* the dataset's name (its DAG name, as in the task payload's
  ``inputs[i].dataset``), when it is a plain identifier
  (``[A-Za-z_][A-Za-z0-9_]*``), read by exactly one input, unique among the
  inputs and not of the two reserved forms above.

Names are case-insensitive, like Spark SQL identifiers. Every view of an
input shows only the rows its ``where`` filter keeps.
"""

from __future__ import annotations

import re
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Protocol

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, Field

from trace_core.api.capability import TaskCapability
from trace_core.api.errors import Forbidden, answer_doc, error_response
from trace_core.api.fields import Attempt, Request, check_text
from trace_core.api.task_scoped import TASK_ERROR_RESPONSES, check_current_attempt
from trace_core.dispatcher.bounded import BoundedMemo
from trace_core.dispatcher.service import Dispatcher
from trace_core.security.claims import CapabilityClaims, DatasetInput

__all__ = [
    "DEFAULT_QUERY_LIMIT",
    "MAX_QUERY_LIMIT",
    "MAX_SQL_LENGTH",
    "NotAttached",
    "QueryColumn",
    "QueryRequest",
    "QueryResponse",
    "QueryResult",
    "QueryService",
    "dataset_views",
    "query_router",
]

DEFAULT_QUERY_LIMIT = 1000
"""Rows answered when the request names no ``limit``."""
MAX_QUERY_LIMIT = 10_000
"""The largest ``limit`` a request may ask for."""
MAX_SQL_LENGTH = 100_000
"""The longest query text accepted (characters)."""

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_RESERVED = re.compile(r"(?:ds_[0-9a-f]{32}|input_[0-9]+)", re.IGNORECASE)
_NAMES_CACHE = 4096  # tasks


def _sql_text(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be blank")
    return check_text(value)


class QueryRequest(Request):
    """``POST /v1/task/query``: one read-only SQL query over the task's inputs."""

    task_id: uuid.UUID
    attempt: Attempt
    sql: Annotated[str, Field(min_length=1, max_length=MAX_SQL_LENGTH), AfterValidator(_sql_text)]
    limit: Annotated[int, Field(strict=True, ge=1, le=MAX_QUERY_LIMIT)] = DEFAULT_QUERY_LIMIT


class QueryColumn(BaseModel):
    """One result column: its name and its engine type (``bigint``, ``decimal(10,2)``)."""

    name: str
    type: str


class QueryResponse(BaseModel):
    """The rows of a query, positionally (``rows[r][c]`` is column ``c``)."""

    columns: list[QueryColumn]
    rows: list[list[Any]]
    truncated: bool
    """Rows were left out (the request's ``limit``, or the service's size cap)."""


@dataclass(frozen=True)
class QueryResult:
    """What a :class:`QueryService` answers."""

    columns: tuple[QueryColumn, ...]
    rows: list[list[Any]]
    """JSON values (``None``, bool, int, float, str, lists and objects of them)."""
    truncated: bool


class NotAttached(Forbidden):
    """The query references a relation that is not one of the token's datasets (403)."""

    def __init__(self, reason: str) -> None:
        super().__init__("not_attached", reason)


class QueryService(Protocol):
    """Runs one read-only query over a task's input datasets.

    ``views`` maps view names (lowercase) to inputs of ``claims``
    (:func:`dataset_views`; by default that of ``claims.inputs`` without
    names). Nothing but these inputs may be readable by the query, each
    filtered by its ``where``. Raises
    :class:`~trace_core.errors.InvalidInput` naming ``sql`` for a query it
    refuses or that fails, :class:`NotAttached` for a reference to anything
    else; answers at most ``limit`` rows.
    """

    async def query(
        self,
        claims: CapabilityClaims,
        sql: str,
        *,
        limit: int,
        views: Mapping[str, DatasetInput] | None = None,
    ) -> QueryResult:
        """Run ``sql`` against the views of ``claims``' inputs."""
        ...

    async def query_views(
        self,
        views: Mapping[str, DatasetInput],
        sql: str,
        *,
        limit: int,
        org_id: uuid.UUID,
    ) -> QueryResult:
        """Run ``sql`` against exactly ``views`` (names lowercase), for a person:
        the caller chose them (the datasets the person may see); Postgres-table
        views hold ``org_id``'s rows only. Raises as :meth:`query`."""
        ...


def dataset_views(
    inputs: Sequence[DatasetInput], names: Mapping[uuid.UUID, str] | None = None
) -> dict[str, DatasetInput]:
    """The view names of ``inputs`` (lowercase), by the rule of the module docstring.

    ``names`` maps dataset UUIDs to dataset names (the task payload's); a name
    that is not usable by that rule is left out, never altered.
    """
    views: dict[str, DatasetInput] = {}
    reads = Counter(item.dataset_uuid for item in inputs)
    for index, item in enumerate(inputs):
        views[f"input_{index}"] = item
        if reads[item.dataset_uuid] == 1:
            views[f"ds_{item.dataset_uuid.hex}"] = item
    known = names or {}
    candidates = [
        known[item.dataset_uuid].lower()
        for item in inputs
        if reads[item.dataset_uuid] == 1 and item.dataset_uuid in known
    ]
    unique = {name for name, count in Counter(candidates).items() if count == 1}
    for item in inputs:
        name = known.get(item.dataset_uuid)
        if name is None or reads[item.dataset_uuid] != 1:
            continue
        if _IDENTIFIER.fullmatch(name) and not _RESERVED.fullmatch(name) and name.lower() in unique:
            views[name.lower()] = item
    return views


_QUERY_RESPONSES: dict[int | str, dict[str, Any]] = {
    403: answer_doc("The query references a relation that is not one of the token's datasets")
}


def query_router(dispatcher: Dispatcher, service: QueryService) -> APIRouter:
    """``POST /v1/task/query`` over ``service`` (see the module docstring)."""
    router = APIRouter(prefix="/v1/task", tags=["task"], responses=TASK_ERROR_RESPONSES)
    names_cache: BoundedMemo[uuid.UUID, dict[uuid.UUID, str]] = BoundedMemo(_NAMES_CACHE)

    async def names_of(task_id: uuid.UUID) -> dict[uuid.UUID, str]:
        found = names_cache.get(task_id)
        if found is None:
            payload = await dispatcher.control.fetch(task_id)
            found = {}
            for item in payload.get("inputs", ()):
                name, dataset = item.get("dataset"), item.get("dataset_uuid")
                if isinstance(name, str) and isinstance(dataset, str):
                    try:
                        found[uuid.UUID(dataset)] = name
                    except ValueError:
                        continue
            names_cache.put(task_id, found)
        return found

    @router.post("/query", response_model=QueryResponse, responses=_QUERY_RESPONSES)
    async def query(
        request: QueryRequest, claims: TaskCapability, response: Response
    ) -> QueryResponse | JSONResponse:
        """Run one read-only SQL query over the task's input datasets (views named
        ``input_<i>``, ``ds_<dataset_uuid hex>`` and the dataset names)."""
        await check_current_attempt(
            dispatcher, claims, request.task_id, request.attempt, running=True
        )
        views = dataset_views(claims.inputs, await names_of(request.task_id))
        try:
            result = await service.query(claims, request.sql, limit=request.limit, views=views)
        except NotAttached as exc:
            return error_response(403, exc.error, exc.reason, field="sql")
        response.headers["Cache-Control"] = "no-store"
        return QueryResponse(
            columns=list(result.columns), rows=result.rows, truncated=result.truncated
        )

    return router
