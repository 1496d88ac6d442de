"""``trace-lite people …`` and ``trace-lite token``: people for the lite profile's admin.

``people`` commands act directly on the state database, as the operator of
the deployment acting as the org's admin (the same org-scoped service the
``/v1`` people routes use); ``user add`` also creates the org if missing, so
the first admin comes from here. ``token --user SUB`` prints a short-lived
token of the local issuer (:mod:`trace_lite.people_keys`) for ``GET /v1/me``
and the other ``/v1`` routes of ``trace-lite serve``.
"""

from __future__ import annotations

import argparse
import uuid

import anyio

from trace_core.clock import SystemClock
from trace_core.errors import ConfigurationError, DuplicateItem, NotFound
from trace_core.people import PeopleService, PlatformRole, parse_role
from trace_core.people.access import Caller
from trace_core.storage.sql import SqlRepository
from trace_lite.cli_commands import Command, in_event_loop, positive_int
from trace_lite.people_keys import issue_person_token, open_people_keys
from trace_lite.state_database import StateDatabase, Use

__all__ = ["PEOPLE_COMMANDS", "PEOPLE_GROUPS"]

PEOPLE_GROUPS = {
    "people": "users, org roles, memberships and dataset visibility (the org's admin)",
    "people user": "users and their platform role (reader, writer, admin)",
    "people role": "org-defined roles (visibility scopes)",
    "people member": "memberships of users in org roles",
    "people dataset": "a dataset's read roles",
}
_ORG = "org slug (default 'default')"
_ROLES = ", ".join(r.value for r in PlatformRole)


def _role_option(text: str) -> PlatformRole:
    try:
        return parse_role(text, "--role")
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


async def _session(db: StateDatabase, org: str) -> tuple[SqlRepository, PeopleService, Caller]:
    repo = SqlRepository(db.url())
    service = PeopleService(repo, SystemClock())
    try:
        return repo, service, await service.operator(org)
    except NotFound:
        await repo.close()
        raise ConfigurationError(f"--org: no org {org!r} (`people user add` creates it)") from None
    except BaseException:
        await repo.close()
        raise


async def _user_id(service: PeopleService, caller: Caller, external_id: str) -> uuid.UUID:
    try:
        return (await service.user_by_external_id(caller, external_id)).user_id
    except NotFound:
        raise ConfigurationError(
            f"--user: no user {external_id!r} in org {caller.org_slug!r}"
        ) from None


def _print_user(external_id: str, role: str, disabled: bool) -> None:
    print("\t".join([external_id, role, *(["disabled"] if disabled else [])]))


async def _user_add(args: argparse.Namespace, db: StateDatabase) -> int:
    repo = SqlRepository(db.url())
    try:
        user = await PeopleService(repo, SystemClock()).bootstrap_user(
            args.org, args.user, args.role, args.email
        )
    except DuplicateItem:
        raise ConfigurationError(f"--user: {args.user!r} already exists") from None
    finally:
        await repo.close()
    print(f"added {user.external_id} ({user.role}) to org {args.org} as {user.user_id}")
    return 0


async def _user_list(args: argparse.Namespace, db: StateDatabase) -> int:
    repo, service, caller = await _session(db, args.org)
    try:
        for user in await service.list_users(caller):
            _print_user(user.external_id, user.role, user.disabled_at is not None)
    finally:
        await repo.close()
    return 0


async def _user_role(args: argparse.Namespace, db: StateDatabase) -> int:
    repo, service, caller = await _session(db, args.org)
    try:
        user = await service.set_role(caller, await _user_id(service, caller, args.user), args.role)
    finally:
        await repo.close()
    print(f"{user.external_id} is now {user.role}")
    return 0


async def _user_disable(args: argparse.Namespace, db: StateDatabase) -> int:
    repo, service, caller = await _session(db, args.org)
    try:
        user = await service.disable(caller, await _user_id(service, caller, args.user))
    finally:
        await repo.close()
    print(f"{user.external_id} is disabled")
    return 0


async def _role_add(args: argparse.Namespace, db: StateDatabase) -> int:
    repo, service, caller = await _session(db, args.org)
    try:
        role = await service.create_role(caller, args.slug, args.name)
    except DuplicateItem:
        raise ConfigurationError(f"SLUG: the org has a role {args.slug!r} already") from None
    finally:
        await repo.close()
    print(f"added role {role.slug}")
    return 0


async def _role_list(args: argparse.Namespace, db: StateDatabase) -> int:
    repo, service, caller = await _session(db, args.org)
    try:
        for role in await service.list_roles(caller):
            print(f"{role.slug}\t{role.name}\t{role.members} member(s)")
    finally:
        await repo.close()
    return 0


async def _member(args: argparse.Namespace, db: StateDatabase, add: bool) -> int:
    repo, service, caller = await _session(db, args.org)
    try:
        user_id = await _user_id(service, caller, args.user)
        try:
            if add:
                await service.add_member(caller, args.role, user_id)
            else:
                await service.remove_member(caller, args.role, user_id)
        except NotFound:
            what = "role" if add else "membership of the role"
            raise ConfigurationError(f"--role: no {what} {args.role!r}") from None
    finally:
        await repo.close()
    print(f"{args.user} {'added to' if add else 'removed from'} {args.role}")
    return 0


async def _member_add(args: argparse.Namespace, db: StateDatabase) -> int:
    return await _member(args, db, add=True)


async def _member_remove(args: argparse.Namespace, db: StateDatabase) -> int:
    return await _member(args, db, add=False)


async def _visibility(args: argparse.Namespace, db: StateDatabase) -> int:
    repo, service, caller = await _session(db, args.org)
    try:
        try:
            if args.everyone:
                roles = await service.set_read_roles(caller, args.dataset, [])
            elif args.roles is not None:
                wanted = [r.strip() for r in args.roles.split(",") if r.strip()]
                roles = await service.set_read_roles(caller, args.dataset, wanted)
            else:
                roles = await service.read_roles(caller, args.dataset)
        except NotFound:
            raise ConfigurationError(f"DATASET: no dataset {args.dataset!r}") from None
        except ConfigurationError as exc:
            raise ConfigurationError(f"--roles: {exc}") from None
    finally:
        await repo.close()
    print(f"{args.dataset}: {', '.join(roles) if roles else 'every member of the org'}")
    return 0


def _token(args: argparse.Namespace, db: StateDatabase) -> int:
    clock = SystemClock()
    ring = open_people_keys(db.data_dir, clock)
    print(anyio.run(lambda: issue_person_token(ring, args.user, clock, ttl_seconds=args.ttl)))
    return 0


def _org(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--org", default="default", help=_ORG)


def _user_add_arguments(parser: argparse.ArgumentParser) -> None:
    _org(parser)
    parser.add_argument("--user", required=True, help="the IdP subject (the token's sub)")
    parser.add_argument("--role", required=True, type=_role_option, help=_ROLES)
    parser.add_argument("--email")


def _user_arguments(parser: argparse.ArgumentParser) -> None:
    _org(parser)
    parser.add_argument("--user", required=True, help="the IdP subject (the token's sub)")


def _user_role_arguments(parser: argparse.ArgumentParser) -> None:
    _user_arguments(parser)
    parser.add_argument("--role", required=True, type=_role_option, help=_ROLES)


def _role_add_arguments(parser: argparse.ArgumentParser) -> None:
    _org(parser)
    parser.add_argument("slug", metavar="SLUG")
    parser.add_argument("--name")


def _member_arguments(parser: argparse.ArgumentParser) -> None:
    _user_arguments(parser)
    parser.add_argument("--role", required=True, help="the org role's slug")


def _visibility_arguments(parser: argparse.ArgumentParser) -> None:
    _org(parser)
    parser.add_argument("dataset", metavar="DATASET")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--roles", help="comma-separated org role slugs that may read it")
    group.add_argument("--everyone", action="store_true", help="clear: every org member reads")


def _token_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--user", required=True, help="the subject (a users.external_id)")
    parser.add_argument(
        "--ttl", type=positive_int("--ttl"), default=900, help="seconds (default 900, max 3600)"
    )
    parser.add_argument("--data-dir", help="data directory holding people-keys/ (default .trace/)")


PEOPLE_COMMANDS: tuple[Command, ...] = (
    Command(
        ("people", "user", "add"),
        "add a user (and the org, if new)",
        Use.READY,
        in_event_loop(_user_add),
        _user_add_arguments,
    ),
    Command(
        ("people", "user", "list"),
        "list the org's users",
        Use.READY,
        in_event_loop(_user_list),
        _org,
    ),
    Command(
        ("people", "user", "role"),
        "change a user's platform role",
        Use.READY,
        in_event_loop(_user_role),
        _user_role_arguments,
    ),
    Command(
        ("people", "user", "disable"),
        "disable a user (their tokens are refused)",
        Use.READY,
        in_event_loop(_user_disable),
        _user_arguments,
    ),
    Command(
        ("people", "role", "add"),
        "add an org role",
        Use.READY,
        in_event_loop(_role_add),
        _role_add_arguments,
    ),
    Command(
        ("people", "role", "list"),
        "list the org's roles",
        Use.READY,
        in_event_loop(_role_list),
        _org,
    ),
    Command(
        ("people", "member", "add"),
        "make a user a member of an org role",
        Use.READY,
        in_event_loop(_member_add),
        _member_arguments,
    ),
    Command(
        ("people", "member", "remove"),
        "end a membership",
        Use.READY,
        in_event_loop(_member_remove),
        _member_arguments,
    ),
    Command(
        ("people", "dataset", "visibility"),
        "show or set a dataset's read roles",
        Use.READY,
        in_event_loop(_visibility),
        _visibility_arguments,
    ),
    Command(
        ("token",),
        "print a short-lived token of the local people issuer",
        Use.NONE,
        _token,
        _token_arguments,
        description="Signed with <data-dir>/people-keys (created on first use), for the "
        "/v1 people routes of `trace-lite serve` on the same data directory.",
    ),
)
"""The people commands and ``token``, in ``--help`` order."""
