"""The API-key area of the port (``tx.api_keys``), on both engines."""

from __future__ import annotations

import uuid

import pytest

from trace_core.clock import ManualClock
from trace_core.errors import DuplicateItem
from trace_core.storage.ports import ApiKeyRecord, DigestMatch
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio


async def test_insert_find_revoke_and_list(repo: SqlRepository, clock: ManualClock) -> None:
    first, second, other = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    t0 = clock.now()
    async with repo.transaction() as tx:
        await tx.api_keys.insert_key(
            first, requester_id="acme", key_digest="sha256:aa", label="ci", now=t0
        )
        await tx.api_keys.insert_key(
            other, requester_id="globex", key_digest="sha256:cc", label=None, now=t0
        )
    t1 = clock.advance(10)
    async with repo.transaction() as tx:
        await tx.api_keys.insert_key(
            second, requester_id="acme", key_digest="sha256:bb", label=None, now=t1
        )

    async with repo.read() as tx:
        found = await tx.api_keys.find_by_digest("sha256:aa")
        missing = await tx.api_keys.find_by_digest("sha256:zz")
    assert found == DigestMatch(ApiKeyRecord(first, "acme", "ci", t0, None), "sha256:aa")
    assert missing is None

    t2 = clock.advance(5)
    async with repo.transaction() as tx:
        # another requester's key is not revoked through this requester
        assert not await tx.api_keys.revoke_if_active(first, requester_id="globex", now=t2)
        assert await tx.api_keys.revoke_if_active(first, requester_id="acme", now=t2)
        # a second revocation writes nothing and keeps the first time
        assert not await tx.api_keys.revoke_if_active(
            first, requester_id=None, now=clock.advance(1)
        )
        assert not await tx.api_keys.revoke_if_active(uuid.uuid4(), requester_id=None, now=t2)

    async with repo.read() as tx:
        acme = await tx.api_keys.list_keys("acme")
        everyone = await tx.api_keys.list_keys()
        revoked = await tx.api_keys.find_by_digest("sha256:aa")
    assert acme == [
        ApiKeyRecord(first, "acme", "ci", t0, t2),
        ApiKeyRecord(second, "acme", None, t1, None),
    ]
    assert {k.key_id for k in everyone} == {first, second, other}
    assert revoked is not None and revoked.key.revoked_at == t2


async def test_a_digest_is_stored_once(repo: SqlRepository, clock: ManualClock) -> None:
    async with repo.transaction() as tx:
        await tx.api_keys.insert_key(
            uuid.uuid4(), requester_id="acme", key_digest="sha256:aa", label=None, now=clock.now()
        )
    with pytest.raises(DuplicateItem):
        async with repo.transaction() as tx:
            await tx.api_keys.insert_key(
                uuid.uuid4(),
                requester_id="globex",
                key_digest="sha256:aa",
                label=None,
                now=clock.now(),
            )
    async with repo.read() as tx:
        assert [k.requester_id for k in await tx.api_keys.list_keys()] == ["acme"]
