"""The people area (:mod:`trace_core.storage.ports.people`) in SQL, for both engines.

Every statement but the lookup by IdP subject carries ``org_id`` in its
``WHERE`` (memberships through their role's org), so the org scope is a
property of the SQL, not of a check the caller might forget.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from trace_core.storage import schema
from trace_core.storage.ports.people import OrgRoleRecord, UserRecord
from trace_core.storage.sql_area import SqlArea

__all__ = ["SqlPeopleOps"]

_U = schema.users
_R = schema.org_roles
_M = schema.org_role_memberships
_D = schema.datasets
_USER = (
    _U.c.id,
    _U.c.org_id,
    _U.c.external_id,
    _U.c.email,
    _U.c.role,
    _U.c.created_at,
    _U.c.disabled_at,
)


def _user(row: Any) -> UserRecord:
    return UserRecord(row[0], row[1], str(row[2]), row[3], str(row[4]), row[5], row[6])


def _roles_query(org_id: uuid.UUID) -> sa.Select[Any]:
    members = (
        sa.select(sa.func.count()).select_from(_M).where(_M.c.role_id == _R.c.id).scalar_subquery()
    )
    return sa.select(_R.c.id, _R.c.org_id, _R.c.slug, _R.c.name, _R.c.created_at, members).where(
        _R.c.org_id == org_id
    )


def _role(row: Any) -> OrgRoleRecord:
    return OrgRoleRecord(row[0], row[1], str(row[2]), str(row[3]), row[4], int(row[5]))


class SqlPeopleOps(SqlArea):
    """:class:`~trace_core.storage.ports.people.PeopleOps` on a SQL transaction."""

    async def org_slug(self, org_id: uuid.UUID) -> str | None:
        stmt = sa.select(schema.orgs.c.slug).where(schema.orgs.c.id == org_id)
        rows = await self._rows("org slug", stmt)
        return str(rows[0][0]) if rows else None

    async def insert_user(
        self,
        user_id: uuid.UUID,
        *,
        org_id: uuid.UUID,
        external_id: str,
        email: str | None,
        role: str,
        now: datetime,
    ) -> None:
        stmt = sa.insert(_U).values(
            id=user_id,
            org_id=org_id,
            external_id=external_id,
            email=email,
            role=role,
            created_at=now,
        )
        await self._run("user", stmt)

    async def user_by_external_id(self, external_id: str) -> UserRecord | None:
        rows = await self._rows(
            "user by subject", sa.select(*_USER).where(_U.c.external_id == external_id)
        )
        return _user(rows[0]) if rows else None

    async def get_user(self, org_id: uuid.UUID, user_id: uuid.UUID) -> UserRecord | None:
        stmt = sa.select(*_USER).where(_U.c.org_id == org_id, _U.c.id == user_id)
        rows = await self._rows("user", stmt)
        return _user(rows[0]) if rows else None

    async def list_users(self, org_id: uuid.UUID) -> list[UserRecord]:
        stmt = sa.select(*_USER).where(_U.c.org_id == org_id).order_by(_U.c.created_at, _U.c.id)
        return [_user(row) for row in await self._rows("users", stmt)]

    async def set_user_role(self, org_id: uuid.UUID, user_id: uuid.UUID, role: str) -> bool:
        stmt = sa.update(_U).where(_U.c.org_id == org_id, _U.c.id == user_id).values(role=role)
        return await self._count("user role", stmt) == 1

    async def disable_user(self, org_id: uuid.UUID, user_id: uuid.UUID, *, now: datetime) -> bool:
        stmt = (
            sa.update(_U)
            .where(_U.c.org_id == org_id, _U.c.id == user_id)
            # The first disabling time is kept: a repeat is not a new event.
            .values(disabled_at=sa.func.coalesce(_U.c.disabled_at, now))
        )
        return await self._count("user disabling", stmt) == 1

    async def insert_role(
        self, role_id: uuid.UUID, *, org_id: uuid.UUID, slug: str, name: str, now: datetime
    ) -> None:
        stmt = sa.insert(_R).values(id=role_id, org_id=org_id, slug=slug, name=name, created_at=now)
        await self._run("org role", stmt)

    async def list_roles(self, org_id: uuid.UUID) -> list[OrgRoleRecord]:
        stmt = _roles_query(org_id).order_by(_R.c.slug)
        return [_role(row) for row in await self._rows("org roles", stmt)]

    async def get_role(self, org_id: uuid.UUID, slug: str) -> OrgRoleRecord | None:
        rows = await self._rows("org role", _roles_query(org_id).where(_R.c.slug == slug))
        return _role(rows[0]) if rows else None

    async def delete_role(self, org_id: uuid.UUID, slug: str) -> bool:
        role_id = await self._role_id(org_id, slug)
        if role_id is None:
            return False
        await self._run("org role memberships", sa.delete(_M).where(_M.c.role_id == role_id))
        stmt = sa.delete(_R).where(_R.c.org_id == org_id, _R.c.id == role_id)
        return await self._count("org role deletion", stmt) == 1

    async def add_membership(
        self, org_id: uuid.UUID, slug: str, user_id: uuid.UUID, *, now: datetime
    ) -> bool:
        role_id = await self._role_id(org_id, slug)
        user = await self._rows(
            "membership user", sa.select(_U.c.id).where(_U.c.org_id == org_id, _U.c.id == user_id)
        )
        if role_id is None or not user:
            return False
        stmt = (
            self._tx.insert(_M)
            .values(role_id=role_id, user_id=user_id, created_at=now)
            .on_conflict_do_nothing()
        )
        await self._run("membership", stmt)
        return True

    async def remove_membership(self, org_id: uuid.UUID, slug: str, user_id: uuid.UUID) -> bool:
        role_id = await self._role_id(org_id, slug)
        if role_id is None:
            return False
        stmt = sa.delete(_M).where(_M.c.role_id == role_id, _M.c.user_id == user_id)
        return await self._count("membership removal", stmt) == 1

    async def role_slugs_of(self, org_id: uuid.UUID, user_id: uuid.UUID) -> list[str]:
        stmt = (
            sa.select(_R.c.slug)
            .join(_M, _M.c.role_id == _R.c.id)
            .where(_R.c.org_id == org_id, _M.c.user_id == user_id)
            .order_by(_R.c.slug)
        )
        return [str(row[0]) for row in await self._rows("roles of user", stmt)]

    async def dataset_read_roles(self, org_id: uuid.UUID, dataset: str) -> list[str] | None:
        stmt = sa.select(_D.c.read_roles).where(_D.c.org_id == org_id, _D.c.name == dataset)
        rows = await self._rows("dataset read roles", stmt)
        return sorted(rows[0][0] or []) if rows else None

    async def set_dataset_read_roles(
        self, org_id: uuid.UUID, dataset: str, roles: Sequence[str], *, now: datetime
    ) -> bool:
        stmt = (
            sa.update(_D)
            .where(_D.c.org_id == org_id, _D.c.name == dataset)
            .values(read_roles=sorted(set(roles)), updated_at=now)
        )
        return await self._count("dataset read roles", stmt) == 1

    async def _role_id(self, org_id: uuid.UUID, slug: str) -> uuid.UUID | None:
        stmt = sa.select(_R.c.id).where(_R.c.org_id == org_id, _R.c.slug == slug)
        rows = await self._rows("org role id", stmt)
        return rows[0][0] if rows else None
