"""Managing people within one org: :class:`PeopleService`.

Every method takes the :class:`~trace_core.people.access.Caller` and acts in
the caller's org only (the storage area filters by ``org_id`` in SQL); an
object of another org raises :class:`~trace_core.errors.NotFound` exactly as
one that does not exist. Management needs the ``manage`` permission
(admins); :meth:`PeopleService.bootstrap_user` is the lite CLI's and an
operator's way in, without a caller.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence

from trace_core.clock import Clock
from trace_core.dag.registry import ensure_org, find_org
from trace_core.errors import InvalidInput, NotFound
from trace_core.people.access import Caller, NotAllowed, Permission, PlatformRole, UnknownPerson
from trace_core.security.people_tokens import PersonClaims
from trace_core.storage.ports.people import OrgRoleRecord, UserRecord
from trace_core.storage.protocol import Repository, Transaction

__all__ = ["MAX_EXTERNAL_ID", "PeopleService", "check_slug", "parse_role"]

MAX_EXTERNAL_ID = 255
_SLUG = re.compile(r"[a-z0-9][a-z0-9_.:-]{0,62}")


def parse_role(value: object, field: str = "role") -> PlatformRole:
    """The platform role named by ``value``; :class:`InvalidInput` naming ``field`` otherwise."""
    try:
        return PlatformRole(str(value))
    except ValueError:
        raise InvalidInput(field, "must be one of reader, writer, admin") from None


def check_slug(value: object, field: str) -> str:
    """A role slug: lowercase letters, digits and ``_.:-``, 1..63 characters."""
    if not isinstance(value, str) or not _SLUG.fullmatch(value):
        raise InvalidInput(
            field, "must be 1..63 of a-z 0-9 _ . : - starting with a letter or digit"
        )
    return value


def _check_external_id(value: object, field: str = "external_id") -> str:
    if (
        not isinstance(value, str)
        or not value
        or len(value) > MAX_EXTERNAL_ID
        or not value.isprintable()
    ):
        raise InvalidInput(field, f"must be 1..{MAX_EXTERNAL_ID} printable characters")
    return value


def _need(caller: Caller, permission: Permission) -> None:
    if not caller.may(permission):
        raise NotAllowed(permission)


class PeopleService:
    """Authentication of people and management of users, org roles and visibility."""

    def __init__(self, repo: Repository, clock: Clock) -> None:
        self._repo = repo
        self._clock = clock

    async def authenticate(self, claims: PersonClaims) -> Caller:
        """The enabled user whose ``external_id`` is the token's ``sub``.

        Raises :class:`UnknownPerson` for an unknown or disabled subject (the
        API answers 401 for both, saying nothing about which).
        """
        async with self._repo.read() as tx:
            user = await tx.people.user_by_external_id(claims.subject)
            if user is None or user.disabled_at is not None:
                raise UnknownPerson("the token's subject is no enabled user")
            return await self._caller(tx, user)

    async def caller_for(self, external_id: str) -> Caller:
        """The enabled user ``external_id`` as a caller (the lite CLI acts as one)."""
        claims_subject = _check_external_id(external_id, "--as")
        async with self._repo.read() as tx:
            user = await tx.people.user_by_external_id(claims_subject)
            if user is None or user.disabled_at is not None:
                raise UnknownPerson(f"no enabled user {claims_subject!r}")
            return await self._caller(tx, user)

    async def bootstrap_user(
        self, org_slug: str, external_id: str, role: PlatformRole, email: str | None = None
    ) -> UserRecord:
        """Create a user in ``org_slug`` (the org too, if missing) with no caller.

        For the operator of a deployment (``trace-lite people user add``):
        the first admin has to come from somewhere.
        """
        external_id = _check_external_id(external_id, "--user")
        now = self._clock.now()
        async with self._repo.transaction() as tx:
            org_id = await ensure_org(tx, org_slug, now)
            user_id = uuid.uuid4()
            await tx.people.insert_user(
                user_id, org_id=org_id, external_id=external_id, email=email, role=role, now=now
            )
            found = await tx.people.get_user(org_id, user_id)
        assert found is not None
        return found

    async def operator(self, org_slug: str) -> Caller:
        """The deployment's operator acting as ``org_slug``'s admin (the lite CLI).

        Not a user: whoever can open the state database already holds every
        power over it; this only keeps the CLI on the same org-scoped paths.
        """
        org_id = await self.org_id(org_slug)
        return Caller(
            user_id=uuid.UUID(int=0),
            org_id=org_id,
            org_slug=org_slug,
            external_id="operator",
            email=None,
            role=PlatformRole.ADMIN,
            org_roles=(),
        )

    async def org_id(self, org_slug: str) -> uuid.UUID:
        """The id of org ``org_slug``; :class:`NotFound` if there is none."""
        async with self._repo.read() as tx:
            found = await find_org(tx, org_slug)
        if found is None:
            raise NotFound(f"no org {org_slug!r}")
        return found

    async def me(self, caller: Caller) -> UserRecord:
        """The caller's own user record (any platform role)."""
        async with self._repo.read() as tx:
            user = await tx.people.get_user(caller.org_id, caller.user_id)
        if user is None:
            raise UnknownPerson("the caller's user no longer exists")
        return user

    # --- users --------------------------------------------------------------

    async def list_users(self, caller: Caller) -> list[UserRecord]:
        """The caller's org's users (admin)."""
        _need(caller, Permission.MANAGE)
        async with self._repo.read() as tx:
            return await tx.people.list_users(caller.org_id)

    async def create_user(
        self, caller: Caller, external_id: str, role: PlatformRole, email: str | None = None
    ) -> UserRecord:
        """A new user in the caller's org (admin); a taken ``external_id`` is a conflict."""
        _need(caller, Permission.MANAGE)
        external_id = _check_external_id(external_id)
        now = self._clock.now()
        user_id = uuid.uuid4()
        async with self._repo.transaction() as tx:
            await tx.people.insert_user(
                user_id,
                org_id=caller.org_id,
                external_id=external_id,
                email=email,
                role=role,
                now=now,
            )
            found = await tx.people.get_user(caller.org_id, user_id)
        assert found is not None
        return found

    async def set_role(self, caller: Caller, user_id: uuid.UUID, role: PlatformRole) -> UserRecord:
        """Change a user's platform role (admin)."""
        _need(caller, Permission.MANAGE)
        async with self._repo.transaction() as tx:
            if not await tx.people.set_user_role(caller.org_id, user_id, role):
                raise NotFound("no such user")
            found = await tx.people.get_user(caller.org_id, user_id)
        assert found is not None
        return found

    async def disable(self, caller: Caller, user_id: uuid.UUID) -> UserRecord:
        """Disable a user (admin): their tokens are refused from now on."""
        _need(caller, Permission.MANAGE)
        async with self._repo.transaction() as tx:
            if not await tx.people.disable_user(caller.org_id, user_id, now=self._clock.now()):
                raise NotFound("no such user")
            found = await tx.people.get_user(caller.org_id, user_id)
        assert found is not None
        return found

    async def user_by_external_id(self, caller: Caller, external_id: str) -> UserRecord:
        """The caller's org's user with this IdP subject (admin); NotFound otherwise."""
        _need(caller, Permission.MANAGE)
        async with self._repo.read() as tx:
            user = await tx.people.user_by_external_id(external_id)
        if user is None or user.org_id != caller.org_id:
            raise NotFound("no such user")
        return user

    # --- org roles and memberships -------------------------------------------

    async def list_roles(self, caller: Caller) -> list[OrgRoleRecord]:
        """The caller's org's roles (admin)."""
        _need(caller, Permission.MANAGE)
        async with self._repo.read() as tx:
            return await tx.people.list_roles(caller.org_id)

    async def create_role(
        self, caller: Caller, slug: str, name: str | None = None
    ) -> OrgRoleRecord:
        """A new org role (admin); a slug the org has already is a conflict."""
        _need(caller, Permission.MANAGE)
        slug = check_slug(slug, "slug")
        async with self._repo.transaction() as tx:
            await tx.people.insert_role(
                uuid.uuid4(),
                org_id=caller.org_id,
                slug=slug,
                name=name or slug,
                now=self._clock.now(),
            )
            found = await tx.people.get_role(caller.org_id, slug)
        assert found is not None
        return found

    async def delete_role(self, caller: Caller, slug: str) -> None:
        """Delete an org role and its memberships (admin)."""
        _need(caller, Permission.MANAGE)
        async with self._repo.transaction() as tx:
            if not await tx.people.delete_role(caller.org_id, slug):
                raise NotFound("no such role")

    async def add_member(self, caller: Caller, slug: str, user_id: uuid.UUID) -> None:
        """Make a user of the org a member of an org role (admin)."""
        _need(caller, Permission.MANAGE)
        async with self._repo.transaction() as tx:
            if not await tx.people.add_membership(
                caller.org_id, slug, user_id, now=self._clock.now()
            ):
                raise NotFound("no such role or user")

    async def remove_member(self, caller: Caller, slug: str, user_id: uuid.UUID) -> None:
        """End a membership (admin)."""
        _need(caller, Permission.MANAGE)
        async with self._repo.transaction() as tx:
            if not await tx.people.remove_membership(caller.org_id, slug, user_id):
                raise NotFound("no such membership")

    # --- visibility -----------------------------------------------------------

    async def read_roles(self, caller: Caller, dataset: str) -> list[str]:
        """A dataset's ``read_roles`` (admin); empty means every member of the org."""
        _need(caller, Permission.MANAGE)
        async with self._repo.read() as tx:
            roles = await tx.people.dataset_read_roles(caller.org_id, dataset)
        if roles is None:
            raise NotFound("no such dataset")
        return roles

    async def set_read_roles(self, caller: Caller, dataset: str, roles: Sequence[str]) -> list[str]:
        """Replace a dataset's ``read_roles`` (admin); each must be an org role."""
        _need(caller, Permission.MANAGE)
        slugs = [check_slug(r, f"read_roles[{i}]") for i, r in enumerate(roles)]
        async with self._repo.transaction() as tx:
            if await tx.people.dataset_read_roles(caller.org_id, dataset) is None:
                raise NotFound("no such dataset")
            known = {r.slug for r in await tx.people.list_roles(caller.org_id)}
            for i, slug in enumerate(slugs):
                if slug not in known:
                    raise InvalidInput(f"read_roles[{i}]", "is not a role of the org")
            await tx.people.set_dataset_read_roles(
                caller.org_id, dataset, slugs, now=self._clock.now()
            )
        return sorted(set(slugs))

    async def _caller(self, tx: Transaction, user: UserRecord) -> Caller:
        slug = await tx.people.org_slug(user.org_id)
        roles = await tx.people.role_slugs_of(user.org_id, user.user_id)
        return Caller(
            user_id=user.user_id,
            org_id=user.org_id,
            org_slug=slug or "",
            external_id=user.external_id,
            email=user.email,
            role=PlatformRole(user.role),
            org_roles=tuple(roles),
        )
