"""The API-key area (:mod:`trace_core.storage.ports.api_keys`) in SQL, for both engines."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from trace_core.storage import schema
from trace_core.storage.ports.api_keys import ApiKeyRecord, DigestMatch
from trace_core.storage.sql_area import SqlArea

__all__ = ["SqlApiKeyOps"]

_K = schema.euterpe_api_keys
_COLUMNS = (_K.c.id, _K.c.requester_id, _K.c.label, _K.c.created_at, _K.c.revoked_at)


def _record(row: Any) -> ApiKeyRecord:
    return ApiKeyRecord(row[0], str(row[1]), row[2], row[3], row[4])


class SqlApiKeyOps(SqlArea):
    """:class:`~trace_core.storage.ports.api_keys.ApiKeyOps` on a SQL transaction."""

    async def insert_key(
        self,
        key_id: uuid.UUID,
        *,
        requester_id: str,
        key_digest: str,
        label: str | None,
        now: datetime,
    ) -> None:
        stmt = sa.insert(_K).values(
            id=key_id,
            requester_id=requester_id,
            key_digest=key_digest,
            label=label,
            created_at=now,
        )
        await self._run("api key", stmt)

    async def find_by_digest(self, key_digest: str) -> DigestMatch | None:
        stmt = sa.select(*_COLUMNS, _K.c.key_digest).where(_K.c.key_digest == key_digest)
        rows = await self._rows("api key by digest", stmt)
        if not rows:
            return None
        return DigestMatch(_record(rows[0]), str(rows[0][5]))

    async def revoke_if_active(
        self, key_id: uuid.UUID, *, requester_id: str | None, now: datetime
    ) -> bool:
        stmt = sa.update(_K).where(_K.c.id == key_id, _K.c.revoked_at.is_(None))
        if requester_id is not None:
            stmt = stmt.where(_K.c.requester_id == requester_id)
        return await self._count("api key revocation", stmt.values(revoked_at=now)) == 1

    async def list_keys(self, requester_id: str | None = None) -> list[ApiKeyRecord]:
        stmt = sa.select(*_COLUMNS).order_by(_K.c.created_at, _K.c.id)
        if requester_id is not None:
            stmt = stmt.where(_K.c.requester_id == requester_id)
        return [_record(row) for row in await self._rows("api keys", stmt)]
