"""The inbox area of the port (``tx.inbox``), on both engines: every operation
and each sentence of its docstring."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

import anyio
import pytest
import sqlalchemy as sa

from trace_core.clock import ManualClock
from trace_core.errors import DuplicateItem
from trace_core.leasing import LeaseConfig, LeaseQueue
from trace_core.model import INBOX_JOBS, Fence
from trace_core.storage import schema
from trace_core.storage.ports import (
    HistoryEntry,
    NewInboxJob,
    NewJobEvent,
    RefreshCount,
    SealedCredentials,
    Tombstone,
)
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio


def new_job(
    clock: ManualClock,
    *,
    requester: str = "req-a",
    webhook: str | None = "https://hooks.example/a",
    sealed: SealedCredentials | None = None,
) -> NewInboxJob:
    return NewInboxJob(
        job_id=uuid.uuid4(),
        requester_id=requester,
        request={"source": "in/clip.mov", "presets": ["mp4-h264-360p"]},
        status_webhook_url=webhook,
        refresh_url="https://req.example/refresh",
        max_attempts=4,
        available_at=clock.now(),
        credential_version=2,
        sealed=sealed,
    )


async def insert(repo: SqlRepository, job: NewInboxJob, now: datetime) -> uuid.UUID:
    async with repo.transaction() as tx:
        await tx.inbox.insert_job(job, now=now)
    return job.job_id


def event(job_id: uuid.UUID, sequence: int, now: datetime, **kw: Any) -> NewJobEvent:
    return NewJobEvent(
        event_id=kw.get("event_id", uuid.uuid4()),
        job_id=job_id,
        sequence=sequence,
        event_type=kw.get("event_type", "transcode.queued"),
        payload={"sequence": sequence},
        available_at=now,
        max_attempts=7,
    )


async def set_row(repo: SqlRepository, table: sa.Table, row_id: Any, **values: Any) -> None:
    """Put a row where a test needs it (the lifecycle itself is tested elsewhere)."""
    key = table.c.id if "id" in table.c else table.c.job_id
    async with repo.transaction() as tx:
        await tx.connection.execute(sa.update(table).where(key == row_id).values(**values))


async def test_insert_job_stores_a_queued_job_with_its_sealed_columns(
    repo: SqlRepository, clock: ManualClock
) -> None:
    sealed = SealedCredentials(b"\x00cipher", b"wrapped", "kek-1", 1)
    job = new_job(clock, sealed=sealed)
    await insert(repo, job, clock.now())
    async with repo.read() as tx:
        found = await tx.inbox.job_status(job.job_id)
        row = (
            await tx.connection.execute(
                sa.select(
                    schema.inbox_jobs.c.storage_creds_encrypted,
                    schema.inbox_jobs.c.storage_creds_dek_wrapped,
                    schema.inbox_jobs.c.storage_creds_kek_id,
                    schema.inbox_jobs.c.storage_creds_encryption_version,
                ).where(schema.inbox_jobs.c.id == job.job_id)
            )
        ).one()
    assert found is not None
    rec = found.job
    assert (rec.status, rec.attempt_count, rec.claim_version) == ("queued", 0, 0)
    assert rec.requester_id == "req-a" and rec.max_attempts == 4 and rec.credential_version == 2
    assert rec.request == dict(job.request) and rec.created_at == clock.now()
    assert tuple(row) == (b"\x00cipher", b"wrapped", "kek-1", 1)
    assert "cipher" not in repr(sealed)
    with pytest.raises(DuplicateItem):
        await insert(repo, job, clock.now())


async def test_lock_gives_snapshots_and_the_next_sequence(
    repo: SqlRepository, clock: ManualClock
) -> None:
    a = await insert(repo, new_job(clock), clock.now())
    b = await insert(repo, new_job(clock, webhook=None), clock.now())
    async with repo.transaction() as tx:
        assert await tx.inbox.lock_jobs_for_transition([]) == {}
        snaps = await tx.inbox.lock_jobs_for_transition([a, b, uuid.uuid4()])
        assert set(snaps) == {a, b}  # the unknown id is left out
        assert snaps[a].next_sequence == 1 and snaps[a].status == "queued"
        assert snaps[a].status_webhook_url == "https://hooks.example/a"
        assert snaps[b].status_webhook_url is None and snaps[b].credential_version == 2
        await tx.inbox.insert_events(
            [event(a, 1, clock.now()), event(a, 5, clock.now())], now=clock.now()
        )
        again = await tx.inbox.lock_jobs_for_transition([a, b])
    assert again[a].next_sequence == 6  # 1 + the highest, not 1 + the count
    assert again[b].next_sequence == 1


async def test_concurrent_writers_never_share_a_sequence(
    repo: SqlRepository, clock: ManualClock
) -> None:
    """Writers that each lock the job, read the next sequence and insert their
    event: every one gets its own number (the lock holds until commit)."""
    job = await insert(repo, new_job(clock), clock.now())
    taken: list[int] = []

    async def writer() -> None:
        async with repo.transaction() as tx:
            snap = (await tx.inbox.lock_jobs_for_transition([job]))[job]
            await anyio.lowlevel.checkpoint()  # let the others reach their lock
            await tx.inbox.insert_events(
                [event(job, snap.next_sequence, clock.now())], now=clock.now()
            )
            taken.append(snap.next_sequence)

    async with anyio.create_task_group() as tg:
        for _ in range(6):
            tg.start_soon(writer)
    assert sorted(taken) == [1, 2, 3, 4, 5, 6]


async def test_history_reads_back_in_the_order_the_job_passed_through(
    repo: SqlRepository, clock: ManualClock
) -> None:
    job = await insert(repo, new_job(clock), clock.now())
    now = clock.now()  # one time for all: the order comes from claim_version and stage

    def h(src: str | None, dst: str, cv: int) -> HistoryEntry:
        return HistoryEntry(job, src, dst, cv, max(cv, 0), "w1" if cv else None, None, now)

    walk = [
        h(None, "queued", 0),
        h("queued", "claimed", 1),
        h("claimed", "fetching", 1),
        h("fetching", "failed", 1),
        h("failed", "queued", 1),
        h("queued", "claimed", 2),
        h("claimed", "fetching", 2),
        h("fetching", "processing", 2),
        h("processing", "uploading", 2),
        h("uploading", "failed", 3),  # a reclaim bumps claim_version
        h("failed", "dead_letter", 3),
    ]
    async with repo.transaction() as tx:
        await tx.inbox.append_history([])
        await tx.inbox.append_history(list(reversed(walk)))
    other = await insert(repo, new_job(clock), clock.now())
    async with repo.transaction() as tx:
        await tx.inbox.append_history([HistoryEntry(other, None, "queued", 0, 0, None, "x", now)])
    async with repo.read() as tx:
        found = await tx.inbox.job_status(job)
        assert await tx.inbox.job_status(uuid.uuid4()) is None
    assert found is not None
    assert found.history == walk  # other jobs' entries are left out


async def test_events_are_inserted_pending_and_read_by_sequence(
    repo: SqlRepository, clock: ManualClock
) -> None:
    job = await insert(repo, new_job(clock), clock.now())
    first = event(job, 1, clock.now())
    async with repo.transaction() as tx:
        await tx.inbox.insert_events([], now=clock.now())
        await tx.inbox.insert_events(
            [event(job, 2, clock.now(), event_type="transcode.claimed"), first], now=clock.now()
        )
    with pytest.raises(DuplicateItem):
        async with repo.transaction() as tx:
            await tx.inbox.insert_events(
                [event(job, 3, clock.now(), event_id=first.event_id)], now=clock.now()
            )
    async with repo.read() as tx:
        found = await tx.inbox.job_status(job)
        rows = (
            await tx.connection.execute(
                sa.select(
                    schema.job_outbox_events.c.max_attempts, schema.job_outbox_events.c.payload
                ).where(schema.job_outbox_events.c.id == first.event_id)
            )
        ).one()
    assert found is not None
    assert [(e.sequence, e.event_type, e.status, e.attempts) for e in found.events] == [
        (1, "transcode.queued", "pending", 0),
        (2, "transcode.claimed", "pending", 0),
    ]
    assert found.events[0].event_id == first.event_id and found.events[0].delivered_at is None
    assert tuple(rows) == (7, {"sequence": 1})


async def test_credential_refresh_is_counted_only_for_the_current_claim_within_budget(
    repo: SqlRepository, clock: ManualClock
) -> None:
    job = await insert(repo, new_job(clock), clock.now())
    q = LeaseQueue(repo, INBOX_JOBS, clock=clock, config=LeaseConfig(lease_seconds=30))
    async with repo.transaction() as tx:  # not leased: nothing to count
        queued_fence = Fence(job, 0, uuid.uuid4(), 0)
        assert (
            await tx.inbox.count_credential_refresh_if_current_claim(queued_fence, budget=2) is None
        )
    lease = (await q.claim(job, "w1")).lease
    assert lease is not None
    answers = []
    for _ in range(3):
        async with repo.transaction() as tx:
            answers.append(
                await tx.inbox.count_credential_refresh_if_current_claim(lease.fence, budget=2)
            )
    assert answers == [RefreshCount(True, 1), RefreshCount(True, 2), RefreshCount(False, 2)]
    stale = [
        Fence(job, lease.attempt, lease.lease_token, lease.claim_version + 1),
        Fence(job, lease.attempt + 1, lease.lease_token, lease.claim_version),
        Fence(job, lease.attempt, uuid.uuid4(), lease.claim_version),
        Fence(job, lease.attempt, lease.lease_token, 2**40),  # not even storable
    ]
    async with repo.transaction() as tx:
        for fence in stale:
            assert await tx.inbox.count_credential_refresh_if_current_claim(fence, budget=9) is None
        found = await tx.inbox.job_status(job)
    assert found is not None
    assert found.job.credential_refresh_count == 2
    assert found.job.attempt_count == 1  # a refresh never spends an execution attempt


async def test_prune_tombstones_old_finished_jobs_whose_events_are_settled(
    repo: SqlRepository, clock: ManualClock
) -> None:
    t0 = clock.now()
    jobs = {
        name: await insert(repo, new_job(clock, requester=f"r-{name}"), t0)
        for name in (
            "old_ok",
            "older_dead",
            "recent_ok",
            "old_pending_event",
            "old_failed",
            "old_delivering",
        )
    }
    finished = {
        "old_ok": ("succeeded", t0 + timedelta(minutes=2)),
        "older_dead": ("dead_letter", t0 + timedelta(minutes=1)),
        "recent_ok": ("succeeded", t0 + timedelta(hours=2)),
        "old_pending_event": ("succeeded", t0),
        "old_failed": ("failed", t0),
        "old_delivering": ("dead_letter", t0),
    }
    for name, (status, at) in finished.items():
        await set_row(repo, schema.inbox_jobs, jobs[name], status=status, finished_at=at)
    event_status = {
        "old_ok": "delivered",
        "older_dead": "dead_letter",
        "old_pending_event": "pending",
        "old_delivering": "delivering",
    }
    async with repo.transaction() as tx:
        for name in event_status:
            await tx.inbox.insert_events([event(jobs[name], 1, t0)], now=t0)
        await tx.inbox.append_history(
            [HistoryEntry(jobs["old_ok"], None, "queued", 0, 0, None, None, t0)]
        )
    async with repo.transaction() as tx:
        for name, status in event_status.items():
            await tx.connection.execute(
                sa.update(schema.job_outbox_events)
                .where(schema.job_outbox_events.c.job_id == jobs[name])
                .values(status=status)
            )
    cutoff = t0 + timedelta(hours=1)
    now = clock.advance(hours=3)
    async with repo.transaction() as tx:
        assert await tx.inbox.prune_finished_before(cutoff, statuses=(), limit=10, now=now) == []
        first = await tx.inbox.prune_finished_before(
            cutoff, statuses=("succeeded", "dead_letter"), limit=1, now=now
        )
        rest = await tx.inbox.prune_finished_before(
            cutoff, statuses=("succeeded", "dead_letter"), limit=10, now=now
        )
    # oldest finished first, limit respected
    assert first == [Tombstone(jobs["older_dead"], "r-older_dead", "dead_letter", now)]
    assert rest == [Tombstone(jobs["old_ok"], "r-old_ok", "succeeded", now)]
    async with repo.read() as tx:
        for name in ("old_ok", "older_dead"):
            assert await tx.inbox.job_status(jobs[name]) is None
            tomb = await tx.inbox.tombstone(jobs[name])
            assert tomb is not None and tomb.pruned_at == now
        for name in ("recent_ok", "old_pending_event", "old_failed", "old_delivering"):
            assert await tx.inbox.job_status(jobs[name]) is not None, name
            assert await tx.inbox.tombstone(jobs[name]) is None
        assert await tx.inbox.tombstone(uuid.uuid4()) is None
        left = (
            await tx.connection.execute(
                sa.select(sa.func.count())
                .select_from(schema.inbox_job_history)
                .where(schema.inbox_job_history.c.job_id == jobs["old_ok"])
            )
        ).scalar_one()
        events_left = (
            await tx.connection.execute(
                sa.select(sa.func.count())
                .select_from(schema.job_outbox_events)
                .where(schema.job_outbox_events.c.job_id.in_([jobs["old_ok"], jobs["older_dead"]]))
            )
        ).scalar_one()
    assert (left, events_left) == (0, 0)
