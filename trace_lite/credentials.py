"""Capability tokens and scoped credentials for the lite profile's tasks.

:func:`capability_issuer` is how ``trace-lite serve`` and the in-process
platform sign every claimed attempt's capability token (issuer
``trace-lite``, audience ``trace-task``, a scratch prefix per attempt under
the storage root). :class:`CredentialBroker` is the in-process runner's
credential source: it verifies the attempt's token like
``/v1/task/credentials`` does and mints object-store credentials for exactly
the token's scope, so in-process operators get the same confinement an
HTTP worker gets.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from trace_core.clock import Clock
from trace_core.dispatcher.capabilities import CapabilityIssuer
from trace_core.security import TokenIssuer, TokenVerifier
from trace_core.security.jwks import KeyRing
from trace_core.security.minting import CredentialMinter
from trace_core.storage.protocol import Repository

__all__ = [
    "TOKEN_AUDIENCE",
    "TOKEN_ISSUER",
    "TOKEN_TTL_SECONDS",
    "CredentialBroker",
    "capability_issuer",
    "token_verifier",
]

TOKEN_ISSUER = "trace-lite"
TOKEN_AUDIENCE = "trace-task"
TOKEN_TTL_SECONDS = 3600
"""Capability tokens last an hour (the key ring's default retention covers it)."""
CREDENTIAL_SECONDS = 3600
"""How long minted credentials last (STS's role-chaining maximum)."""


def capability_issuer(
    ring: KeyRing, repo: Repository, clock: Clock, storage_root: str
) -> CapabilityIssuer:
    """Signs each claimed attempt's token; scratch under ``<root>{org}/scratch/``.

    It verifies the tokens heartbeats present for renewal against the same
    ring (:meth:`~trace_core.dispatcher.capabilities.CapabilityIssuer.refresh`).
    """
    root = storage_root if storage_root.endswith("/") else storage_root + "/"
    return CapabilityIssuer(
        TokenIssuer(ring, TOKEN_ISSUER, TOKEN_AUDIENCE, TOKEN_TTL_SECONDS, clock),
        repo=repo,
        scratch_template=root + "{org}/scratch/{task_id}/{attempt}/",
        verifier=token_verifier(ring, clock),
    )


def token_verifier(ring: KeyRing, clock: Clock) -> TokenVerifier:
    """Verifies the tokens :func:`capability_issuer` signs."""
    return TokenVerifier(ring, TOKEN_ISSUER, TOKEN_AUDIENCE, clock)


class CredentialBroker:
    """Mints an attempt's object-store credentials from its capability token."""

    def __init__(self, verifier: TokenVerifier, minter: CredentialMinter) -> None:
        self.verifier = verifier
        self.minter = minter

    async def __call__(self, payload: Mapping[str, Any]) -> Mapping[str, str]:
        """Credentials in wire form; none when the attempt has no token."""
        token = payload.get("capability_token")
        if not token:
            return {}
        task_id, attempt = uuid.UUID(str(payload["task_id"])), int(payload["attempt"])
        claims = await self.verifier.verify_for_task(str(token), task_id, attempt)
        minted = await self.minter.mint(
            claims.scope(),
            session_name=f"task-{task_id.hex}-{attempt}",
            duration_seconds=CREDENTIAL_SECONDS,
        )
        return {
            "access_key_id": minted.access_key_id,
            "secret_access_key": minted.secret_access_key,
            "session_token": minted.session_token,
            "expiration": minted.expiration.isoformat(),
        }
