"""Authorization of task-scoped routes: the task capability token.

``/v1/task/*`` is called by task code, which holds its attempt's capability
token (``X-Trace-Task-Capability``) and never the internal token. Like
:class:`~trace_core.api.auth.InternalAuth`, the check is a pure ASGI
middleware in front of routing and of the body cap: a request under the
prefix without exactly one valid token is answered before its body is read
or anything else looks at it, whatever its path or method. The verified
claims are handed to the route through the request scope
(:func:`task_capability`); the route then binds them to the task and
attempt its body names (:func:`bind_capability`).

Answers: 401 ``{"error": "invalid_capability", "reason": <code>}`` where the
code is an :class:`~trace_core.security.InvalidCapability` reason, or
``missing`` (no header) or ``superseded`` (a newer attempt has started);
503 with ``Retry-After`` when the JWKS cannot be fetched (``jwks_unavailable``).
The token never appears in an answer or a log line.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import Depends, Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from trace_core.api.auth import route_path
from trace_core.security.claims import CapabilityClaims, InvalidCapability
from trace_core.security.verifier import TokenVerifier

__all__ = [
    "CAPABILITY_HEADER",
    "TASK_PREFIX",
    "CapabilityAuth",
    "CapabilityRefused",
    "TaskCapability",
    "bind_capability",
    "capability_error",
    "claims_of",
    "task_capability",
]

CAPABILITY_HEADER = "X-Trace-Task-Capability"
TASK_PREFIX = "/v1/task/"
"""Every path under this prefix is authorized by a capability token only."""

_HEADER = CAPABILITY_HEADER.lower().encode("ascii")
_STATE_KEY = "trace_task_capability"


class CapabilityRefused(Exception):
    """A valid token that does not authorize this request (401, like an invalid one).

    ``reason`` is a short code (``missing``, ``superseded``); ``detail`` is
    fixed text that never quotes the token.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"capability refused ({reason}): {detail}")
        self.reason = reason
        self.detail = detail


def capability_error(reason: str, detail: str, *, retry_after_seconds: int = 1) -> JSONResponse:
    """The answer to a refused capability: 401, or 503 when the JWKS is unavailable."""
    body: dict[str, Any] = {
        "error": "invalid_capability",
        "reason": reason,
        "field": CAPABILITY_HEADER,
        "errors": None,
        "detail": detail,
    }
    if reason == "jwks_unavailable":
        headers = {"Retry-After": str(retry_after_seconds)}
        return JSONResponse(body, status_code=503, headers=headers)
    return JSONResponse(body, status_code=401)


class CapabilityAuth:
    """ASGI middleware: requests under ``prefix`` need one valid capability token."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        verifier: TokenVerifier,
        prefix: str = TASK_PREFIX,
        retry_after_seconds: int = 1,
    ) -> None:
        self.app = app
        self._verifier = verifier
        self._prefix = prefix
        self._retry_after = retry_after_seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Verify the token of a task-scoped request; pass every other request on."""
        if scope["type"] != "http" or not route_path(scope).startswith(self._prefix):
            await self.app(scope, receive, send)
            return
        values = [v for k, v in scope.get("headers", ()) if k == _HEADER]
        if not values:
            refusal = ("missing", f"the {CAPABILITY_HEADER} header is required")
        elif len(values) > 1:
            refusal = ("malformed", f"exactly one {CAPABILITY_HEADER} header is allowed")
        else:
            try:
                claims = await self._verifier.verify(values[0].decode("latin-1").strip())
            except InvalidCapability as exc:
                refusal = (exc.reason, exc.detail)
            else:
                scope.setdefault("state", {})[_STATE_KEY] = claims
                await self.app(scope, receive, send)
                return
        response = capability_error(*refusal, retry_after_seconds=self._retry_after)
        await response(scope, receive, send)


def claims_of(scope: Scope) -> CapabilityClaims:
    """The verified claims :class:`CapabilityAuth` attached to the request of ``scope``."""
    claims = scope.get("state", {}).get(_STATE_KEY)
    if not isinstance(claims, CapabilityClaims):
        # Only reachable if the route was mounted without the middleware.
        raise CapabilityRefused("missing", f"the {CAPABILITY_HEADER} header is required")
    return claims


async def task_capability(request: Request) -> CapabilityClaims:
    """The verified claims :class:`CapabilityAuth` attached to this request.

    A coroutine on purpose: FastAPI runs a plain function dependency in its
    thread pool, a thread hop per request for a dictionary look-up.
    """
    return claims_of(request.scope)


TaskCapability = Annotated[CapabilityClaims, Depends(task_capability)]
"""A route parameter receiving the request's verified capability claims."""


def bind_capability(claims: CapabilityClaims, task_id: uuid.UUID, attempt: int) -> None:
    """Refuse (``wrong_task``) claims of another task or attempt than the body names.

    The same rule as :meth:`~trace_core.security.TokenVerifier.verify_for_task`,
    applied after the token was verified in front of routing.
    """
    if claims.task_id != task_id or claims.attempt != attempt:
        raise InvalidCapability("wrong_task", "the token was issued for another task attempt")
