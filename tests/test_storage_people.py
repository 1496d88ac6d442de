"""The people area of the port (``tx.people``), on both engines: org-scoped in SQL."""

from __future__ import annotations

import uuid

import pytest

from trace_core.clock import ManualClock
from trace_core.dag.registry import ensure_org
from trace_core.errors import DuplicateItem
from trace_core.storage.ports.registry import NewDataset
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio


async def _orgs(repo: SqlRepository, clock: ManualClock) -> tuple[uuid.UUID, uuid.UUID]:
    async with repo.transaction() as tx:
        a = await ensure_org(tx, "acme", clock.now())
        b = await ensure_org(tx, "globex", clock.now())
        await tx.registry.register_datasets_if_absent(
            [NewDataset(uuid.uuid4(), org, "sales", "d", "j", 0, clock.now()) for org in (a, b)]
        )
    return a, b


async def test_users_roles_memberships_stay_in_their_org(
    repo: SqlRepository, clock: ManualClock
) -> None:
    acme, globex = await _orgs(repo, clock)
    alice, bob, carol = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    t0 = clock.now()
    async with repo.transaction() as tx:
        people = tx.people
        await people.insert_user(
            alice, org_id=acme, external_id="a", email=None, role="admin", now=t0
        )
        await people.insert_user(
            bob, org_id=acme, external_id="b", email="b@x", role="reader", now=t0
        )
        await people.insert_user(
            carol, org_id=globex, external_id="c", email=None, role="admin", now=t0
        )
        await people.insert_role(uuid.uuid4(), org_id=acme, slug="finance", name="Finance", now=t0)
        await people.insert_role(uuid.uuid4(), org_id=globex, slug="finance", name="F", now=t0)
    async with repo.transaction() as tx:
        with pytest.raises(DuplicateItem):
            await tx.people.insert_user(
                uuid.uuid4(), org_id=globex, external_id="a", email=None, role="reader", now=t0
            )

    async with repo.transaction() as tx:
        people = tx.people
        # same created_at: ties are ordered by id
        listed = [u.user_id for u in await people.list_users(acme)]
        assert listed == sorted([alice, bob])
        assert await people.get_user(globex, alice) is None
        assert not await people.set_user_role(globex, bob, "admin")
        assert await people.set_user_role(acme, bob, "writer")
        assert not await people.add_membership(acme, "finance", carol, now=t0)
        assert await people.add_membership(acme, "finance", bob, now=t0)
        assert await people.add_membership(acme, "finance", bob, now=t0)  # no-op, still True
        assert await people.role_slugs_of(acme, bob) == ["finance"]
        assert await people.role_slugs_of(globex, bob) == []
        assert [(r.slug, r.members) for r in await people.list_roles(acme)] == [("finance", 1)]
        assert [(r.slug, r.members) for r in await people.list_roles(globex)] == [("finance", 0)]
        assert not await people.remove_membership(globex, "finance", bob)
        assert await people.org_slug(acme) == "acme"

    t1 = clock.advance(5)
    async with repo.transaction() as tx:
        assert not await tx.people.disable_user(globex, bob, now=t1)
        assert await tx.people.disable_user(acme, bob, now=t1)
        assert await tx.people.disable_user(acme, bob, now=clock.advance(1))
    async with repo.read() as tx:
        found = await tx.people.user_by_external_id("b")
    assert found is not None
    assert (found.role, found.disabled_at, found.email) == ("writer", t1, "b@x")

    async with repo.transaction() as tx:
        assert not await tx.people.delete_role(globex, "nope")
        assert await tx.people.delete_role(acme, "finance")
        assert await tx.people.role_slugs_of(acme, bob) == []
        assert [r.slug for r in await tx.people.list_roles(globex)] == ["finance"]


async def test_dataset_read_roles_per_org(repo: SqlRepository, clock: ManualClock) -> None:
    acme, globex = await _orgs(repo, clock)
    async with repo.transaction() as tx:
        assert await tx.people.dataset_read_roles(acme, "sales") == []
        assert await tx.people.dataset_read_roles(acme, "missing") is None
        assert await tx.people.set_dataset_read_roles(
            acme, "sales", ["ops", "finance", "ops"], now=clock.now()
        )
        assert not await tx.people.set_dataset_read_roles(acme, "missing", ["x"], now=clock.now())
    async with repo.read() as tx:
        assert await tx.people.dataset_read_roles(acme, "sales") == ["finance", "ops"]
        assert await tx.people.dataset_read_roles(globex, "sales") == []
