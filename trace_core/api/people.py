"""People's routes under ``/v1``: who am I, and (admins) users, org roles, visibility.

Authorized by a person's bearer JWT from the configured identity provider
(:class:`~trace_core.security.people_tokens.PeopleTokenVerifier`), mapped to
an enabled user by ``sub`` = ``users.external_id``; never by the internal
token, which does not open these paths: their prefixes are public to
:class:`~trace_core.api.auth.InternalAuth`, and :class:`PeopleAuth`, the
middleware in front of routing, demands and checks a person's token for
exactly those paths (so, as with the internal token, an anonymous client
learns nothing, not even which paths exist). A missing, bad or unknown
person's token is 401; a platform role that may not is 403; another org's
object is 404, as if it did not exist (:mod:`trace_core.people`).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field
from starlette.types import ASGIApp, Receive, Scope, Send

from trace_core.api.auth import route_path
from trace_core.api.errors import ERROR_RESPONSES, Forbidden, answer_doc, error_response
from trace_core.api.fields import Name
from trace_core.api.fields import Request as RequestBody
from trace_core.errors import DatabaseUnavailable
from trace_core.people.access import Caller, NotAllowed, PlatformRole, UnknownPerson
from trace_core.people.service import PeopleService
from trace_core.security.claims import InvalidCapability
from trace_core.security.people_tokens import PeopleTokenVerifier
from trace_core.storage.ports.people import OrgRoleRecord, UserRecord

__all__ = ["PEOPLE_PREFIXES", "PeopleApi", "PeopleAuth", "people_router"]

PEOPLE_PREFIXES = ("/v1/me", "/v1/users", "/v1/org-roles", "/v1/datasets/")
"""Paths authorized by a person's token (and never by the internal one)."""
_REALM = 'Bearer realm="trace-people"'
_STATE_KEY = "trace_person"
_NEED_TOKEN = "a person's 'Authorization: Bearer <token>' header is required"


@dataclass(frozen=True)
class PeopleApi:
    """What the people routes need: the token verifier and the people service."""

    verifier: PeopleTokenVerifier
    service: PeopleService


class UserOut(BaseModel):
    """A user as admins see it."""

    id: uuid.UUID
    external_id: str
    email: str | None
    role: PlatformRole
    disabled: bool
    created_at: datetime


class MeOut(UserOut):
    """The caller: their user, org and org roles."""

    org: str
    org_roles: list[str]


class RoleOut(BaseModel):
    """An org role with its member count."""

    slug: str
    name: str
    members: int


class NewUser(RequestBody):
    """``POST /v1/users``."""

    external_id: Name
    role: PlatformRole
    email: Annotated[str, Field(max_length=320)] | None = None


class UserChange(RequestBody):
    """``PATCH /v1/users/{id}``: a new platform role."""

    role: PlatformRole


class NewRole(RequestBody):
    """``POST /v1/org-roles``."""

    slug: Name
    name: Name | None = None


class ReadRoles(RequestBody):
    """A dataset's ``read_roles``: empty means every member of the org."""

    read_roles: Annotated[list[Name], Field(max_length=256)]


def _user(record: UserRecord) -> UserOut:
    return UserOut(
        id=record.user_id,
        external_id=record.external_id,
        email=record.email,
        role=PlatformRole(record.role),
        disabled=record.disabled_at is not None,
        created_at=record.created_at,
    )


def _role(record: OrgRoleRecord) -> RoleOut:
    return RoleOut(slug=record.slug, name=record.name, members=record.members)


class PersonRefused(Exception):
    """A request under the people prefixes without an acceptable person's token."""

    def __init__(self, reason: str, status: int = 401) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


def _bearer(scope: Scope) -> str:
    values: list[bytes] = [v for k, v in scope.get("headers", ()) if k == b"authorization"]
    if len(values) != 1:
        raise PersonRefused(_NEED_TOKEN)  # none, or ambiguous
    scheme, _, token = values[0].decode("latin-1").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise PersonRefused(_NEED_TOKEN)
    return token.strip()


async def _authenticate(people: PeopleApi, scope: Scope) -> Caller:
    try:
        claims = await people.verifier.verify(_bearer(scope))
        return await people.service.authenticate(claims)
    except InvalidCapability as exc:
        if exc.reason == "jwks_unavailable":
            raise PersonRefused("the issuer's keys are unavailable; retry later", 503) from None
        raise PersonRefused(f"the bearer token was refused ({exc.reason})") from None
    except UnknownPerson:
        raise PersonRefused("the bearer token was refused (unknown_user)") from None
    except DatabaseUnavailable:
        # the user lookup is a database read: an outage is a 503 like on every route
        raise PersonRefused("the state database is unavailable; retry later", 503) from None


class PeopleAuth:
    """ASGI middleware: requests under the people prefixes need a person's valid token.

    The caller is attached to the request for :func:`person`; every refusal
    is answered here, before routing: 401 (``WWW-Authenticate: Bearer``), or
    503 when the issuer's JWKS cannot be fetched.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        people: PeopleApi,
        prefixes: tuple[str, ...] = PEOPLE_PREFIXES,
        retry_after_seconds: int = 1,
    ) -> None:
        self.app = app
        self._people = people
        self._prefixes = prefixes
        self._retry_after = retry_after_seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Authenticate a people request; pass every other request on."""
        if scope["type"] != "http" or not route_path(scope).startswith(self._prefixes):
            await self.app(scope, receive, send)
            return
        try:
            caller = await _authenticate(self._people, scope)
        except PersonRefused as refused:
            if refused.status == 401:
                error, headers = "unauthorized", {"WWW-Authenticate": _REALM}
            else:
                error, headers = "unavailable", {"Retry-After": str(self._retry_after)}
            response = error_response(refused.status, error, refused.reason, headers=headers)
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})[_STATE_KEY] = caller
        await self.app(scope, receive, send)


def person(request: Request) -> Caller:
    """The caller :class:`PeopleAuth` attached to this request."""
    caller = request.scope.get("state", {}).get(_STATE_KEY)
    if not isinstance(caller, Caller):
        # Only reachable if the router was mounted without the middleware.
        raise Forbidden("unauthenticated", _NEED_TOKEN)
    return caller


Who = Annotated[Caller, Depends(person)]
"""A route parameter receiving the request's authenticated person."""


@asynccontextmanager
async def _acting() -> AsyncIterator[None]:
    """The service's refusal as the API's 403."""
    try:
        yield
    except NotAllowed as exc:
        raise Forbidden("forbidden", str(exc)) from None


_Answers = dict[int | str, dict[str, Any]]
_DENIED: _Answers = {403: answer_doc("The caller's platform role may not do this")}
_MISSING: _Answers = {404: answer_doc("No such object in the caller's org")}
_CONFLICT: _Answers = {409: answer_doc("Already exists")}


def people_router(people: PeopleApi) -> APIRouter:
    """The people routes over ``people`` (see the module docstring)."""
    service = people.service

    router = APIRouter(prefix="/v1", tags=["people"], responses=ERROR_RESPONSES)

    @router.get("/me", response_model=MeOut)
    async def me(who: Who) -> MeOut:
        """The caller: user, platform role, org and org roles."""
        user = await service.me(who)
        return MeOut(**_user(user).model_dump(), org=who.org_slug, org_roles=list(who.org_roles))

    @router.get("/users", response_model=list[UserOut], responses=_DENIED)
    async def list_users(who: Who) -> list[UserOut]:
        """The org's users (admin)."""
        async with _acting():
            return [_user(u) for u in await service.list_users(who)]

    @router.post("/users", response_model=UserOut, status_code=201, responses=_DENIED | _CONFLICT)
    async def create_user(who: Who, body: NewUser) -> UserOut:
        """Create a user of the org (admin)."""
        async with _acting():
            return _user(await service.create_user(who, body.external_id, body.role, body.email))

    @router.patch("/users/{user_id}", response_model=UserOut, responses=_DENIED | _MISSING)
    async def change_user(who: Who, user_id: uuid.UUID, body: UserChange) -> UserOut:
        """Change a user's platform role (admin)."""
        async with _acting():
            return _user(await service.set_role(who, user_id, body.role))

    @router.post("/users/{user_id}/disable", response_model=UserOut, responses=_DENIED | _MISSING)
    async def disable_user(who: Who, user_id: uuid.UUID) -> UserOut:
        """Disable a user (admin): their tokens are refused from now on."""
        async with _acting():
            return _user(await service.disable(who, user_id))

    @router.get("/org-roles", response_model=list[RoleOut], responses=_DENIED)
    async def list_roles(who: Who) -> list[RoleOut]:
        """The org's roles (admin)."""
        async with _acting():
            return [_role(r) for r in await service.list_roles(who)]

    @router.post(
        "/org-roles", response_model=RoleOut, status_code=201, responses=_DENIED | _CONFLICT
    )
    async def create_role(who: Who, body: NewRole) -> RoleOut:
        """Create an org role (admin)."""
        async with _acting():
            return _role(await service.create_role(who, body.slug, body.name))

    @router.delete("/org-roles/{slug}", status_code=204, responses=_DENIED | _MISSING)
    async def delete_role(who: Who, slug: str) -> None:
        """Delete an org role and its memberships (admin)."""
        async with _acting():
            await service.delete_role(who, slug)

    @router.put(
        "/org-roles/{slug}/members/{user_id}", status_code=204, responses=_DENIED | _MISSING
    )
    async def add_member(who: Who, slug: str, user_id: uuid.UUID) -> None:
        """Make a user a member of an org role (admin)."""
        async with _acting():
            await service.add_member(who, slug, user_id)

    @router.delete(
        "/org-roles/{slug}/members/{user_id}", status_code=204, responses=_DENIED | _MISSING
    )
    async def remove_member(who: Who, slug: str, user_id: uuid.UUID) -> None:
        """End a membership (admin)."""
        async with _acting():
            await service.remove_member(who, slug, user_id)

    @router.get(
        "/datasets/{name}/read-roles", response_model=ReadRoles, responses=_DENIED | _MISSING
    )
    async def get_read_roles(who: Who, name: str) -> ReadRoles:
        """A dataset's read roles (admin)."""
        async with _acting():
            return ReadRoles(read_roles=await service.read_roles(who, name))

    @router.put(
        "/datasets/{name}/read-roles", response_model=ReadRoles, responses=_DENIED | _MISSING
    )
    async def set_read_roles(who: Who, name: str, body: ReadRoles) -> ReadRoles:
        """Replace a dataset's read roles (admin); each must be a role of the org."""
        async with _acting():
            return ReadRoles(read_roles=await service.set_read_roles(who, name, body.read_roles))

    return router
