"""The request body cap: a body over the limit is answered 413 before parsing.

A declared ``Content-Length`` over the cap is refused without reading; a
chunked body is read up to the cap and refused as soon as it passes it. The
accepted body is then replayed to the application, which never sees a body
it could not afford to parse.
"""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["BodyLimit", "replaying"]


def _error(status: int, error: str, reason: str) -> JSONResponse:
    body = {"error": error, "reason": reason, "field": "body", "errors": None}
    return JSONResponse(body, status_code=status)


class BodyLimit:
    """ASGI middleware capping request bodies at ``max_bytes``."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read (at most the cap of) the body, then run the app on the buffered body."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = [v for k, v in scope.get("headers", ()) if k == b"content-length"]
        if declared:
            if len(declared) > 1 or not declared[0].strip().isdigit():
                bad = _error(400, "invalid_request", "malformed Content-Length header")
                await bad(scope, receive, send)
                return
            if int(declared[0]) > self.max_bytes:
                await self._too_large()(scope, receive, send)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                # The client left before sending its body: nothing to answer.
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large()(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, replaying(b"".join(chunks), receive), send)

    def _too_large(self) -> JSONResponse:
        # Built only when answered: a response object per request was a
        # measurable share of a hot request's CPU.
        return _error(
            413, "payload_too_large", f"request bodies are limited to {self.max_bytes} bytes"
        )


def replaying(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` (read already, whole) once, then
    what ``receive`` gives (the client's disconnect)."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
