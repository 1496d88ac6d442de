"""The sources area (:mod:`trace_core.storage.ports.sources`) in SQL, for both engines."""

from __future__ import annotations

import uuid
from collections.abc import Collection, Mapping
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from trace_core.storage import schema
from trace_core.storage.ports.sources import CronState, SourceRun, SourceState, SourceStatus
from trace_core.storage.sql_area import SqlArea, SqlStatements
from trace_core.storage.sql_job_states import SqlJobStateOps

__all__ = ["SqlSourceOps"]


class SqlSourceOps(SqlArea):
    """:class:`~trace_core.storage.ports.sources.SourceOps` on a SQL transaction."""

    def __init__(self, tx: SqlStatements, job_states: SqlJobStateOps) -> None:
        super().__init__(tx)
        # A source's state is its job's job_states row: written through that
        # area's compare-and-set, never a second copy of it.
        self._job_states = job_states

    # --- source jobs and their first task -------------------------------------

    async def job_bootstraps(
        self, job_ids: Collection[uuid.UUID]
    ) -> dict[uuid.UUID, Mapping[str, Any]]:
        if not job_ids:
            return {}
        j = schema.jobs
        stmt = sa.select(j.c.id, j.c.bootstrap).where(j.c.id.in_(list(job_ids)))
        return {row[0]: row[1] or {} for row in await self._rows("job bootstraps", stmt)}

    async def job_has_tasks(self, job_id: uuid.UUID) -> bool:
        t = schema.tasks
        # Saying "has a dedupe key" lets the lookup use the (job_id,
        # dedupe_key) partial index instead of scanning tasks.
        stmt = sa.select(t.c.id).where(t.c.job_id == job_id, t.c.dedupe_key.is_not(None)).limit(1)
        return bool(await self._rows("job has tasks", stmt))

    async def clear_operator_state(self, org_id: uuid.UUID, job_id: uuid.UUID) -> int:
        o = schema.operator_state
        stmt = sa.delete(o).where(o.c.org_id == org_id, o.c.job_id == job_id)
        return await self._count("clear operator state", stmt)

    # --- the always-on run ------------------------------------------------------

    async def source_states(self, job_ids: Collection[uuid.UUID]) -> dict[uuid.UUID, SourceState]:
        if not job_ids:
            return {}
        s, t = schema.job_states, schema.tasks
        stmt = (
            sa.select(
                s.c.job_id,
                s.c.source_status,
                s.c.source_task_id,
                s.c.source_restarts,
                s.c.paused,
                t.c.status,
                t.c.attempt,
                t.c.claim_version,
                t.c.next_retry_at,
                t.c.error_message,
            )
            .select_from(s.outerjoin(t, t.c.id == s.c.source_task_id))
            .where(s.c.job_id.in_(list(job_ids)))
        )
        out = {}
        for r in await self._rows("source states", stmt):
            run = SourceRun(r[2], r[5], r[6], r[7], r[8], r[9]) if r[5] is not None else None
            out[r[0]] = SourceState(r[1], r[2], r[3], bool(r[4]), run)
        return out

    async def active_sources(self) -> list[tuple[uuid.UUID, str, uuid.UUID | None]]:
        s = schema.job_states
        active = [str(x) for x in SourceStatus if x != SourceStatus.STOPPED]
        stmt = sa.select(s.c.job_id, s.c.source_status, s.c.source_task_id).where(
            s.c.source_status.in_(active)
        )
        return [(r[0], r[1], r[2]) for r in await self._rows("active sources", stmt)]

    async def start_run_if_previous(
        self,
        job_id: uuid.UUID,
        *,
        previous: uuid.UUID | None,
        task_id: uuid.UUID,
        now: datetime,
    ) -> bool:
        values = {
            "source_task_id": task_id,
            "source_status": str(SourceStatus.PENDING),
            "source_restarts": 0,
        }
        expected = {"source_task_id": previous}
        return await self._job_states.update_if_matches(job_id, values, now=now, expected=expected)

    async def set_run_status_if_current(
        self,
        job_id: uuid.UUID,
        *,
        task_id: uuid.UUID,
        expected: str | None,
        status: str,
        restarts: int,
        now: datetime,
    ) -> bool:
        values = {"source_status": status, "source_restarts": restarts}
        guard = {"source_status": expected, "source_task_id": task_id}
        return await self._job_states.update_if_matches(job_id, values, now=now, expected=guard)

    async def set_source_status_if_status(
        self, job_id: uuid.UUID, *, expected: str | None, status: str, now: datetime
    ) -> bool:
        return await self._job_states.update_if_matches(
            job_id,
            {"source_status": status},
            now=now,
            expected={"source_status": expected},
        )

    def _running_run(self) -> sa.ScalarSelect[Any]:
        t = schema.tasks
        return sa.select(t.c.id).where(t.c.status == "Running").scalar_subquery()

    async def running_sources(self) -> list[uuid.UUID]:
        s = schema.job_states
        stmt = sa.select(s.c.job_id).where(
            s.c.source_status == str(SourceStatus.RUNNING),
            s.c.source_task_id.in_(self._running_run()),
        )
        return [row[0] for row in await self._rows("running sources", stmt)]

    async def drain_run_if_running(self, job_id: uuid.UUID, *, now: datetime) -> uuid.UUID | None:
        s = schema.job_states
        stmt = (
            sa.update(s)
            .where(
                s.c.job_id == job_id,
                s.c.source_status == str(SourceStatus.RUNNING),
                s.c.source_task_id.in_(self._running_run()),
            )
            .values(source_status=str(SourceStatus.DRAINING), updated_at=now)
            .returning(s.c.source_task_id)
        )
        rows = await self._rows("drain source run", stmt)
        return rows[0][0] if rows else None

    async def run_directive_state(self, task_id: uuid.UUID) -> tuple[str | None, bool] | None:
        s = schema.job_states
        stmt = sa.select(s.c.source_status, s.c.paused).where(s.c.source_task_id == task_id)
        rows = await self._rows("source run state", stmt)
        return (rows[0][0], bool(rows[0][1])) if rows else None

    # --- cron schedules -------------------------------------------------------------

    async def cron_states(self, job_ids: Collection[uuid.UUID]) -> dict[uuid.UUID, CronState]:
        s = schema.job_states
        stmt = sa.select(s.c.job_id, s.c.next_fire_at, s.c.source_status).where(
            sa.or_(s.c.job_id.in_(list(job_ids)), s.c.next_fire_at.is_not(None))
        )
        return {r[0]: CronState(r[1], r[2]) for r in await self._rows("cron states", stmt)}

    async def schedule_cron_if_unscheduled(
        self, job_id: uuid.UUID, *, first: datetime, now: datetime
    ) -> bool:
        return await self._job_states.update_if_matches(
            job_id,
            {"next_fire_at": first},
            now=now,
            expected={"next_fire_at": None},
        )

    async def advance_cron_if_next_fire(
        self, job_id: uuid.UUID, *, expected: datetime, next_fire_at: datetime, now: datetime
    ) -> bool:
        return await self._job_states.update_if_matches(
            job_id,
            {"next_fire_at": next_fire_at},
            now=now,
            expected={"next_fire_at": expected},
        )

    async def record_cron_fire(
        self, job_id: uuid.UUID, *, fired_at: datetime, now: datetime
    ) -> None:
        await self._job_states.update_if_matches(job_id, {"last_fired_at": fired_at}, now=now)

    async def clear_cron_if_next_fire(
        self, job_id: uuid.UUID, *, expected: datetime, now: datetime
    ) -> bool:
        return await self._job_states.update_if_matches(
            job_id,
            {"next_fire_at": None},
            now=now,
            expected={"next_fire_at": expected},
        )

    # --- pauses and the journal -----------------------------------------------------
