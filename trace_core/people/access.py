"""Who a person is to Trace, and what their platform role lets them do.

Platform roles are cumulative: a ``reader`` reads; a ``writer`` also
deploys, triggers, pauses and rematerializes; an ``admin`` also manages
people (users, org roles, memberships) and datasets' visibility.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from enum import StrEnum

from trace_core.errors import TraceError

__all__ = ["Caller", "NotAllowed", "Permission", "PlatformRole", "UnknownPerson", "allows"]


class PlatformRole(StrEnum):
    """``users.role``: the platform permission role."""

    READER = "reader"
    WRITER = "writer"
    ADMIN = "admin"


class Permission(StrEnum):
    """What an operation needs."""

    READ = "read"
    """See the org's DAGs, datasets and tasks (within visibility)."""
    WRITE = "write"
    """Deploy, roll back, trigger, pause, rematerialize."""
    MANAGE = "manage"
    """Manage users, org roles, memberships and datasets' read roles."""


_GRANTS: dict[PlatformRole, frozenset[Permission]] = {
    PlatformRole.READER: frozenset({Permission.READ}),
    PlatformRole.WRITER: frozenset({Permission.READ, Permission.WRITE}),
    PlatformRole.ADMIN: frozenset(Permission),
}


def allows(role: PlatformRole, permission: Permission) -> bool:
    """Whether ``role`` grants ``permission``."""
    return permission in _GRANTS[role]


@dataclass(frozen=True)
class Caller:
    """An authenticated, enabled person: every operation is scoped to ``org_id``."""

    user_id: uuid.UUID
    org_id: uuid.UUID
    org_slug: str
    external_id: str
    email: str | None
    role: PlatformRole
    org_roles: tuple[str, ...]

    def may(self, permission: Permission) -> bool:
        """Whether this caller's platform role grants ``permission``."""
        return allows(self.role, permission)


class UnknownPerson(TraceError):
    """A verified token whose subject is no enabled user (answered 401, never 404)."""


class NotAllowed(TraceError):
    """The caller's platform role does not grant the operation (answered 403)."""

    def __init__(self, permission: Permission) -> None:
        super().__init__(f"this operation needs the {permission.value!r} permission")
        self.permission = permission
