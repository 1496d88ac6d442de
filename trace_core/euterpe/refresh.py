"""The worker's call to a requester's ``refresh_url`` (euterpe-contract.md §7 step 1).

When the object store refuses a job's credentials (401/403), the worker asks
the requester for new ones: a ``POST`` to the job's ``refresh_url`` whose
body is the canonical JSON ``{"credential_version": N, "job_id": "…"}`` (the
version the worker holds), signed like a webhook. The signing is injected
(:data:`RefreshSigner`: the requester's derived secret and the four
``x-euterpe-*`` headers of §8), so this module depends on no particular
signer. The requester answers by replacing the credentials, which bumps
``credential_version``; the worker then re-reads the job and goes on only if
the version advanced (:mod:`trace_core.euterpe.worker_job`). The answer of
the call itself is informative only: a requester may refresh asynchronously.

The URL passed the intake's :class:`~trace_core.euterpe.requests.UrlPolicy`;
the host's resolved addresses are checked again here before connecting (a
name can resolve elsewhere after validation), and redirects are not followed.
Nothing secret is logged: the body holds a job id and a version only.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trace_core.errors import ConfigurationError
from trace_core.euterpe.events import NormalizedError
from trace_core.euterpe.requests import UrlPolicy
from trace_core.euterpe.storage_access import TransferFailed

if TYPE_CHECKING:
    import httpx

__all__ = [
    "CredentialRefresher",
    "CredentialsNotRefreshed",
    "RefreshAnswer",
    "RefreshSigner",
    "refresh_body",
]

_log = logging.getLogger(__name__)

RefreshSigner = Callable[[str, bytes], Mapping[str, str]]
"""``sign(requester_id, body) -> headers``: the webhook signature headers of
``body`` under ``requester_id``'s secret."""


class CredentialsNotRefreshed(TransferFailed):
    """The store refused the credentials and no newer ones came (§7): the job
    backs off within its refresh budget, then fails with this error."""

    def __init__(self, message: str) -> None:
        super().__init__(
            NormalizedError("credentials_not_refreshed", message, False, http_status=403)
        )


@dataclass(frozen=True)
class RefreshAnswer:
    """How a refresh call went (informative: the job's version is what counts)."""

    status: int | None
    """The HTTP status, or None when no answer came."""
    detail: str


def refresh_body(job_id: uuid.UUID, credential_version: int) -> bytes:
    """The exact bytes posted (and signed) for a refresh of ``job_id``."""
    document = {"credential_version": credential_version, "job_id": str(job_id)}
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


class CredentialRefresher:
    """Posts signed refresh requests (module docstring).

    ``http`` is an ``httpx.AsyncClient`` to send through (tests); without one
    each call uses its own with ``timeout_seconds``.
    """

    def __init__(
        self,
        sign: RefreshSigner,
        *,
        url_policy: UrlPolicy,
        timeout_seconds: float = 10.0,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        if timeout_seconds <= 0:
            raise ConfigurationError("CredentialRefresher.timeout_seconds must be > 0")
        self.sign = sign
        self.url_policy = url_policy
        self.timeout_seconds = timeout_seconds
        self._http = http

    async def request(
        self, url: str, *, requester_id: str, job_id: uuid.UUID, credential_version: int
    ) -> RefreshAnswer:
        """Ask ``url`` for credentials newer than ``credential_version``;
        never raises for the requester's failures (the caller re-reads the
        job's version either way)."""
        import httpx

        refused = await self.url_policy.refusal_when_connecting(url, "refresh_url")
        if refused is not None:
            _log.warning("euterpe: refresh of job %s not sent: %s", job_id, refused)
            return RefreshAnswer(None, refused)
        body = refresh_body(job_id, credential_version)
        headers = {"content-type": "application/json", **self.sign(requester_id, body)}
        try:
            if self._http is not None:
                response = await self._http.post(url, content=body, headers=headers)
            else:
                async with httpx.AsyncClient(
                    timeout=self.timeout_seconds, follow_redirects=False
                ) as client:
                    response = await client.post(url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            detail = f"no answer ({type(exc).__name__})"
            _log.warning("euterpe: refresh of job %s: %s", job_id, detail)
            return RefreshAnswer(None, detail)
        _log.info("euterpe: refresh of job %s answered %d", job_id, response.status_code)
        return RefreshAnswer(response.status_code, f"answered {response.status_code}")
