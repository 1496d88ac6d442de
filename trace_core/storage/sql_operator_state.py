"""The operator-state area (:mod:`trace_core.storage.ports.operator_state`) in SQL."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from trace_core.storage import schema
from trace_core.storage.ports.operator_state import OperatorStateKey, StoredState
from trace_core.storage.sql_area import SqlArea

__all__ = ["SqlOperatorStateOps"]


def _where(key: OperatorStateKey) -> list[sa.ColumnElement[bool]]:
    s = schema.operator_state
    return [s.c.org_id == key.org_id, s.c.job_id == key.job_id, s.c.state_key == key.state_key]


class SqlOperatorStateOps(SqlArea):
    """:class:`~trace_core.storage.ports.operator_state.OperatorStateOps` on a SQL transaction."""

    async def get(self, key: OperatorStateKey) -> StoredState | None:
        s = schema.operator_state
        stmt = sa.select(s.c.state, s.c.version).where(*_where(key))
        rows = await self._rows("read operator state", stmt)
        if not rows:
            return None
        return StoredState(dict(rows[0][0] or {}), int(rows[0][1]))

    async def insert_if_absent(
        self, key: OperatorStateKey, state: Mapping[str, Any], *, now: datetime
    ) -> bool:
        s = schema.operator_state
        stmt = (
            self._tx.insert(s)
            .values(
                org_id=key.org_id,
                job_id=key.job_id,
                state_key=key.state_key,
                state=dict(state),
                version=1,
                updated_at=now,
            )
            .on_conflict_do_nothing()
            .returning(s.c.version)
        )
        return bool(await self._rows("create operator state", stmt))

    async def update_if_version(
        self, key: OperatorStateKey, state: Mapping[str, Any], *, version: int, now: datetime
    ) -> int | None:
        s = schema.operator_state
        stmt = (
            sa.update(s)
            .where(*_where(key), s.c.version == version)
            .values(state=dict(state), version=s.c.version + 1, updated_at=now)
            .returning(s.c.version)
        )
        rows = await self._rows("update operator state", stmt)
        return int(rows[0][0]) if rows else None

    async def delete_if_version(self, key: OperatorStateKey, *, version: int | None) -> bool:
        s = schema.operator_state
        where = _where(key)
        if version is not None:
            where.append(s.c.version == version)
        return bool(await self._count("delete operator state", sa.delete(s).where(*where)))
