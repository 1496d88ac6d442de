"""Operator state over the control plane: :class:`HttpOperatorState`.

The :class:`~trace_core.authoring.state.OperatorStateAccess` of a worker that
holds no database credentials: reads and versioned writes go to
``POST /v1/task/state/read`` and ``/write`` with the capability token of the
attempt the calling operator runs for (:func:`~trace_core.worker.current.current_context`,
so a renewed token is used as soon as the wrapper adopts it). The server
acts on the token's job only and only while the attempt holds its lease.

Errors: the contract's mapping (:func:`~trace_core.worker.http_client.json_answer`):
``409 stale`` is :class:`~trace_core.errors.StaleClaim` (the wrapper then
treats the attempt as lost), ``409 conflict`` is
:class:`~trace_core.authoring.state.StateConflict`, 400 is
:class:`~trace_core.errors.InvalidInput` naming the field; an outage is
retried by an :class:`~trace_core.worker.retrying.OutageRetry`. A write whose
answer was lost is sent again and, as it did land, refused as a conflict:
the operator re-reads, as after any conflict. The token travels only in
``X-Trace-Task-Capability`` and is never logged or put in a message.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from trace_core.authoring.context import TaskContext
from trace_core.authoring.state import DEFAULT_STATE_KEY, StateConflict, StateSnapshot
from trace_core.errors import ConfigurationError, InvalidInput
from trace_core.worker.client import ControlPlaneUnavailable
from trace_core.worker.current import current_context
from trace_core.worker.http_client import json_answer
from trace_core.worker.http_credentials import CAPABILITY_HEADER
from trace_core.worker.retrying import OutageRetry

if TYPE_CHECKING:
    import httpx

__all__ = ["HttpOperatorState"]

_READ = "/v1/task/state/read"
_WRITE = "/v1/task/state/write"


class HttpOperatorState:
    """:class:`~trace_core.authoring.state.OperatorStateAccess` over ``base_url``.

    ``http`` is the worker's ``httpx.AsyncClient`` (without one, each call
    opens its own with ``timeout_seconds``); ``retry`` rides out outages
    (the default budget of :class:`~trace_core.worker.retrying.OutageRetry`);
    ``attempt`` finds the calling operator's task context (tests pass one).
    """

    def __init__(
        self,
        base_url: str,
        http: httpx.AsyncClient | None = None,
        *,
        retry: OutageRetry | None = None,
        timeout_seconds: float = 30.0,
        attempt: Callable[[], TaskContext | None] = current_context,
    ) -> None:
        if timeout_seconds <= 0:
            raise ConfigurationError("HttpOperatorState.timeout_seconds must be > 0")
        self.base_url = base_url.rstrip("/")
        self._http = http
        self._retry = retry or OutageRetry()
        self._timeout = timeout_seconds
        self._attempt = attempt

    def __repr__(self) -> str:
        return f"HttpOperatorState({self.base_url!r})"

    async def get(
        self, org_id: uuid.UUID, job_id: uuid.UUID, state_key: str = DEFAULT_STATE_KEY
    ) -> StateSnapshot | None:
        """The state ``state_key`` of the calling attempt's job (``org_id`` and
        ``job_id`` must be that job's), or ``None`` if there is none."""
        ctx = self._context(org_id, job_id)
        body = {"task_id": str(ctx.task_id), "attempt": ctx.attempt, "state_key": state_key}
        answer = await self._retry(
            f"POST {_READ}", lambda: self._post(_READ, body, ctx, (org_id, job_id, None))
        )
        state, version = answer.get("state"), answer.get("version")
        if state is None or version is None:
            return None
        return StateSnapshot(dict(state), int(version))

    async def put(
        self,
        org_id: uuid.UUID,
        job_id: uuid.UUID,
        state: Mapping[str, Any],
        *,
        state_key: str = DEFAULT_STATE_KEY,
        expected_version: int | None,
    ) -> StateSnapshot:
        """Write ``state`` if the stored version is ``expected_version``
        (``None``: create); the new snapshot, or :class:`StateConflict`."""
        if not isinstance(state, Mapping):
            raise ConfigurationError(
                f"operator state must be a mapping, got {type(state).__name__}"
            )
        ctx = self._context(org_id, job_id)
        value = dict(state)
        body = {
            "task_id": str(ctx.task_id),
            "attempt": ctx.attempt,
            "state_key": state_key,
            "state": value,
            "expected_version": expected_version,
        }
        answer = await self._retry(
            f"POST {_WRITE}",
            lambda: self._post(_WRITE, body, ctx, (org_id, job_id, expected_version)),
        )
        return StateSnapshot(value, int(answer["version"]))

    def _context(self, org_id: uuid.UUID, job_id: uuid.UUID) -> TaskContext:
        """The calling attempt's context, for the job it names."""
        ctx = self._attempt()
        if ctx is None:
            raise ConfigurationError(
                "operator state over HTTP is reachable only from an operator a worker runs"
            )
        if ctx.capability_token is None:
            raise ConfigurationError(
                f"task {ctx.task_id} attempt {ctx.attempt} has no capability token: "
                "its operator state is not reachable over HTTP"
            )
        # The server answers for the token's job whatever is named; naming
        # another job is a bug of the operator, not a request to send.
        if (str(org_id), str(job_id)) != (str(ctx.job.get("org_id")), str(ctx.job.get("id"))):
            raise InvalidInput("job_id", "an attempt reaches only its own job's operator state")
        return ctx

    async def _post(
        self,
        path: str,
        body: Mapping[str, Any],
        ctx: TaskContext,
        conflict: tuple[uuid.UUID, uuid.UUID, int | None],
    ) -> dict[str, Any]:
        import httpx

        # Read per try: a heartbeat may have renewed the token meanwhile.
        headers = {CAPABILITY_HEADER: str(ctx.capability_token)}
        try:
            if self._http is not None:
                response = await self._http.post(self.base_url + path, json=body, headers=headers)
            else:
                async with httpx.AsyncClient(timeout=self._timeout) as http:
                    response = await http.post(self.base_url + path, json=body, headers=headers)
        except httpx.TransportError as exc:
            raise ControlPlaneUnavailable(f"POST {path}: {type(exc).__name__}") from exc
        if response.status_code == 409:
            _raise_conflict(response, body, conflict)
        return json_answer(response, f"POST {path}", fenced=ctx.task_id)


def _raise_conflict(
    response: httpx.Response,
    body: Mapping[str, Any],
    conflict: tuple[uuid.UUID, uuid.UUID, int | None],
) -> None:
    """Raise :class:`StateConflict` for a ``409 conflict`` answer (others pass)."""
    try:
        answer = response.json()
    except ValueError:
        return
    if not isinstance(answer, dict) or answer.get("error") != "conflict":
        return
    org_id, job_id, expected = conflict
    actual = answer.get("actual_version")
    raise StateConflict(
        org_id,
        job_id,
        str(body["state_key"]),
        expected,
        actual if isinstance(actual, int) else None,
    )
