"""Euterpe's HTTP API (euterpe-contract.md §6, §7, §9): :func:`create_transcode_app`.

Every route needs a requester's API key, ``Authorization: Bearer eut_…``
(:class:`~trace_core.euterpe.api_keys.ApiKeys`): without one, or with a
malformed, unknown or revoked one, the answer is ``401`` with the same body
whichever it was. The key decides the requester; nothing in a request can
name another.

``POST /transcode``
    :meth:`~trace_core.euterpe.intake.Intake.enqueue`: authenticate, check the
    ``Idempotency-Key`` header, validate the body, then claim the key, seal
    the credentials and insert the job. ``202`` with ``{job_id, status_url}``
    (and ``Location``). The same key and body again: ``202`` with the same
    ``job_id``, ``replayed: true`` and ``Idempotent-Replayed: true``. The same
    key with another body: ``409 idempotency_conflict``. The same key while
    the first request is still running: ``409 idempotency_in_flight`` with
    ``Retry-After`` (the IETF Idempotency-Key draft's answer; the draft puts a
    different body at 422, but the contract calls it a conflict, and a client
    tells the two apart by ``error``). A bad body is ``400`` naming the field;
    nothing is stored for any refused request.
``GET /transcode/status?job_id=…``
    ``200`` with :meth:`~trace_core.euterpe.job_status.JobStatus.as_json`
    (stage, counters, timestamps, history, webhook events, outputs once
    succeeded, the normalized error once failed or dead-lettered);
    ``404`` for an unknown job **and for another requester's job**: a 403
    would confirm that the id exists, and job ids must tell one requester
    nothing about another's work; ``410`` for a job removed by retention
    pruning (its own requester only; others get the same 404).
``PUT /transcode/{job_id}/credentials``
    The requester's answer to a refresh call (§7): new credentials for
    ``credential_version`` (the version being replaced); ``200`` with the new
    version (+1); ``409 credential_version_conflict`` when the job is no
    longer at that version (another refresh won); ``404`` as above.

Credentials are never echoed nor logged: errors name fields, never values,
and the status read never opens the sealed blob.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Header, Query, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse

from trace_core.api.errors import (
    add_answer_schemas,
    answer_doc,
    error_response,
    install_error_handlers,
)
from trace_core.api.limits import BodyLimit
from trace_core.api.transcode_models import (
    CredentialRefreshRequest,
    CredentialsRefreshed,
    JobStatusBody,
    TranscodeAccepted,
    parse_refresh_request,
)
from trace_core.errors import (
    ConfigurationError,
    IdempotencyConflict,
    IdempotencyInFlight,
    InvalidInput,
)
from trace_core.euterpe.api_keys import ApiKeyRefused
from trace_core.euterpe.credentials import (
    CredentialVault,
    CredentialVersionConflict,
    refresh_credentials,
)
from trace_core.euterpe.intake import IDEMPOTENCY_HEADER, Intake
from trace_core.euterpe.job_status import JobPruned
from trace_core.euterpe.jobs import InboxJobs
from trace_core.euterpe.requests import TRANSCODE_ROUTE, TranscodeRequest

__all__ = [
    "REPLAYED_HEADER",
    "STATUS_ROUTE",
    "TranscodeApi",
    "TranscodeApiConfig",
    "create_transcode_app",
    "transcode_router",
]

log = logging.getLogger("trace_core.api.transcode")

STATUS_ROUTE = TRANSCODE_ROUTE + "/status"
REPLAYED_HEADER = "Idempotent-Replayed"
_SCHEME = "euterpeApiKey"
_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="euterpe"'}


@dataclass(frozen=True)
class TranscodeApiConfig:
    """Settings of the Euterpe HTTP layer."""

    max_body_bytes: int = 256 * 1024
    """Request bodies over this many bytes are answered 413 (a request with an
    8 KiB session token and eight presets is far below)."""
    retry_after_seconds: int = 1
    """``Retry-After`` of a 409 in flight and of a 503."""

    def __post_init__(self) -> None:
        if self.max_body_bytes < 16 * 1024:
            raise ConfigurationError("TranscodeApiConfig.max_body_bytes must be >= 16384")
        if self.retry_after_seconds < 1:
            raise ConfigurationError("TranscodeApiConfig.retry_after_seconds must be >= 1")


@dataclass(frozen=True)
class TranscodeApi:
    """What the routes run: the enqueue use case, the job lifecycle (status
    reads) and the vault (credential refreshes)."""

    intake: Intake
    jobs: InboxJobs
    vault: CredentialVault

    async def requester(self, request: Request) -> str:
        """The requester of the request's API key; :class:`ApiKeyRefused` otherwise."""
        return await self.intake.keys.authenticate(bearer_key(request))


def bearer_key(request: Request) -> str | None:
    """The key of the one ``Authorization: Bearer <key>`` header, or None
    (none, several, or another scheme: all refused alike)."""
    values = request.headers.getlist("authorization")
    if len(values) != 1:
        return None
    scheme, _, credential = values[0].strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return credential.strip() or None


def _job_id(value: str | None) -> uuid.UUID:
    if value is None or not value:
        raise InvalidInput("job_id", "is required")
    try:
        return uuid.UUID(value)
    except ValueError:
        raise InvalidInput("job_id", "must be a UUID") from None


def _status_url(request: Request, job_id: uuid.UUID) -> str:
    return f"{request.scope.get('root_path', '')}{STATUS_ROUTE}?job_id={job_id}"


_COMMON: dict[int | str, dict[str, Any]] = {
    400: answer_doc("Malformed request; `field` names the culprit (nothing was stored)"),
    401: answer_doc("Missing, malformed, unknown or revoked API key"),
    413: answer_doc("Request body over the cap"),
    503: answer_doc("State database unavailable; retry after `Retry-After` seconds"),
}
_NOT_FOUND = answer_doc("Unknown job, or another requester's (its existence is not revealed)")


def _body_doc(model: type[Any], description: str) -> dict[str, Any]:
    """An OpenAPI ``requestBody`` referencing ``model``'s component schema (the
    routes read the raw body themselves, so no value is ever echoed)."""
    return {"requestBody": {"required": True, **answer_doc(description, model)}}


def transcode_router(api: TranscodeApi) -> APIRouter:
    """The three routes of the module docstring, on ``api``."""
    router = APIRouter(tags=["euterpe"])

    @router.post(
        TRANSCODE_ROUTE,
        status_code=202,
        summary="Enqueue a transcode",
        responses={
            202: answer_doc("Queued (or the replay of an identical request)", TranscodeAccepted),
            **_COMMON,
            409: answer_doc(
                "`idempotency_conflict`: the key was used with another body; "
                "`idempotency_in_flight`: the first request with this key is still "
                "running (retry after `Retry-After`)"
            ),
        },
        openapi_extra=_body_doc(TranscodeRequest, "The transcode to run"),
    )
    async def enqueue(
        request: Request,
        idempotency_key: Annotated[
            str | None,
            Header(
                alias=IDEMPOTENCY_HEADER,
                description="1-255 printable ASCII characters, unique per requester and request",
            ),
        ] = None,
    ) -> JSONResponse:
        body = await request.body()
        result = await api.intake.enqueue(
            api_key=bearer_key(request), idempotency_key=idempotency_key, body=body
        )
        url = _status_url(request, result.job_id)
        headers = {"Location": url}
        if result.replayed:
            headers[REPLAYED_HEADER] = "true"
        answer = TranscodeAccepted(
            job_id=str(result.job_id), status_url=url, replayed=result.replayed
        )
        return JSONResponse(answer.model_dump(), status_code=202, headers=headers)

    @router.get(
        STATUS_ROUTE,
        summary="Read a job's status",
        responses={
            200: answer_doc("The job's status", JobStatusBody),
            **_COMMON,
            404: _NOT_FOUND,
            410: answer_doc("The job finished and was pruned after the retention period"),
        },
    )
    async def status(
        request: Request,
        job_id: Annotated[
            str | None, Query(description="The id `POST /transcode` returned")
        ] = None,
    ) -> JSONResponse:
        requester = await api.requester(request)
        found = await api.jobs.status(_job_id(job_id), requester_id=requester)
        return JSONResponse(found.as_json())

    @router.put(
        TRANSCODE_ROUTE + "/{job_id}/credentials",
        summary="Replace a job's storage credentials (the answer to a refresh call)",
        responses={
            200: answer_doc(
                "Stored, sealed, under the new credential version", CredentialsRefreshed
            ),
            **_COMMON,
            404: _NOT_FOUND,
            409: answer_doc(
                "`credential_version_conflict`: the job is no longer at `credential_version`"
            ),
        },
        openapi_extra=_body_doc(CredentialRefreshRequest, "The new credentials"),
    )
    async def refresh(request: Request, job_id: str) -> JSONResponse:
        requester = await api.requester(request)
        target = _job_id(job_id)
        parsed = parse_refresh_request(await request.body())
        credentials = parsed.storage_credentials.to_credentials()
        now = api.jobs.clock.now()
        if credentials.expiration is not None and credentials.expiration <= now:
            raise InvalidInput("storage_credentials.expiration", "is in the past")
        version = await refresh_credentials(
            api.jobs.repo,
            api.vault,
            job_id=target,
            requester_id=requester,
            expected_version=parsed.credential_version,
            credentials=credentials,
            clock=api.jobs.clock,
        )
        answer = CredentialsRefreshed(job_id=str(target), credential_version=version)
        return JSONResponse(answer.model_dump())

    return router


def _install_euterpe_errors(app: FastAPI, *, retry_after_seconds: int) -> None:
    """The house mapping (:func:`install_error_handlers`) plus Euterpe's own answers."""
    install_error_handlers(app, retry_after_seconds=retry_after_seconds)

    async def refused(request: Request, exc: Exception) -> JSONResponse:
        return error_response(
            401,
            "unauthorized",
            "a valid 'Authorization: Bearer <API key>' header is required",
            headers=_CHALLENGE,
        )

    async def pruned(request: Request, exc: Exception) -> JSONResponse:
        return error_response(410, "gone", str(exc))

    async def conflict(request: Request, exc: Exception) -> JSONResponse:
        return error_response(409, "idempotency_conflict", str(exc), field=IDEMPOTENCY_HEADER)

    async def in_flight(request: Request, exc: Exception) -> JSONResponse:
        return error_response(
            409,
            "idempotency_in_flight",
            str(exc),
            field=IDEMPOTENCY_HEADER,
            headers={"Retry-After": str(retry_after_seconds)},
        )

    async def version(request: Request, exc: Exception) -> JSONResponse:
        return error_response(
            409, "credential_version_conflict", str(exc), field="credential_version"
        )

    app.add_exception_handler(ApiKeyRefused, refused)
    app.add_exception_handler(JobPruned, pruned)
    app.add_exception_handler(IdempotencyConflict, conflict)
    app.add_exception_handler(IdempotencyInFlight, in_flight)
    app.add_exception_handler(CredentialVersionConflict, version)


def create_transcode_app(api: TranscodeApi, *, config: TranscodeApiConfig | None = None) -> FastAPI:
    """The Euterpe app: the routes of :func:`transcode_router`, the body cap,
    JSON errors, and an OpenAPI document (``/openapi.json``, public) that
    declares every answer and the API-key scheme."""
    cfg = config or TranscodeApiConfig()
    app = FastAPI(
        title="Euterpe",
        version="1",
        summary="Transcode jobs: enqueue, status, credential refresh",
        docs_url=None,  # the interactive docs load scripts from a CDN
        redoc_url=None,
    )
    _install_euterpe_errors(app, retry_after_seconds=cfg.retry_after_seconds)
    app.include_router(transcode_router(api))
    app.add_middleware(BodyLimit, max_bytes=cfg.max_body_bytes)
    app.openapi = _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> Callable[[], dict[str, Any]]:
    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(
                title=app.title, version=app.version, summary=app.summary, routes=app.routes
            )
            add_answer_schemas(document)
            for path_item in document.get("paths", {}).values():
                for operation in path_item.values():
                    operation.get("responses", {}).pop("422", None)  # we answer 400
                    operation["security"] = [{_SCHEME: []}]
            components = document.setdefault("components", {})
            for unused in ("HTTPValidationError", "ValidationError"):
                components.get("schemas", {}).pop(unused, None)
            components["securitySchemes"] = {
                _SCHEME: {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "A requester's Euterpe API key (`eut_…`)",
                }
            }
            app.openapi_schema = document
        return app.openapi_schema

    return build
