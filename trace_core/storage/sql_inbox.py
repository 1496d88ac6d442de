"""The inbox area (:mod:`trace_core.storage.ports.inbox`) in SQL, for both engines."""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from trace_core.model import INBOX_JOBS, Fence
from trace_core.storage import schema
from trace_core.storage.ports.inbox import (
    EventDelivery,
    HistoryEntry,
    InboxJobRecord,
    JobSnapshot,
    JobStatusRecord,
    NewInboxJob,
    NewJobEvent,
    RefreshCount,
    Tombstone,
)
from trace_core.storage.queue_tables import QUEUE_TABLES
from trace_core.storage.sql_area import SqlArea
from trace_core.storage.sql_leasing import LeaseStatements, fence_storable, status_in

__all__ = ["SqlInboxOps"]

_JOBS = schema.inbox_jobs
_EVENTS = schema.job_outbox_events
_HISTORY = schema.inbox_job_history
_TOMBSTONES = schema.inbox_job_tombstones

# The order of the stages within one claim_version, for reading the history
# back in the order the job passed through it: a claim starts a new
# claim_version, and every later step of that claim (a stage, its end, the
# retry or dead letter after a failure) keeps it until the next claim.
_STAGE_ORDER = {
    "claimed": 1,
    "fetching": 2,
    "processing": 3,
    "uploading": 4,
    "succeeded": 5,
    "failed": 5,
    "queued": 6,
    "dead_letter": 6,
}

# Events a deliverer may still post: a job with one is not pruned.
_UNDELIVERED = ("pending", "delivering")


class SqlInboxOps(SqlArea):
    """:class:`~trace_core.storage.ports.inbox.InboxOps` on a SQL transaction."""

    async def insert_job(self, job: NewInboxJob, *, now: datetime) -> None:
        sealed = job.sealed
        stmt = sa.insert(_JOBS).values(
            id=job.job_id,
            requester_id=job.requester_id,
            status="queued",
            request=dict(job.request),
            status_webhook_url=job.status_webhook_url,
            refresh_url=job.refresh_url,
            max_attempts=job.max_attempts,
            credential_version=job.credential_version,
            storage_creds_encrypted=sealed.encrypted if sealed else None,
            storage_creds_dek_wrapped=sealed.dek_wrapped if sealed else None,
            storage_creds_kek_id=sealed.kek_id if sealed else None,
            storage_creds_encryption_version=sealed.encryption_version if sealed else None,
            available_at=job.available_at,
            created_at=now,
            updated_at=now,
        )
        await self._run("insert inbox job", stmt)

    async def lock_jobs_for_transition(
        self, job_ids: Collection[uuid.UUID]
    ) -> dict[uuid.UUID, JobSnapshot]:
        if not job_ids:
            return {}
        c = _JOBS.c
        lock = (
            sa.select(
                c.id,
                c.status,
                c.attempt_count,
                c.max_attempts,
                c.claim_version,
                c.worker_id,
                c.credential_refresh_count,
                c.credential_version,
                c.status_webhook_url,
                c.available_at,
            )
            .where(c.id.in_(sorted(job_ids)))
            .order_by(c.id)
        )
        if self.engine_name == "postgres":
            # Id order: two transactions locking overlapping sets cannot deadlock.
            lock = lock.with_for_update()
        rows = await self._rows("lock inbox jobs", lock)
        if not rows:
            return {}
        # A separate statement, run once the locks are held: under READ
        # COMMITTED it takes a fresh snapshot, so it sees every event of a
        # transaction that held a job's lock before us (a subquery of the
        # locking SELECT would read the snapshot taken before the wait).
        e = _EVENTS.c
        last = await self._rows(
            "last event sequences",
            sa.select(e.job_id, sa.func.max(e.sequence))
            .where(e.job_id.in_([row[0] for row in rows]))
            .group_by(e.job_id),
        )
        highest = {row[0]: int(row[1] or 0) for row in last}
        return {
            row[0]: JobSnapshot(
                job_id=row[0],
                status=str(row[1]),
                attempt_count=int(row[2]),
                max_attempts=int(row[3]),
                claim_version=int(row[4]),
                worker_id=row[5],
                credential_refresh_count=int(row[6]),
                credential_version=int(row[7]),
                status_webhook_url=row[8],
                available_at=row[9],
                next_sequence=highest.get(row[0], 0) + 1,
            )
            for row in rows
        }

    async def append_history(self, entries: Sequence[HistoryEntry]) -> None:
        if not entries:
            return
        rows = [
            {
                "id": uuid.uuid4(),
                "job_id": h.job_id,
                "from_status": h.from_status,
                "to_status": h.to_status,
                "claim_version": h.claim_version,
                "attempt_count": h.attempt_count,
                "worker_id": h.worker_id,
                "reason": h.reason,
                "created_at": h.at,
            }
            for h in entries
        ]
        await self._run("append inbox job history", sa.insert(_HISTORY), rows)

    async def insert_events(self, events: Sequence[NewJobEvent], *, now: datetime) -> None:
        if not events:
            return
        rows = [
            {
                "id": ev.event_id,
                "job_id": ev.job_id,
                "event_type": ev.event_type,
                "sequence": ev.sequence,
                "payload": dict(ev.payload),
                "status": "pending",
                "attempts": 0,
                "max_attempts": ev.max_attempts,
                "available_at": ev.available_at,
                "created_at": now,
            }
            for ev in events
        ]
        await self._run("insert job events", sa.insert(_EVENTS), rows)

    async def count_credential_refresh_if_current_claim(
        self, fence: Fence, *, budget: int
    ) -> RefreshCount | None:
        if not fence_storable(fence):
            return None
        qt = QUEUE_TABLES[INBOX_JOBS.name]
        c = _JOBS.c
        stmts = LeaseStatements(self.engine_name)
        current = [*stmts.fence(qt), status_in(c.status, INBOX_JOBS.leased)]
        params = stmts.fence_params(fence)
        bump = (
            sa.update(_JOBS)
            .where(*current, c.credential_refresh_count < sa.bindparam("budget"))
            .values(credential_refresh_count=c.credential_refresh_count + 1)
            .returning(c.credential_refresh_count)
        )
        rows = await self._rows("count credential refresh", bump, params | {"budget": budget})
        if rows:
            return RefreshCount(True, int(rows[0][0]))
        spent = await self._rows(
            "credential refresh budget",
            sa.select(c.credential_refresh_count).where(*current),
            params,
        )
        return RefreshCount(False, int(spent[0][0])) if spent else None

    async def job_status(self, job_id: uuid.UUID) -> JobStatusRecord | None:
        c = _JOBS.c
        rows = await self._rows(
            "inbox job",
            sa.select(
                c.id,
                c.requester_id,
                c.status,
                c.request,
                c.status_webhook_url,
                c.refresh_url,
                c.attempt_count,
                c.max_attempts,
                c.credential_refresh_count,
                c.credential_version,
                c.claim_version,
                c.worker_id,
                c.lease_expires_at,
                c.heartbeat_at,
                c.available_at,
                c.last_error,
                c.outputs,
                c.created_at,
                c.finished_at,
            ).where(c.id == job_id),
        )
        if not rows:
            return None
        job = InboxJobRecord(*rows[0])
        h = _HISTORY.c
        stage = sa.case(_STAGE_ORDER, value=h.to_status, else_=0)
        history = [
            HistoryEntry(job_id, *row)
            for row in await self._rows(
                "inbox job history",
                sa.select(
                    h.from_status,
                    h.to_status,
                    h.claim_version,
                    h.attempt_count,
                    h.worker_id,
                    h.reason,
                    h.created_at,
                )
                .where(h.job_id == job_id)
                .order_by(h.claim_version, stage, h.created_at),
            )
        ]
        e = _EVENTS.c
        events = [
            EventDelivery(*row)
            for row in await self._rows(
                "inbox job events",
                sa.select(
                    e.id,
                    e.sequence,
                    e.event_type,
                    e.status,
                    e.attempts,
                    e.last_error,
                    e.created_at,
                    e.delivered_at,
                )
                .where(e.job_id == job_id)
                .order_by(e.sequence),
            )
        ]
        return JobStatusRecord(job, history, events)

    async def prune_finished_before(
        self,
        cutoff: datetime,
        *,
        statuses: Collection[str],
        limit: int,
        now: datetime,
    ) -> list[Tombstone]:
        if not statuses or limit < 1:
            return []
        c, e = _JOBS.c, _EVENTS.c
        undelivered = sa.exists().where(e.job_id == c.id, status_in(e.status, _UNDELIVERED))
        pick: Any = (
            sa.select(c.id, c.requester_id, c.status)
            .where(
                status_in(c.status, statuses),
                c.finished_at.is_not(None),
                c.finished_at < cutoff,
                ~undelivered,
            )
            .order_by(c.finished_at, c.id)
            .limit(limit)
        )
        if self.engine_name == "postgres":
            pick = pick.with_for_update(of=_JOBS, skip_locked=True)
        picked = await self._rows("prunable inbox jobs", pick)
        if not picked:
            return []
        tombstones = [Tombstone(row[0], str(row[1]), str(row[2]), now) for row in picked]
        ids = [t.job_id for t in tombstones]
        await self._run(
            "write tombstones",
            self._tx.insert(_TOMBSTONES).on_conflict_do_nothing(),
            [
                {
                    "job_id": t.job_id,
                    "requester_id": t.requester_id,
                    "final_status": t.final_status,
                    "pruned_at": now,
                }
                for t in tombstones
            ],
        )
        # Children first: both reference the job row.
        await self._run("prune job events", sa.delete(_EVENTS).where(e.job_id.in_(ids)))
        await self._run("prune job history", sa.delete(_HISTORY).where(_HISTORY.c.job_id.in_(ids)))
        await self._run("prune inbox jobs", sa.delete(_JOBS).where(c.id.in_(ids)))
        return tombstones

    async def tombstone(self, job_id: uuid.UUID) -> Tombstone | None:
        t = _TOMBSTONES.c
        rows = await self._rows(
            "inbox job tombstone",
            sa.select(t.job_id, t.requester_id, t.final_status, t.pruned_at).where(
                t.job_id == job_id
            ),
        )
        return Tombstone(rows[0][0], str(rows[0][1]), str(rows[0][2]), rows[0][3]) if rows else None
