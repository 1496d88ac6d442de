"""An HTTP worker's credential source: ``POST /v1/task/credentials``.

The in-process platform mints an attempt's object-store credentials itself
(a credential broker on the Dispatcher's keys); a worker that talks to the
Dispatcher over HTTP exchanges the attempt's capability token for them
instead. :class:`HttpCredentialSource` is that exchange, a
:data:`~trace_core.worker.wrapper.CredentialSource`: the wrapper calls it at
launch and again with each renewed token, so the task context's credentials
never outlive the token they came from by more than their own duration.

The token travels only in ``X-Trace-Task-Capability``; neither it nor the
credentials are logged or put in an exception message.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from trace_core.errors import ConfigurationError
from trace_core.worker.client import ControlPlaneRejected, ControlPlaneUnavailable

if TYPE_CHECKING:
    import httpx

__all__ = ["CAPABILITY_HEADER", "HttpCredentialSource"]

# The API's contract (trace_core.api.capability and task_models), restated
# here so a worker does not import the server's web framework.
CAPABILITY_HEADER = "X-Trace-Task-Capability"
_PATH = "/v1/task/credentials"
_MIN_SECONDS, _MAX_SECONDS = 900, 3600


class HttpCredentialSource:
    """Credentials for an attempt from ``/v1/task/credentials`` of ``base_url``.

    ``http`` is the worker's ``httpx.AsyncClient``; ``duration_seconds`` how
    long each set lasts (900..3600).
    """

    def __init__(
        self, base_url: str, http: httpx.AsyncClient, *, duration_seconds: int = _MAX_SECONDS
    ) -> None:
        if not _MIN_SECONDS <= duration_seconds <= _MAX_SECONDS:
            raise ConfigurationError(
                "HttpCredentialSource.duration_seconds must be within "
                f"{_MIN_SECONDS}..{_MAX_SECONDS}"
            )
        self.base_url = base_url.rstrip("/")
        self._http = http
        self._duration = duration_seconds

    async def __call__(self, payload: Mapping[str, Any]) -> Mapping[str, str]:
        """Credentials in wire form for the payload's token; none without a token."""
        import httpx

        token = payload.get("capability_token")
        if not token:
            return {}
        body = {
            "task_id": str(payload["task_id"]),
            "attempt": int(payload["attempt"]),
            "duration_seconds": self._duration,
        }
        try:
            response = await self._http.post(
                self.base_url + _PATH, json=body, headers={CAPABILITY_HEADER: str(token)}
            )
        except httpx.TransportError as exc:
            raise ControlPlaneUnavailable(f"POST {_PATH}: {type(exc).__name__}") from exc
        try:
            answer = response.json()
        except ValueError:
            answer = None
        if response.status_code != 200 or not isinstance(answer, dict):
            error = answer.get("error", "error") if isinstance(answer, dict) else "no JSON body"
            reason = answer.get("reason", "") if isinstance(answer, dict) else ""
            if response.status_code >= 500:
                raise ControlPlaneUnavailable(f"POST {_PATH}: {response.status_code} {error}")
            raise ControlPlaneRejected(response.status_code, str(error), str(reason))
        return {
            key: str(answer[key])
            for key in ("access_key_id", "secret_access_key", "session_token", "expiration")
        }
