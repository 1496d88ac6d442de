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
from trace_core.dispatcher.capabilities import (
    TASK_TOKEN_AUDIENCE,
    TASK_TOKEN_TTL_SECONDS,
    CapabilityIssuer,
    signing_capability_issuer,
    task_token_verifier,
)
from trace_core.security import TokenVerifier
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
TOKEN_AUDIENCE = TASK_TOKEN_AUDIENCE
TOKEN_TTL_SECONDS = TASK_TOKEN_TTL_SECONDS
CREDENTIAL_SECONDS = 3600
"""How long minted credentials last (STS's role-chaining maximum)."""


def capability_issuer(
    ring: KeyRing, repo: Repository, clock: Clock, storage_root: str
) -> CapabilityIssuer:
    """Signs each claimed attempt's token as ``trace-lite`` (see
    :func:`~trace_core.dispatcher.capabilities.signing_capability_issuer`)."""
    return signing_capability_issuer(ring, repo, clock, storage_root, issuer=TOKEN_ISSUER)


def token_verifier(ring: KeyRing, clock: Clock) -> TokenVerifier:
    """Verifies the tokens :func:`capability_issuer` signs."""
    return task_token_verifier(ring, clock, issuer=TOKEN_ISSUER)


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
