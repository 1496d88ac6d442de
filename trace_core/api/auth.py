"""Authentication of platform components: the internal bearer token.

Every route needs ``Authorization: Bearer <internal token>`` except an
explicit allow-list (the OpenAPI document). The check is a pure ASGI
middleware in front of routing, so it is deny-by-default: a route added later,
a path that matches no route, a wrong method and a malformed body are all
answered 401 before anything else looks at the request, and nothing about
the API is learnt without the token.

The comparison is :func:`hmac.compare_digest` over bytes; the token is never
logged or echoed.

Task-scoped routes (``/v1/task/*``) are authorized by a task capability
token (dispatcher.md), never by this one: their prefix is in
``public_prefixes`` here, and :class:`~trace_core.api.capability.CapabilityAuth`,
the next middleware, demands and verifies the capability for exactly the
same paths (both decide with :func:`route_path`).
"""

from __future__ import annotations

import hmac
from collections.abc import Collection

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from trace_core.errors import ConfigurationError

__all__ = [
    "MIN_TOKEN_LENGTH",
    "PUBLIC_PATHS",
    "InternalAuth",
    "check_internal_token",
    "route_path",
]

MIN_TOKEN_LENGTH = 16
PUBLIC_PATHS = frozenset({"/openapi.json"})
"""Paths served without the token: the API's description, which holds no data."""


def route_path(scope: Scope) -> str:
    """The path routing will match: ``scope["path"]`` without the app's root path.

    Anything unusual (a different root, a double slash) is left as it is, so
    it matches no public prefix and needs the internal token: failing closed
    is the point.
    """
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return path


def check_internal_token(token: str) -> bytes:
    """Validate a configured internal token; its bytes for comparison.

    The messages never contain the token itself.
    """
    if not isinstance(token, str) or len(token) < MIN_TOKEN_LENGTH:
        raise ConfigurationError(
            f"the internal token must be at least {MIN_TOKEN_LENGTH} characters"
        )
    if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
        raise ConfigurationError(
            "the internal token must be printable ASCII without whitespace (it is sent "
            "in an Authorization header)"
        )
    return token.encode("ascii")


class InternalAuth:
    """ASGI middleware: 401 unless the bearer token matches (see the module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        token: str,
        public_paths: Collection[str] = PUBLIC_PATHS,
        public_prefixes: Collection[str] = (),
    ) -> None:
        self.app = app
        self._expected = b"bearer " + check_internal_token(token)
        self._public_paths = frozenset(public_paths)
        self._public_prefixes = tuple(public_prefixes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass authorized (or public) HTTP requests on; answer 401 to the rest."""
        if scope["type"] != "http" or self._is_public(scope) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = JSONResponse(
            {
                "error": "unauthorized",
                "reason": "a valid 'Authorization: Bearer <internal token>' header is required",
                "field": None,
                "errors": None,
            },
            status_code=401,
            headers={"WWW-Authenticate": 'Bearer realm="trace-internal"'},
        )
        await response(scope, receive, send)

    def _is_public(self, scope: Scope) -> bool:
        path = route_path(scope)
        return path in self._public_paths or path.startswith(self._public_prefixes)

    def _authorized(self, scope: Scope) -> bool:
        values = [v for k, v in scope.get("headers", ()) if k == b"authorization"]
        if len(values) != 1:
            return False  # none, or ambiguous
        presented = values[0].strip()
        # The scheme is case-insensitive (RFC 7235); the token is compared as is.
        scheme, _, credential = presented.partition(b" ")
        candidate = scheme.lower() + b" " + credential.strip()
        return hmac.compare_digest(candidate, self._expected)
