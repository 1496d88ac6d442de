"""The stored-credentials area of the repository port: an inbox job's sealed
storage credentials (euterpe-contract.md §7, §10).

Reached as ``tx.inbox_credentials`` on any
:class:`~trace_core.storage.protocol.Transaction`. Only the envelope is
stored (``storage_creds_encrypted``, ``_dek_wrapped``, ``_kek_id``,
``_encryption_version``); sealing and opening happen above the seam
(:mod:`trace_core.euterpe.credentials`). Every write is guarded so that a
requester's credential refresh and a KEK re-wrap can run at the same time
without either overwriting the other's newer value.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

__all__ = ["InboxCredentialOps", "JobCredentials", "SealedCredentials"]


@dataclass(frozen=True, repr=False)
class SealedCredentials:
    """The four stored column values of one job's sealed credentials.

    ``repr()`` shows sizes and the key id only.
    """

    encrypted: bytes
    """``storage_creds_encrypted``: the credentials sealed under the data key."""
    dek_wrapped: bytes
    """``storage_creds_dek_wrapped``: the data key wrapped by the KEK."""
    kek_id: str
    """``storage_creds_kek_id``: which KEK of the ring wrapped the data key."""
    encryption_version: int
    """``storage_creds_encryption_version``: the sealing format (AAD layout, algorithms)."""

    def __repr__(self) -> str:
        return (
            f"SealedCredentials(encrypted=<{len(self.encrypted)} bytes>, "
            f"dek_wrapped=<{len(self.dek_wrapped)} bytes>, kek_id={self.kek_id!r}, "
            f"encryption_version={self.encryption_version})"
        )


@dataclass(frozen=True)
class JobCredentials:
    """What binds a job's sealed credentials: its id, requester and
    credential version, with the sealed value (None when the job has none)."""

    job_id: uuid.UUID
    requester_id: str
    credential_version: int
    sealed: SealedCredentials | None


class InboxCredentialOps(Protocol):
    """Sealed storage credentials of inbox jobs, inside one transaction."""

    async def read(self, job_id: uuid.UUID) -> JobCredentials | None:
        """The job's requester, credential version and sealed credentials;
        None for an unknown job."""
        ...

    async def replace_if_version(
        self,
        job_id: uuid.UUID,
        *,
        requester_id: str,
        expected_version: int,
        sealed: SealedCredentials,
        now: datetime,
    ) -> bool:
        """A credential refresh: store ``sealed`` and set the job's
        ``credential_version`` to ``expected_version + 1`` only if the job
        belongs to ``requester_id`` and its version is still
        ``expected_version``; whether it wrote. ``sealed`` must have been
        sealed for the new version."""
        ...

    async def sealed_under(
        self, kek_id: str, *, limit: int, after: uuid.UUID | None = None
    ) -> list[JobCredentials]:
        """Up to ``limit`` jobs whose credentials are sealed under ``kek_id``,
        in job id order, starting after job id ``after`` (a batch cursor)."""
        ...

    async def rewrap_if_unchanged(
        self,
        job_id: uuid.UUID,
        *,
        credential_version: int,
        kek_id: str,
        sealed: SealedCredentials,
        now: datetime,
    ) -> bool:
        """Store ``sealed`` (the same credentials under another KEK) only if
        the job still has ``credential_version`` and is still sealed under
        ``kek_id``; whether it wrote. A refresh or another re-wrap in between
        makes it write nothing."""
        ...
