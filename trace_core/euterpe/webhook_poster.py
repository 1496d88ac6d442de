"""How the deliverer sends one webhook: the :class:`WebhookPoster` port and
its HTTP implementation on ``httpx`` (imported when a poster is built, so
``import trace_core`` does not need it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from trace_core.errors import ConfigurationError
from trace_core.euterpe.requests import UrlPolicy

if TYPE_CHECKING:
    import httpx

__all__ = ["HttpxPoster", "PostResult", "WebhookPoster"]


@dataclass(frozen=True)
class PostResult:
    """The receiver's answer: its HTTP status, or ``None`` with the transport
    error (timeout, refused connection …) when no answer came."""

    status: int | None
    error: str | None = None

    @property
    def delivered(self) -> bool:
        """A 2xx answer: the receiver has the event."""
        return self.status is not None and 200 <= self.status < 300


class WebhookPoster(Protocol):
    """Posts one signed body; never raises for an answer or a transport failure."""

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> PostResult:
        """POST ``body`` with ``headers`` to ``url``; the answer or the failure."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...


class HttpxPoster:
    """:class:`WebhookPoster` on one ``httpx.AsyncClient``: keep-alive
    connections reused across deliveries, a connect and a total timeout,
    no redirects followed (a redirect answer is a 3xx, classified like any
    other non-2xx), and the answer's body left unread beyond what httpx
    buffers (a receiver's answer is not interpreted). With ``url_policy``,
    a URL whose host now resolves to an address the policy refuses is not
    called (:meth:`~trace_core.euterpe.requests.UrlPolicy.refusal_when_connecting`):
    the answer is "no answer", retried and in the end dead-lettered."""

    def __init__(
        self,
        *,
        timeout_seconds: float = 10.0,
        connect_timeout_seconds: float = 5.0,
        max_connections: int = 20,
        client: httpx.AsyncClient | None = None,
        url_policy: UrlPolicy | None = None,
    ) -> None:
        if timeout_seconds <= 0 or connect_timeout_seconds <= 0:
            raise ConfigurationError("HttpxPoster timeouts must be > 0")
        if client is None:
            import httpx

            client = httpx.AsyncClient(
                timeout=httpx.Timeout(timeout_seconds, connect=connect_timeout_seconds),
                limits=httpx.Limits(
                    max_connections=max_connections, max_keepalive_connections=max_connections
                ),
                follow_redirects=False,
            )
        self._client = client
        self._policy = url_policy

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> PostResult:
        import httpx

        if self._policy is not None:
            refused = await self._policy.refusal_when_connecting(url, "status_webhook_url")
            if refused is not None:
                return PostResult(None, refused)
        try:
            response = await self._client.post(url, content=body, headers=dict(headers))
        except httpx.TimeoutException as exc:
            return PostResult(None, f"timeout ({type(exc).__name__})")
        except httpx.HTTPError as exc:
            # The message of a transport error names the host, never the headers.
            return PostResult(None, f"{type(exc).__name__}: {exc}"[:300])
        return PostResult(response.status_code)

    async def aclose(self) -> None:
        await self._client.aclose()
