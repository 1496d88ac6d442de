"""Errors as HTTP answers: one JSON shape, one status per core error.

=====================================  ======  =========================
cause                                  status  ``error``
=====================================  ======  =========================
malformed request (pydantic, JSON,     400     ``invalid_request`` with
:class:`InvalidInput`, a bad setting)          ``field`` and ``reason``
missing or wrong bearer token          401     ``unauthorized``
refused task capability token          401     ``invalid_capability`` (503
                                               for ``jwks_unavailable``)
:class:`Forbidden` (API-level)         403     its own code
:class:`NotFound`, unknown path        404     ``not_found``
method not allowed                     405     ``method_not_allowed``
:class:`StaleClaim`                    409     ``stale``
:class:`InvalidTransition`             409     ``invalid_transition``
:class:`DuplicateItem`                 409     ``conflict``
:class:`Conflict` (API-level)          409     its own code
body over the cap                      413     ``payload_too_large``
:class:`DatabaseUnavailable`           503     ``unavailable`` +
                                               ``Retry-After``
anything else (a bug)                  500     ``internal`` (no detail)
=====================================  ======  =========================

Validation errors are 400, not FastAPI's default 422: the contracts speak of
malformed requests only, and :class:`InvalidInput` raised by the core after
parsing (``events[2].cursor``) must read the same as a schema violation.
Nothing from the request is echoed back except field names.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.models import Schema
from fastapi.responses import JSONResponse
from pydantic import BaseModel, TypeAdapter
from pydantic.json_schema import GenerateJsonSchema
from starlette.exceptions import HTTPException as StarletteHTTPException

from trace_core.api.capability import CapabilityRefused, capability_error
from trace_core.api.models import ErrorBody
from trace_core.errors import (
    ConfigurationError,
    DatabaseUnavailable,
    DuplicateItem,
    InvalidInput,
    InvalidTransition,
    NotFound,
    StaleClaim,
)
from trace_core.security.claims import InvalidCapability

__all__ = [
    "ERROR_RESPONSES",
    "Conflict",
    "Forbidden",
    "add_answer_schemas",
    "answer_doc",
    "error_response",
    "field_path",
    "install_error_handlers",
]

log = logging.getLogger("trace_core.api")

_REF = "#/components/schemas/{model}"

_SOURCES = ("body", "query", "path", "header", "cookie")
_HTTP_CODES = {
    400: "invalid_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
}


_ANSWER_MODELS: dict[str, type[BaseModel]] = {}


def answer_doc(description: str, model: type[BaseModel] = ErrorBody) -> dict[str, Any]:
    """An OpenAPI ``responses`` entry: ``model``'s JSON body, described.

    The body is a reference to the component schema, not FastAPI's ``model``
    key: with ``model`` FastAPI builds a pydantic field per route and status
    code when the app is created (most of ``create_app``'s time), only to
    render this same reference. :func:`add_answer_schemas` adds the schemas.
    """
    _ANSWER_MODELS[model.__name__] = model
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}},
    }


def add_answer_schemas(document: dict[str, Any]) -> None:
    """Add to ``document`` the component schemas of the :func:`answer_doc` models it uses."""
    text = json.dumps(document.get("paths", {}))
    mode: Literal["serialization"] = "serialization"
    used = [
        (name, mode, _adapter(model).core_schema)
        for name, model in _ANSWER_MODELS.items()
        if f'"{_REF.format(model=name)}"' in text
    ]
    if not used:
        return
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    _, definitions = GenerateJsonSchema(ref_template=_REF).generate_definitions(used)
    for name, schema in definitions.items():
        # As get_openapi renders a schema: the description cut at "\f", then
        # through the OpenAPI model (its key order, no null values).
        if "description" in schema:
            schema["description"] = str(schema["description"]).split("\f")[0]
        rendered = jsonable_encoder(Schema.model_validate(schema), by_alias=True, exclude_none=True)
        schemas.setdefault(name, rendered)
    document["components"]["schemas"] = dict(sorted(schemas.items()))


@functools.cache
def _adapter(model: type[BaseModel]) -> TypeAdapter[Any]:
    return TypeAdapter(model)


def _doc(description: str) -> dict[str, Any]:
    return answer_doc(description)


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _doc("Malformed request; `field` names the culprit"),
    401: _doc("Missing or wrong bearer token"),
    413: _doc("Request body over the cap"),
    503: _doc("State database unavailable; retry after `Retry-After` seconds"),
}
"""The error answers every internal route can give (OpenAPI ``responses``)."""


class Conflict(Exception):
    """A 409 of the API itself (not a core error): ``error`` is its code."""

    def __init__(self, error: str, reason: str) -> None:
        super().__init__(reason)
        self.error = error
        self.reason = reason


class Forbidden(Exception):
    """A 403 of the API itself: an authorized caller asked for what it may not do."""

    def __init__(self, error: str, reason: str) -> None:
        super().__init__(reason)
        self.error = error
        self.reason = reason


def error_response(
    status: int,
    error: str,
    reason: str,
    *,
    field: str | None = None,
    errors: list[dict[str, str]] | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """The JSON error answer (:class:`~trace_core.api.models.ErrorBody`)."""
    body: dict[str, Any] = {"error": error, "reason": reason, "field": field, "errors": errors}
    return JSONResponse(body, status_code=status, headers=headers)


def field_path(loc: Sequence[str | int]) -> str:
    """``("body", "events", 0, "cursor")`` -> ``events[0].cursor``."""
    parts = list(loc)
    if parts and parts[0] in _SOURCES:
        source = str(parts.pop(0))
        if not parts:
            return source
    path = ""
    for part in parts:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path or "body"


def _reason(error: Any) -> str:
    if error.get("type") == "json_invalid":
        detail = (error.get("ctx") or {}).get("error", "")
        return f"invalid JSON: {detail}".rstrip(": ")
    message = str(error.get("msg", "invalid"))
    return message.removeprefix("Value error, ")


def _validation_errors(errors: Sequence[Any]) -> list[dict[str, str]]:
    found = []
    for error in errors:
        loc = error.get("loc", ())
        if error.get("type") == "json_invalid":
            loc = ("body",)
        found.append({"field": field_path(loc), "reason": _reason(error)})
    return found


def install_error_handlers(app: FastAPI, *, retry_after_seconds: int) -> None:
    """Register the mapping of the module docstring on ``app``."""

    async def validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = _validation_errors(exc.errors())
        first = errors[0] if errors else {"field": "body", "reason": "invalid request"}
        return error_response(
            400, "invalid_request", first["reason"], field=first["field"], errors=errors
        )

    async def invalid_input(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, InvalidInput)
        return error_response(400, "invalid_request", exc.reason, field=exc.field)

    async def configuration(request: Request, exc: Exception) -> JSONResponse:
        return error_response(400, "invalid_request", str(exc))

    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        return error_response(404, "not_found", str(exc))

    async def stale(request: Request, exc: Exception) -> JSONResponse:
        return error_response(409, "stale", str(exc))

    async def transition(request: Request, exc: Exception) -> JSONResponse:
        return error_response(409, "invalid_transition", str(exc))

    async def conflict(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, Conflict)
        return error_response(409, exc.error, exc.reason)

    async def forbidden(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, Forbidden)
        return error_response(403, exc.error, exc.reason)

    async def capability(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, InvalidCapability | CapabilityRefused)
        return capability_error(exc.reason, exc.detail, retry_after_seconds=retry_after_seconds)

    async def duplicate(request: Request, exc: Exception) -> JSONResponse:
        return error_response(409, "conflict", str(exc))

    async def unavailable(request: Request, exc: Exception) -> JSONResponse:
        log.warning("state database unavailable: %s", exc)
        return error_response(
            503,
            "unavailable",
            "the state database is unavailable; retry later",
            headers={"Retry-After": str(retry_after_seconds)},
        )

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        field = "body" if exc.status_code == 400 else None
        return error_response(
            exc.status_code, code, str(exc.detail), field=field, headers=exc.headers
        )

    async def internal(request: Request, exc: Exception) -> JSONResponse:
        # Logged with its traceback here; the caller learns nothing about internals.
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, "internal", "internal error")

    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(InvalidInput, invalid_input)
    app.add_exception_handler(ConfigurationError, configuration)
    app.add_exception_handler(NotFound, not_found)
    app.add_exception_handler(StaleClaim, stale)
    app.add_exception_handler(InvalidTransition, transition)
    app.add_exception_handler(DuplicateItem, duplicate)
    app.add_exception_handler(Conflict, conflict)
    app.add_exception_handler(Forbidden, forbidden)
    app.add_exception_handler(InvalidCapability, capability)
    app.add_exception_handler(CapabilityRefused, capability)
    app.add_exception_handler(DatabaseUnavailable, unavailable)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal)
