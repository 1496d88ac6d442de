"""The API-key area of the repository port: Euterpe's requester keys.

Reached as ``tx.api_keys`` on any :class:`~trace_core.storage.protocol.Transaction`.
Only a SHA-256 digest of each key is stored (``euterpe_api_keys.key_digest``,
unique); the key itself never reaches the database. A revoked key keeps its
row for audit.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

__all__ = ["ApiKeyOps", "ApiKeyRecord", "DigestMatch"]


@dataclass(frozen=True)
class ApiKeyRecord:
    """One key as operators see it: never the key, never its digest."""

    key_id: uuid.UUID
    requester_id: str
    label: str | None
    created_at: datetime
    revoked_at: datetime | None


@dataclass(frozen=True)
class DigestMatch:
    """The key whose stored digest equals the one looked up, with that digest
    (for the caller's constant-time comparison)."""

    key: ApiKeyRecord
    key_digest: str


class ApiKeyOps(Protocol):
    """Requester API keys, inside one transaction."""

    async def insert_key(
        self,
        key_id: uuid.UUID,
        *,
        requester_id: str,
        key_digest: str,
        label: str | None,
        now: datetime,
    ) -> None:
        """Store a new active key created at ``now``. A digest already stored
        raises :class:`~trace_core.errors.DuplicateItem` (nothing written)."""
        ...

    async def find_by_digest(self, key_digest: str) -> DigestMatch | None:
        """The key stored with exactly ``key_digest``, revoked or not; None
        when there is none."""
        ...

    async def revoke_if_active(
        self, key_id: uuid.UUID, *, requester_id: str | None, now: datetime
    ) -> bool:
        """Mark ``key_id`` revoked at ``now`` if it is not revoked yet (and
        belongs to ``requester_id`` when one is given); whether it wrote. A
        revoked key's first revocation time is kept."""
        ...

    async def list_keys(self, requester_id: str | None = None) -> list[ApiKeyRecord]:
        """Every key (of ``requester_id`` when given), revoked ones included,
        oldest first (ties by id)."""
        ...
