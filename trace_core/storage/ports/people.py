"""The people area of the repository port: users, org roles, memberships, visibility.

Reached as ``tx.people`` on any :class:`~trace_core.storage.protocol.Transaction`.
Every operation but :meth:`PeopleOps.user_by_external_id` (the token's
subject is global: ``users.external_id`` is unique) takes the caller's
``org_id`` and matches nothing outside it, so an object of another org reads
exactly like one that does not exist. Orgs themselves are the registry's
(``tx.registry.find_org`` / ``create_org_if_absent``).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

__all__ = ["OrgRoleRecord", "PeopleOps", "UserRecord"]


@dataclass(frozen=True)
class UserRecord:
    """One user: the IdP subject, the platform role and whether it is disabled."""

    user_id: uuid.UUID
    org_id: uuid.UUID
    external_id: str
    email: str | None
    role: str
    created_at: datetime
    disabled_at: datetime | None


@dataclass(frozen=True)
class OrgRoleRecord:
    """One org-defined role (``role:finance``) and its member count."""

    role_id: uuid.UUID
    org_id: uuid.UUID
    slug: str
    name: str
    created_at: datetime
    members: int


class PeopleOps(Protocol):
    """Users, org roles, memberships and datasets' read roles, inside one transaction."""

    async def org_slug(self, org_id: uuid.UUID) -> str | None:
        """The slug of org ``org_id``, or None if there is none."""
        ...

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
        """Store a new enabled user. An ``external_id`` already stored (in any
        org) raises :class:`~trace_core.errors.DuplicateItem`."""
        ...

    async def user_by_external_id(self, external_id: str) -> UserRecord | None:
        """The user whose IdP subject is ``external_id`` (disabled or not), or None."""
        ...

    async def get_user(self, org_id: uuid.UUID, user_id: uuid.UUID) -> UserRecord | None:
        """The org's user ``user_id``, or None (also for another org's user)."""
        ...

    async def list_users(self, org_id: uuid.UUID) -> list[UserRecord]:
        """The org's users, disabled ones included, oldest first (ties by id)."""
        ...

    async def set_user_role(self, org_id: uuid.UUID, user_id: uuid.UUID, role: str) -> bool:
        """Change the org's user's platform role; whether such a user exists."""
        ...

    async def disable_user(self, org_id: uuid.UUID, user_id: uuid.UUID, *, now: datetime) -> bool:
        """Mark the org's user disabled at ``now`` (the first time is kept);
        whether such a user exists."""
        ...

    async def insert_role(
        self, role_id: uuid.UUID, *, org_id: uuid.UUID, slug: str, name: str, now: datetime
    ) -> None:
        """Store a new org role; a slug the org already has raises
        :class:`~trace_core.errors.DuplicateItem`."""
        ...

    async def list_roles(self, org_id: uuid.UUID) -> list[OrgRoleRecord]:
        """The org's roles, by slug."""
        ...

    async def get_role(self, org_id: uuid.UUID, slug: str) -> OrgRoleRecord | None:
        """The org's role ``slug``, or None."""
        ...

    async def delete_role(self, org_id: uuid.UUID, slug: str) -> bool:
        """Delete the org's role ``slug`` with its memberships; whether it existed."""
        ...

    async def add_membership(
        self, org_id: uuid.UUID, slug: str, user_id: uuid.UUID, *, now: datetime
    ) -> bool:
        """Make the org's user a member of the org's role ``slug``; False when
        either is not the org's. Adding an existing membership is a no-op (True)."""
        ...

    async def remove_membership(self, org_id: uuid.UUID, slug: str, user_id: uuid.UUID) -> bool:
        """End a membership within the org; whether there was one."""
        ...

    async def role_slugs_of(self, org_id: uuid.UUID, user_id: uuid.UUID) -> list[str]:
        """The slugs of the org's roles the user is a member of, sorted."""
        ...

    async def dataset_read_roles(self, org_id: uuid.UUID, dataset: str) -> list[str] | None:
        """The org's dataset's ``read_roles`` (sorted), or None if the org has no such dataset."""
        ...

    async def set_dataset_read_roles(
        self, org_id: uuid.UUID, dataset: str, roles: Sequence[str], *, now: datetime
    ) -> bool:
        """Replace the org's dataset's ``read_roles``; whether the dataset exists."""
        ...
