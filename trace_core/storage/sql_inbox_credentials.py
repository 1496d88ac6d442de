"""The stored-credentials area (:mod:`trace_core.storage.ports.inbox_credentials`)
in SQL, for both engines."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from trace_core.storage import schema
from trace_core.storage.ports.inbox_credentials import JobCredentials, SealedCredentials
from trace_core.storage.sql_area import SqlArea

__all__ = ["SqlInboxCredentialOps"]

_J = schema.inbox_jobs
_COLUMNS = (
    _J.c.id,
    _J.c.requester_id,
    _J.c.credential_version,
    _J.c.storage_creds_encrypted,
    _J.c.storage_creds_dek_wrapped,
    _J.c.storage_creds_kek_id,
    _J.c.storage_creds_encryption_version,
)


def _record(row: Any) -> JobCredentials:
    sealed = None
    if row[3] is not None and row[4] is not None and row[5] is not None and row[6] is not None:
        sealed = SealedCredentials(bytes(row[3]), bytes(row[4]), str(row[5]), int(row[6]))
    return JobCredentials(row[0], str(row[1]), int(row[2]), sealed)


def _columns(sealed: SealedCredentials, now: datetime) -> dict[str, Any]:
    return {
        "storage_creds_encrypted": sealed.encrypted,
        "storage_creds_dek_wrapped": sealed.dek_wrapped,
        "storage_creds_kek_id": sealed.kek_id,
        "storage_creds_encryption_version": sealed.encryption_version,
        "updated_at": now,
    }


class SqlInboxCredentialOps(SqlArea):
    """:class:`~trace_core.storage.ports.inbox_credentials.InboxCredentialOps`
    on a SQL transaction."""

    async def read(self, job_id: uuid.UUID) -> JobCredentials | None:
        rows = await self._rows("job credentials", sa.select(*_COLUMNS).where(_J.c.id == job_id))
        return _record(rows[0]) if rows else None

    async def replace_if_version(
        self,
        job_id: uuid.UUID,
        *,
        requester_id: str,
        expected_version: int,
        sealed: SealedCredentials,
        now: datetime,
    ) -> bool:
        stmt = (
            sa.update(_J)
            .where(
                _J.c.id == job_id,
                _J.c.requester_id == requester_id,
                _J.c.credential_version == expected_version,
            )
            .values(credential_version=expected_version + 1, **_columns(sealed, now))
        )
        return await self._count("credential refresh", stmt) == 1

    async def sealed_under(
        self, kek_id: str, *, limit: int, after: uuid.UUID | None = None
    ) -> list[JobCredentials]:
        stmt = sa.select(*_COLUMNS).where(_J.c.storage_creds_kek_id == kek_id)
        if after is not None:
            stmt = stmt.where(_J.c.id > after)
        stmt = stmt.order_by(_J.c.id).limit(limit)
        return [_record(row) for row in await self._rows("credentials under a KEK", stmt)]

    async def rewrap_if_unchanged(
        self,
        job_id: uuid.UUID,
        *,
        credential_version: int,
        kek_id: str,
        sealed: SealedCredentials,
        now: datetime,
    ) -> bool:
        stmt = (
            sa.update(_J)
            .where(
                _J.c.id == job_id,
                _J.c.credential_version == credential_version,
                _J.c.storage_creds_kek_id == kek_id,
            )
            .values(**_columns(sealed, now))
        )
        return await self._count("credential re-wrap", stmt) == 1
