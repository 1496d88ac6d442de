"""The stored-credentials area of the port (``tx.inbox_credentials``), on both engines."""

from __future__ import annotations

import uuid

import pytest

from tests.factories import insert_inbox_job
from trace_core.clock import ManualClock
from trace_core.storage.ports import JobCredentials, SealedCredentials
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio


def sealed(tag: bytes, kek_id: str = "k1") -> SealedCredentials:
    return SealedCredentials(b"enc-" + tag, b"dek-" + tag, kek_id, 1)


async def test_read_returns_the_binding_and_the_sealed_value(
    repo: SqlRepository, clock: ManualClock
) -> None:
    with_creds, without = uuid.uuid4(), uuid.uuid4()
    async with repo.transaction() as tx:
        await insert_inbox_job(
            tx, job_id=with_creds, requester_id="acme", now=clock.now(), sealed=sealed(b"a")
        )
        await insert_inbox_job(tx, job_id=without, requester_id="acme", now=clock.now())
    async with repo.read() as tx:
        assert await tx.inbox_credentials.read(with_creds) == JobCredentials(
            with_creds, "acme", 0, sealed(b"a")
        )
        assert await tx.inbox_credentials.read(without) == JobCredentials(without, "acme", 0, None)
        assert await tx.inbox_credentials.read(uuid.uuid4()) is None


async def test_replace_is_guarded_by_requester_and_version(
    repo: SqlRepository, clock: ManualClock
) -> None:
    job = uuid.uuid4()
    async with repo.transaction() as tx:
        await insert_inbox_job(
            tx, job_id=job, requester_id="acme", now=clock.now(), sealed=sealed(b"a")
        )
    async with repo.transaction() as tx:
        creds = tx.inbox_credentials
        kw = {"sealed": sealed(b"x", "k2"), "now": clock.now()}
        assert not await creds.replace_if_version(
            job, requester_id="globex", expected_version=0, **kw
        )
        assert not await creds.replace_if_version(
            job, requester_id="acme", expected_version=1, **kw
        )
        assert await creds.replace_if_version(
            job, requester_id="acme", expected_version=0, sealed=sealed(b"b", "k2"), now=clock.now()
        )
        # the same expected version again: the job moved on
        assert not await creds.replace_if_version(
            job, requester_id="acme", expected_version=0, **kw
        )
    async with repo.read() as tx:
        assert await tx.inbox_credentials.read(job) == JobCredentials(
            job, "acme", 1, sealed(b"b", "k2")
        )


async def test_sealed_under_lists_a_kek_in_batches(repo: SqlRepository, clock: ManualClock) -> None:
    old = sorted(uuid.uuid4() for _ in range(5))
    new = uuid.uuid4()
    async with repo.transaction() as tx:
        for i, job in enumerate(old):
            await insert_inbox_job(
                tx, job_id=job, requester_id="acme", now=clock.now(), sealed=sealed(b"%d" % i)
            )
        await insert_inbox_job(
            tx, job_id=new, requester_id="acme", now=clock.now(), sealed=sealed(b"n", "k2")
        )
        await insert_inbox_job(tx, job_id=uuid.uuid4(), requester_id="acme", now=clock.now())
    seen: list[uuid.UUID] = []
    after = None
    async with repo.read() as tx:
        while batch := await tx.inbox_credentials.sealed_under("k1", limit=2, after=after):
            assert len(batch) <= 2
            seen += [b.job_id for b in batch]
            after = batch[-1].job_id
        in_k2 = await tx.inbox_credentials.sealed_under("k2", limit=10)
        none = await tx.inbox_credentials.sealed_under("k9", limit=10)
    assert seen == old  # every one, once, in job id order
    assert [j.job_id for j in in_k2] == [new]
    assert none == []


async def test_rewrap_is_guarded_by_version_and_kek(
    repo: SqlRepository, clock: ManualClock
) -> None:
    job = uuid.uuid4()
    async with repo.transaction() as tx:
        await insert_inbox_job(
            tx, job_id=job, requester_id="acme", now=clock.now(), sealed=sealed(b"a")
        )
    async with repo.transaction() as tx:
        creds = tx.inbox_credentials
        moved = sealed(b"a2", "k2")
        assert not await creds.rewrap_if_unchanged(
            job, credential_version=1, kek_id="k1", sealed=moved, now=clock.now()
        )
        assert not await creds.rewrap_if_unchanged(
            job, credential_version=0, kek_id="k2", sealed=moved, now=clock.now()
        )
        assert await creds.rewrap_if_unchanged(
            job, credential_version=0, kek_id="k1", sealed=moved, now=clock.now()
        )
        # a second re-wrap from the old key finds the job moved: nothing written
        assert not await creds.rewrap_if_unchanged(
            job, credential_version=0, kek_id="k1", sealed=sealed(b"zz", "k3"), now=clock.now()
        )
    async with repo.read() as tx:
        assert await tx.inbox_credentials.read(job) == JobCredentials(
            job, "acme", 0, sealed(b"a2", "k2")
        )
