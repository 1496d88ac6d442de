"""A light dispatch for the worker's hot routes, in front of FastAPI's router.

A worker's claim -> heartbeat -> complete triple is the control plane's
busiest traffic, and FastAPI's per-request machinery (router scan, exit
stacks, dependency solving, response re-validation) costs about as much
server CPU as the route's own work. :class:`HotRoutes` is an ASGI middleware
that answers exactly the routes of :data:`HOT_PATHS` itself, with what it
derives from their FastAPI routes: the body's field validates the request,
the endpoint function runs, the response field serializes the answer. Every
route stays registered with FastAPI (the OpenAPI document is unchanged),
and the middleware sits inside the authentication middlewares and the body
cap, so a hot request is authorized and capped exactly as before.

The fast path takes only the well-formed request: ``POST``, the content type
``application/json``, a JSON body that passes validation. Anything else, a
malformed body included, is handed to FastAPI unchanged (with the body
already read replayed), so every 400 reads exactly as it always did. An
exception raised by the endpoint is answered by the app's own exception
handlers, looked up as Starlette looks them up; one with no handler (a bug)
propagates to the outer server-error middleware, as it does from a route.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi.datastructures import DefaultPlaceholder
from fastapi.exceptions import ResponseValidationError
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from trace_core.api.auth import route_path
from trace_core.api.capability import claims_of, task_capability
from trace_core.api.limits import replaying

__all__ = ["HOT_PATHS", "HotRoutes", "hot_routes"]

HOT_PATHS = frozenset(
    {
        "/internal/task-claim",
        "/internal/heartbeat",
        "/internal/task-complete",
        "/internal/events",
        "/v1/task/heartbeat",
        "/v1/task/complete",
        "/v1/task/events",
        "/internal/worker/claim",
        "/internal/worker/heartbeat",
        "/internal/worker/complete",
        "/internal/worker/fail",
    }
)
"""The worker's per-task routes (``POST``), answered by :class:`HotRoutes`."""

_JSON = b"application/json"
_HEADERS_JSON = (b"content-type", _JSON)
ExceptionHandler = Callable[[Request, Any], Response | Awaitable[Response]]


@dataclass(frozen=True)
class _Hot:
    """What the light dispatch needs of one FastAPI route."""

    route: APIRoute
    body_name: str
    claims_name: str | None

    async def answer(self, scope: Scope, payload: Any) -> Response | bytes | None:
        """The endpoint's answer to ``payload`` (JSON bytes, or a response the
        endpoint built), or ``None`` when the payload does not validate."""
        route = self.route
        assert route.body_field is not None  # checked by hot_routes()
        value, errors = route.body_field.validate(payload, {}, loc=("body",))
        if errors:
            return None
        arguments = {self.body_name: value}
        if self.claims_name is not None:
            arguments[self.claims_name] = claims_of(scope)
        result = await route.endpoint(**arguments)
        if isinstance(result, Response):
            return result
        field = route.response_field
        assert field is not None  # checked by hot_routes()
        checked, problems = field.validate(result, {}, loc=("response",))
        if problems:
            # A bug, answered 500 by the server-error middleware, as FastAPI does.
            raise ResponseValidationError(errors=problems, body=result)
        content: bytes = field.serialize_json(checked, by_alias=True)
        return content


def hot_routes(routes: Iterable[Any]) -> dict[str, _Hot]:
    """The routes of :data:`HOT_PATHS` among ``routes`` (an ``APIRouter``'s,
    whose paths carry its prefix), by path.

    Only a route of the plain shape is taken: ``POST``, one JSON body model,
    at most the capability dependency, a response model and FastAPI's default
    response settings. A hot path whose route has another shape is left to
    FastAPI, so a later change of a route can make it slower, never wrong.
    Dependencies given to ``include_router`` itself are not seen here:
    :func:`~trace_core.api.app.create_app` includes these routers without any.
    """
    found: dict[str, _Hot] = {}
    for route in routes:
        if not isinstance(route, APIRoute) or route.path not in HOT_PATHS:
            continue
        hot = _plain(route)
        if hot is not None:
            found[route.path] = hot
    return found


def _plain(route: APIRoute) -> _Hot | None:
    dependant = route.dependant
    if (
        route.methods != {"POST"}
        or route.body_field is None
        or route.response_field is None
        or len(dependant.body_params) != 1
        or dependant.path_params
        or dependant.query_params
        or dependant.header_params
        or dependant.cookie_params
        or dependant.request_param_name
        or dependant.response_param_name
        or dependant.background_tasks_param_name
        or route.dependencies
        or route.status_code not in (None, 200)
        or route.response_model_include is not None
        or route.response_model_exclude is not None
        or not route.response_model_by_alias
        or route.response_model_exclude_unset
        or route.response_model_exclude_defaults
        or route.response_model_exclude_none
        or not isinstance(route.response_class, DefaultPlaceholder)
    ):
        return None
    claims_name: str | None = None
    for sub in dependant.dependencies:
        if sub.call is not task_capability or claims_name is not None or sub.name is None:
            return None
        claims_name = sub.name
    return _Hot(route, dependant.body_params[0].name, claims_name)


class HotRoutes:
    """ASGI middleware: :data:`HOT_PATHS` answered without FastAPI's router
    (module docstring); every other request passes on untouched."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        routes: Mapping[str, _Hot],
        handlers: Mapping[Any, ExceptionHandler],
    ) -> None:
        self.app = app
        self._routes = dict(routes)
        # As Starlette's ExceptionMiddleware: the catch-all belongs to the outer
        # server-error middleware, which answers 500 and re-raises.
        self._handlers = {
            key: handler
            for key, handler in handlers.items()
            if isinstance(key, type) and key is not Exception
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer a well-formed hot request; pass every other one on."""
        hot = None
        if scope["type"] == "http" and scope["method"] == "POST":
            hot = self._routes.get(route_path(scope))
        if hot is None or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        body, receive = await _read_body(receive)
        if body is None:
            return  # the client left before sending its body
        try:
            payload = json.loads(body)
        except ValueError:
            await self.app(scope, receive, send)  # FastAPI's JSON error, verbatim
            return
        try:
            answer = await hot.answer(scope, payload)
        except Exception as exc:
            handler = self._handler(exc)
            if handler is None:
                raise
            handled = handler(Request(scope, receive), exc)
            answer = await handled if inspect.isawaitable(handled) else handled
        if answer is None:
            await self.app(scope, receive, send)  # FastAPI's validation error, verbatim
        elif isinstance(answer, Response):
            await answer(scope, receive, send)
        else:
            await _send_json(send, answer)

    def _handler(self, exc: Exception) -> ExceptionHandler | None:
        for kind in type(exc).__mro__:
            handler = self._handlers.get(kind)
            if handler is not None:
                return handler
        return None


def _is_json(scope: Scope) -> bool:
    types = [v for k, v in scope["headers"] if k == b"content-type"]
    return len(types) == 1 and types[0].strip().lower() == _JSON


async def _read_body(receive: Receive) -> tuple[bytes | None, Receive]:
    """The whole request body (``None`` if the client left first) and a
    ``receive`` that replays it to whoever reads the request next."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None, receive
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            body = b"".join(chunks)
            return body, replaying(body, receive)


async def _send_json(send: Send, content: bytes) -> None:
    headers = [(b"content-length", str(len(content)).encode("ascii")), _HEADERS_JSON]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": content})
