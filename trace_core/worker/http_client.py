"""The worker's client of the ``/internal/*`` endpoints, over HTTP.

Same contract as :class:`~trace_core.dispatcher.inprocess_client.InProcessClient` (see
:mod:`trace_core.worker.client` for the error mapping): ``409 {"error":
"stale"}`` and a 404 on a fenced call become
:class:`~trace_core.errors.StaleClaim`; transport errors, 429 and 5xx
become :class:`~trace_core.worker.client.ControlPlaneUnavailable`; 400 becomes
:class:`~trace_core.errors.InvalidInput`; anything else
:class:`~trace_core.worker.client.ControlPlaneRejected`.

httpx is imported lazily (when a client is built), so ``import trace_core``
stays light. The internal token is sent as ``Authorization: Bearer``; it is
never logged, and never put in an exception message.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any

from trace_core.authoring.events import AcceptResult, DatasetEvent
from trace_core.errors import ConfigurationError, InvalidInput, NotFound, StaleClaim
from trace_core.model import Fence
from trace_core.worker.client import (
    ClaimResult,
    ControlPlaneRejected,
    ControlPlaneUnavailable,
    HeartbeatResult,
    task_id_of,
)

if TYPE_CHECKING:
    import httpx


__all__ = ["HttpControlPlaneClient", "json_answer"]

_RETRYABLE_STATUSES = frozenset({429})  # plus every 5xx


class HttpControlPlaneClient:
    """:class:`~trace_core.worker.client.ControlPlaneClient` over HTTP.

    ``http`` is an existing ``httpx.AsyncClient`` to send through (tests pass
    one on an ASGI transport); without it the client owns one with
    ``timeout_seconds`` per request, closed by :meth:`aclose` (or ``async
    with``).
    """

    def __init__(
        self,
        base_url: str,
        internal_token: str,
        *,
        http: httpx.AsyncClient | None = None,
        timeout_seconds: float = 30.0,
    ) -> None:
        if not internal_token or any(c.isspace() for c in internal_token):
            # The token itself is never part of the message.
            raise ConfigurationError("the internal token must be non-empty, without whitespace")
        if timeout_seconds <= 0:
            raise ConfigurationError("HttpControlPlaneClient.timeout_seconds must be > 0")
        self.base_url = base_url.rstrip("/")
        self._auth = {"Authorization": f"Bearer {internal_token}"}
        self._owned = http is None
        if http is None:
            import httpx

            http = httpx.AsyncClient(timeout=timeout_seconds)
        self._http = http

    async def aclose(self) -> None:
        """Close the HTTP client if this object created it."""
        if self._owned:
            await self._http.aclose()

    async def __aenter__(self) -> HttpControlPlaneClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"HttpControlPlaneClient({self.base_url!r})"  # never the token

    # --- the contract ---------------------------------------------------------

    async def claim(self, task_id: uuid.UUID, worker_id: str) -> ClaimResult:
        """``POST /internal/task-claim``."""
        body = await self._post(
            "/internal/task-claim", {"task_id": str(task_id), "worker_id": worker_id}, None
        )
        if body.get("status") != "Claimed":
            return ClaimResult(task_id, reason=str(body.get("reason") or "NotReady"))
        return ClaimResult(
            task_id,
            attempt=int(body["attempt"]),
            lease_token=uuid.UUID(str(body["lease_token"])),
            lease_expires_at=datetime.fromisoformat(str(body["lease_expires_at"])),
            task=dict(body["task"]),
        )

    async def fetch(self, task_id: uuid.UUID) -> dict[str, Any]:
        """``GET /internal/task-fetch?task_id=``."""
        return await self._send("GET", "/internal/task-fetch", None, None, {"task_id": task_id})

    async def heartbeat(self, fence: Fence, capability_token: str | None = None) -> HeartbeatResult:
        """``POST /internal/heartbeat`` (with the capability token to renew, if any)."""
        request = _fence_json(fence)
        if capability_token:
            request["capability_token"] = capability_token
        body = await self._post("/internal/heartbeat", request, task_id_of(fence))
        renewed = body.get("capability_token")
        return HeartbeatResult(
            datetime.fromisoformat(str(body["lease_expires_at"])),
            str(body["directive"]),
            str(renewed) if renewed else None,
        )

    async def emit(
        self, task_id: uuid.UUID, attempt: int, events: Sequence[DatasetEvent]
    ) -> AcceptResult:
        """``POST /internal/events``."""

        body = await self._post(
            "/internal/events",
            {"task_id": str(task_id), "attempt": attempt, "events": [e.to_json() for e in events]},
            task_id,
        )
        return AcceptResult(
            [uuid.UUID(str(i)) for i in body["event_ids"]],
            int(body["new"]),
            int(body["duplicates"]),
        )

    async def complete(
        self,
        fence: Fence,
        events: Sequence[DatasetEvent],
        outputs: Sequence[Mapping[str, Any]] | None,
    ) -> None:
        """``POST /internal/task-complete`` with ``status: Completed`` and the final events."""
        report = {
            **_fence_json(fence),
            "status": "Completed",
            "events": [e.to_json() for e in events],
            "error_message": None,
        }
        if outputs is not None:
            report["outputs"] = [dict(o) for o in outputs]
        await self._post("/internal/task-complete", report, task_id_of(fence))

    async def fail(self, fence: Fence, error: str, retryable: bool) -> None:
        """``POST /internal/task-complete`` with ``status: Failed``."""
        report = {
            **_fence_json(fence),
            "status": "Failed",
            "error_message": error,
            "retryable": retryable,
        }
        await self._post("/internal/task-complete", report, task_id_of(fence))

    async def report_canceled(self, task_id: uuid.UUID, attempt: int) -> None:
        """``POST /internal/task-complete`` with ``status: Canceled``."""
        report = {"task_id": str(task_id), "attempt": attempt, "status": "Canceled"}
        await self._post("/internal/task-complete", report, None)

    # --- transport ------------------------------------------------------------

    async def _post(
        self, path: str, body: Mapping[str, Any], fenced: uuid.UUID | None
    ) -> dict[str, Any]:
        return await self._send("POST", path, body, fenced, None)

    async def _send(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None,
        fenced: uuid.UUID | None,
        params: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        """One request; the answer's JSON object, or the contract's error.

        ``fenced`` is the task id of a fenced call, whose 404 means our claim
        cannot be current (stale) rather than "no such thing".
        """
        import httpx

        try:
            response = await self._http.request(
                method,
                self.base_url + path,
                json=body,
                params={k: str(v) for k, v in (params or {}).items()} or None,
                headers=self._auth,
            )
        except httpx.TransportError as exc:
            raise ControlPlaneUnavailable(f"{method} {path}: {type(exc).__name__}") from exc
        subject = fenced or (params or {}).get("task_id")
        return json_answer(response, f"{method} {path}", fenced=fenced, subject=subject)


def json_answer(
    response: httpx.Response,
    what: str,
    *,
    fenced: uuid.UUID | None = None,
    subject: object = None,
) -> dict[str, Any]:
    """The answer's JSON object, or the contract's error (module docstring).

    ``what`` names the call in messages (``POST /internal/events``);
    ``fenced`` is the task id of a fenced call, whose 404 means our claim
    cannot be current (stale) rather than "no such thing"; ``subject`` is
    the item a ``409 stale`` names (the fenced task by default).
    """
    status = response.status_code
    try:
        answer = response.json()
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        if 400 <= status < 500 and status not in _RETRYABLE_STATUSES:
            raise ControlPlaneRejected(status, "unexpected", f"{what}: no JSON body")
        # A proxy's error page or a cut-off body: the Dispatcher did not answer us.
        raise ControlPlaneUnavailable(
            f"{what}: {status} without a JSON body",
            retry_after=_retry_after(response.headers),
        )
    if status < 300:
        return answer
    error = str(answer.get("error") or "error")
    reason = str(answer.get("reason") or "")
    if status >= 500 or status in _RETRYABLE_STATUSES:
        raise ControlPlaneUnavailable(
            f"{what}: {status} {error}", retry_after=_retry_after(response.headers)
        )
    if status == 409 and error == "stale":
        raise StaleClaim("tasks", subject if subject is not None else fenced, reason)
    if status == 404:
        if fenced is not None:
            raise StaleClaim("tasks", fenced, reason or "no such task")
        raise NotFound(reason or f"{what}: not found")
    if status == 400:
        raise InvalidInput(str(answer.get("field") or "body"), reason)
    raise ControlPlaneRejected(status, error, reason)


def _retry_after(headers: Mapping[str, str]) -> float | None:
    """``Retry-After`` in seconds (the delta form; the date form is ignored)."""
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def _fence_json(fence: Fence) -> dict[str, Any]:
    """The fence as ``/internal/*`` takes it (interface-contracts.md, "Worker ->
    Dispatcher": ``{task_id, attempt, lease_token}``; no ``claim_version``)."""
    return {
        "task_id": str(task_id_of(fence)),
        "attempt": fence.attempt,
        "lease_token": str(fence.lease_token),
    }
