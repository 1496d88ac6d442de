"""The control-plane ASGI app: :func:`create_app`.

One FastAPI application over one :class:`~trace_core.dispatcher.service.Dispatcher`:
the internal task endpoints (:mod:`~trace_core.api.internal`), the v1
worker contract (:mod:`~trace_core.api.worker_v1`) and the operations
endpoints (:mod:`~trace_core.api.ops`), behind the internal bearer token
(:mod:`~trace_core.api.auth`) and the body cap (:mod:`~trace_core.api.limits`),
the worker's hot routes answered by a light dispatch (:mod:`~trace_core.api.hot_routes`),
with every error answered as JSON (:mod:`~trace_core.api.errors`). With a
token verifier, the task-scoped endpoints (:mod:`~trace_core.api.task_scoped`,
:mod:`~trace_core.api.task_state`)
are mounted too, behind the capability token instead
(:mod:`~trace_core.api.capability`).

The OpenAPI document at ``/openapi.json`` describes what the app really
answers: 400 (not FastAPI's 422) for malformed requests, the error shapes,
and on every route its scheme: the internal bearer, or the capability header.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from trace_core.api.auth import InternalAuth, check_internal_token
from trace_core.api.capability import CAPABILITY_HEADER, TASK_PREFIX, CapabilityAuth
from trace_core.api.errors import add_answer_schemas, install_error_handlers
from trace_core.api.fields import MAX_WAIT_MS
from trace_core.api.hot_routes import HotRoutes, hot_routes
from trace_core.api.internal import internal_router
from trace_core.api.limits import BodyLimit
from trace_core.api.ops import health_router, ops_router
from trace_core.api.people import PEOPLE_PREFIXES, PeopleApi, PeopleAuth, people_router
from trace_core.api.people_control import people_control_router
from trace_core.api.people_data import DATA_PREFIXES, people_data_router
from trace_core.api.query import QueryService, query_router
from trace_core.api.streams import StreamClaimer
from trace_core.api.task_attempts import attempts_router
from trace_core.api.task_scoped import task_router
from trace_core.api.task_state import task_state_router
from trace_core.api.worker_v1 import worker_router
from trace_core.dispatcher.buffer import DatasetBuffer
from trace_core.dispatcher.service import Dispatcher
from trace_core.errors import ConfigurationError
from trace_core.people.catalog import PeopleCatalog
from trace_core.security.minting import CredentialMinter
from trace_core.security.verifier import TokenVerifier

__all__ = ["ApiConfig", "create_app"]

log = logging.getLogger("trace_core.api")

_BEARER = "internalBearer"
_CAPABILITY = "taskCapability"
_PERSON = "personBearer"
_PERSONAL = PEOPLE_PREFIXES + DATA_PREFIXES
"""Paths authorized by a person's token (and never by the internal one)."""


@dataclass(frozen=True)
class ApiConfig:
    """Settings of the HTTP layer."""

    max_body_bytes: int = 1 << 20
    """Request bodies over this many bytes are answered 413."""
    max_wait_ms: int = MAX_WAIT_MS
    """The longest v1 claim long-poll this server grants (at most 20,000)."""
    claim_recheck_seconds: float = 2.0
    """A waiting claim looks again at least this often, notification or not."""
    wakeups_per_claim: int = 32
    """Refused wake-ups a claim drops per stream and round before it reads the database."""
    fallback_scan: int = 16
    """Oldest queued tasks a claim tries per stream from the database fallback."""
    retry_after_seconds: int = 1
    """``Retry-After`` of a 503 (state database unavailable)."""

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ConfigurationError("ApiConfig.max_body_bytes must be >= 1024")
        if not 0 <= self.max_wait_ms <= MAX_WAIT_MS:
            raise ConfigurationError(f"ApiConfig.max_wait_ms must be within 0..{MAX_WAIT_MS}")
        if self.claim_recheck_seconds <= 0:
            raise ConfigurationError("ApiConfig.claim_recheck_seconds must be > 0")
        if self.wakeups_per_claim < 1 or self.fallback_scan < 1:
            raise ConfigurationError("ApiConfig.wakeups_per_claim and fallback_scan must be >= 1")
        if self.retry_after_seconds < 1:
            raise ConfigurationError("ApiConfig.retry_after_seconds must be >= 1")


def create_app(
    dispatcher: Dispatcher,
    *,
    internal_token: str,
    jwks: Callable[[], Mapping[str, Any]] | None = None,
    config: ApiConfig | None = None,
    run_dispatcher: bool = False,
    verifier: TokenVerifier | None = None,
    minter: CredentialMinter | None = None,
    buffer: DatasetBuffer | None = None,
    query: QueryService | None = None,
    on_dispatcher_failure: Callable[[BaseException], None] | None = None,
    people: PeopleApi | None = None,
) -> FastAPI:
    """The control-plane app on ``dispatcher``.

    ``internal_token`` authorizes every route (at least 16 printable ASCII
    characters) but the task-scoped ones; ``jwks`` returns the document
    served at ``/internal/jwks/task`` (default: no keys). With
    ``run_dispatcher`` the app's lifespan runs the Dispatcher's services
    (``start`` on startup, ``stop`` on shutdown) and ``/readyz`` requires
    them; otherwise whoever embeds the app runs them, and ``/readyz`` only
    reports them (:func:`~trace_core.api.ops.health_router`).
    ``on_dispatcher_failure`` is called should the services' task group end
    with an error while the app serves (no service loop is meant to: each
    backs off and carries on), so that the embedder stops the server rather
    than answering HTTP with no Dispatcher behind it; ``trace-lite serve``
    exits with the error.

    With a ``verifier``, ``/v1/task/heartbeat``, ``complete`` and ``events``
    are mounted, authorized by capability tokens only; with a ``minter``
    also ``/v1/task/credentials``, with a ``buffer`` also
    ``/v1/task/buffer-publish``, with a ``query`` service also
    ``/v1/task/query`` (:mod:`~trace_core.api.query`). Without a verifier no
    ``/v1/task`` route exists (and a minter, buffer or query service is a
    configuration error).
    """
    cfg = config or ApiConfig()
    check_internal_token(internal_token)
    if verifier is None and (minter is not None or buffer is not None or query is not None):
        raise ConfigurationError(
            "create_app: a credential minter, a dataset buffer or a query service needs "
            "a token verifier "
            "(their routes are authorized by capability tokens)"
        )
    app = FastAPI(
        title="Trace control plane",
        version="1",
        summary="Internal task, worker v1 and operations endpoints of the Dispatcher",
        docs_url=None,  # the interactive docs load scripts from a CDN; not on an internal port
        redoc_url=None,
        lifespan=_running(dispatcher, on_dispatcher_failure) if run_dispatcher else None,
    )
    install_error_handlers(app, retry_after_seconds=cfg.retry_after_seconds)
    claimer = StreamClaimer(
        dispatcher,
        wakeups_per_round=cfg.wakeups_per_claim,
        fallback_scan=cfg.fallback_scan,
        recheck_seconds=cfg.claim_recheck_seconds,
    )
    internal = internal_router(dispatcher, jwks=jwks)
    app.include_router(internal)
    hot = [*internal.routes]
    worker = worker_router(dispatcher, claimer, max_wait_ms=cfg.max_wait_ms)
    app.include_router(worker)
    hot += worker.routes
    app.include_router(ops_router(dispatcher))
    app.include_router(attempts_router(dispatcher))
    app.include_router(
        health_router(
            dispatcher,
            services_required=run_dispatcher,
            retry_after_seconds=cfg.retry_after_seconds,
        )
    )
    if verifier is not None:
        task = task_router(dispatcher, minter=minter, buffer=buffer)
        app.include_router(task)
        hot += task.routes
        app.include_router(task_state_router(dispatcher))
        if query is not None:
            app.include_router(query_router(dispatcher, query))
    if people is not None:
        app.include_router(people_router(people))
        catalog = PeopleCatalog(dispatcher.repo)
        app.include_router(people_data_router(dispatcher, catalog, query=query))
        app.include_router(people_control_router(dispatcher, catalog))
    # The last added middleware runs first: authentication, then the body cap,
    # so an anonymous client cannot make the server buffer a body; then the
    # light dispatch of the worker's hot routes, with the app's error handlers.
    app.add_middleware(HotRoutes, routes=hot_routes(hot), handlers=app.exception_handlers)
    app.add_middleware(BodyLimit, max_bytes=cfg.max_body_bytes)
    public_prefixes: tuple[str, ...] = ()
    if verifier is not None:
        app.add_middleware(
            CapabilityAuth,
            verifier=verifier,
            prefix=TASK_PREFIX,
            retry_after_seconds=cfg.retry_after_seconds,
        )
        public_prefixes = (TASK_PREFIX,)
    if people is not None:
        app.add_middleware(
            PeopleAuth,
            people=people,
            prefixes=_PERSONAL,
            retry_after_seconds=cfg.retry_after_seconds,
        )
        public_prefixes += _PERSONAL  # PeopleAuth demands a person's token there
    app.add_middleware(InternalAuth, token=internal_token, public_prefixes=public_prefixes)
    app.openapi = _openapi(app)  # type: ignore[method-assign]
    return app


def _running(
    dispatcher: Dispatcher, on_failure: Callable[[BaseException], None] | None
) -> Callable[[FastAPI], Any]:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            async with anyio.create_task_group() as group:
                await dispatcher.start(group)
                try:
                    yield
                finally:
                    await dispatcher.stop()
                    # In-process tasks still running are abandoned here: their
                    # leases expire and the next Dispatcher retries them.
                    group.cancel_scope.cancel()
        except Exception as exc:
            # Not one service loop lets an error out; should one do it anyway,
            # the server must not keep answering with no Dispatcher behind it.
            log.critical("the Dispatcher's services failed", exc_info=exc)
            if on_failure is not None:
                on_failure(exc)
            raise

    return lifespan


def _openapi(app: FastAPI) -> Callable[[], dict[str, Any]]:
    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(
                title=app.title,
                version=app.version,
                summary=app.summary,
                routes=app.routes,
            )
            add_answer_schemas(document)
            _describe_answers(document)
            app.openapi_schema = document
        return app.openapi_schema

    return build


def _describe_answers(document: dict[str, Any]) -> None:
    """Drop FastAPI's 422 answers (we answer 400) and declare each route's scheme."""
    task_scoped = personal = False
    for path, path_item in document.get("paths", {}).items():
        scheme = _CAPABILITY if path.startswith(TASK_PREFIX) else _BEARER
        scheme = _PERSON if path.startswith(_PERSONAL) else scheme
        task_scoped = task_scoped or scheme == _CAPABILITY
        personal = personal or scheme == _PERSON
        for operation in path_item.values():
            operation.get("responses", {}).pop("422", None)
            operation["security"] = [{scheme: []}]
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    schemes: dict[str, Any] = {
        _BEARER: {
            "type": "http",
            "scheme": "bearer",
            "description": "The internal token shared by platform components",
        }
    }
    if task_scoped:
        schemes[_CAPABILITY] = {
            "type": "apiKey",
            "in": "header",
            "name": CAPABILITY_HEADER,
            "description": "The capability token issued with the task attempt's claim",
        }
    if personal:
        schemes[_PERSON] = {
            "type": "http",
            "scheme": "bearer",
            "bearerFormat": "JWT",
            "description": "A person's token from the configured identity provider",
        }
    document["components"]["securitySchemes"] = schemes
