"""Enqueueing a transcode: what ``POST /transcode`` does (euterpe-contract.md §6, §9, §10).

:meth:`Intake.enqueue` runs, in this order and before anything is stored:
authenticate the API key (:class:`~trace_core.euterpe.api_keys.ApiKeyRefused`,
401), check the ``Idempotency-Key`` (400), validate the body
(:class:`~trace_core.errors.InvalidInput` naming the field, 400). Then it
claims ``(euterpe-enqueue:<requester_id>, key)`` in
:class:`~trace_core.idempotency.IdempotencyStore` with the request hash
(:func:`~trace_core.euterpe.requests.request_hash`): the same key and hash
replay the stored ``job_id``; another hash is
:class:`~trace_core.errors.IdempotencyConflict` (422 in the IETF draft);
a key whose first request is still running is
:class:`~trace_core.errors.IdempotencyInFlight` (409). Only the first
request seals the credentials (under a new job id, credential version 0) and
inserts the job, in one transaction with the idempotency record's
completion; if that fails the key is released, so a retry can proceed.

The job insert belongs to the inbox area; this module codes against the
small :class:`JobEnqueuer` port and the composition root plugs the real one.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import anyio

from trace_core.clock import Clock, SystemClock
from trace_core.errors import ConfigurationError, InvalidInput
from trace_core.euterpe.api_keys import ApiKeys
from trace_core.euterpe.credentials import (
    INITIAL_CREDENTIAL_VERSION,
    CredentialVault,
    SealedCredentials,
)
from trace_core.euterpe.requests import UrlPolicy, parse_transcode_request, request_hash
from trace_core.idempotency import IdempotencyStore
from trace_core.storage.protocol import Repository, Transaction

__all__ = [
    "ENQUEUE_SCOPE_PREFIX",
    "IDEMPOTENCY_HEADER",
    "EnqueueResult",
    "Intake",
    "JobEnqueuer",
    "enqueue_scope",
]

_log = logging.getLogger(__name__)

ENQUEUE_SCOPE_PREFIX = "euterpe-enqueue:"
IDEMPOTENCY_HEADER = "Idempotency-Key"


def enqueue_scope(requester_id: str) -> str:
    """The idempotency scope of a requester's enqueues (§9: ``(requester_id, key)``)."""
    return ENQUEUE_SCOPE_PREFIX + requester_id


class JobEnqueuer(Protocol):
    """Inserts a new ``queued`` inbox job (the inbox area's use case)."""

    async def enqueue(
        self,
        tx: Transaction,
        *,
        job_id: uuid.UUID,
        requester_id: str,
        request: dict[str, Any],
        status_webhook_url: str | None,
        refresh_url: str | None,
        sealed: SealedCredentials,
        max_attempts: int,
    ) -> object:
        """Insert job ``job_id`` in ``tx`` (with its history and first event,
        if the inbox area writes them); ``request`` holds no credentials. What
        it returns (the inbox service returns the job id) is not used."""
        ...


@dataclass(frozen=True)
class EnqueueResult:
    """The answer to an accepted enqueue: 202 with ``job_id``."""

    job_id: uuid.UUID
    requester_id: str
    replayed: bool
    """True when this is the stored answer of an earlier identical request."""


class Intake:
    """The enqueue use case (see the module docstring)."""

    def __init__(
        self,
        repo: Repository,
        *,
        keys: ApiKeys,
        vault: CredentialVault,
        enqueuer: JobEnqueuer,
        idempotency: IdempotencyStore,
        url_policy: UrlPolicy,
        max_attempts: int = 5,
        clock: Clock | None = None,
    ) -> None:
        if not 1 <= max_attempts <= 100:
            raise ConfigurationError("Intake.max_attempts must be 1..100")
        self.repo = repo
        self.keys = keys
        self.vault = vault
        self.enqueuer = enqueuer
        self.idempotency = idempotency
        self.url_policy = url_policy
        self.max_attempts = max_attempts
        self.clock = clock or SystemClock()

    async def enqueue(
        self,
        *,
        api_key: str | None,
        idempotency_key: str | None,
        body: bytes | str | Mapping[str, Any],
    ) -> EnqueueResult:
        """Accept one ``POST /transcode`` (see the module docstring)."""
        requester_id = await self.keys.authenticate(api_key)
        if idempotency_key is None:
            raise InvalidInput(IDEMPOTENCY_HEADER, "is required")
        try:
            IdempotencyStore.validate_key(idempotency_key)
        except ConfigurationError as exc:
            raise InvalidInput(
                IDEMPOTENCY_HEADER, str(exc).removeprefix("idempotency key ")
            ) from None
        request = parse_transcode_request(body, policy=self.url_policy)
        credentials = request.storage_credentials.to_credentials()
        if credentials.expiration is not None and credentials.expiration <= self.clock.now():
            raise InvalidInput("storage_credentials.expiration", "is in the past")

        scope, digest = enqueue_scope(requester_id), request_hash(request)
        replay = await self.idempotency.begin(scope, idempotency_key, digest)
        if not replay.first:
            return EnqueueResult(uuid.UUID(replay.response["job_id"]), requester_id, True)

        job_id = uuid.uuid4()
        try:
            sealed = await self.vault.aseal(
                credentials,
                job_id=job_id,
                requester_id=requester_id,
                credential_version=INITIAL_CREDENTIAL_VERSION,
            )
            async with self.repo.transaction() as tx:
                await self.enqueuer.enqueue(
                    tx,
                    job_id=job_id,
                    requester_id=requester_id,
                    request=request.job_request(),
                    status_webhook_url=request.status_webhook_url,
                    refresh_url=request.refresh_url,
                    sealed=sealed,
                    max_attempts=self.max_attempts,
                )
                await self.idempotency.complete(
                    scope, idempotency_key, digest, {"job_id": str(job_id)}, tx=tx
                )
        except BaseException:
            # Nothing was committed: free the key so the client's retry runs
            # (shielded: a cancelled request must still let go of its key).
            with anyio.CancelScope(shield=True):
                await self.idempotency.release(scope, idempotency_key, digest)
            raise
        _log.info("enqueued transcode job %s for requester %s", job_id, requester_id)
        return EnqueueResult(job_id, requester_id, False)
