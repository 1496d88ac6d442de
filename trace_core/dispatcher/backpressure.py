"""Backpressure: pause upstream producers while a job's queue is over its limits.

Each round measures every live job's ``Queued`` tasks (depth, and the age of
the oldest) in one grouped query, lets
:func:`~trace_core.dispatcher.backpressure_plan.plan_backpressure` decide which
producers upstream of a tripped job must be paused (the rules, hysteresis
and bulk-tier shedding are described there), and writes the decision to
``job_states.paused``. Paused producers get no new tasks; the tripped queue
drains; they resume. No state is kept outside the database: a restarted
monitor (or a second one) reaches the same decisions.

Only pauses written here (their reason starts with
:data:`~trace_core.dispatcher.backpressure_plan.PAUSE_PREFIX`) are ever
lifted here; a pause set by someone else (an operator's manual pause) is
left alone.

:data:`PAUSE_PREFIX` and :class:`BackpressureConfig` (the monitor's settings)
are re-exported here for the monitor's callers.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from datetime import datetime

from trace_core.clock import Clock
from trace_core.dag import LiveJob, live_jobs
from trace_core.dispatcher.backpressure_plan import (
    PAUSE_PREFIX,
    BackpressureConfig,
    BackpressurePlan,
    JobNode,
    Pause,
    QueueMeasurement,
    Thresholds,
    cause_labels,
    plan_backpressure,
)
from trace_core.dispatcher.job_states import by_job_id, upsert_job_state
from trace_core.dispatcher.periodic import DispatcherService
from trace_core.errors import ConfigurationError
from trace_core.storage.protocol import Repository, Transaction

__all__ = [
    "PAUSE_PREFIX",
    "BackpressureConfig",
    "BackpressureMonitor",
    "BackpressureReport",
    "load_job_graph",
    "measure_queues",
    "read_paused",
]

log = logging.getLogger(__name__)


# --- reading the plan's inputs ------------------------------------------------


def _thresholds(job: LiveJob) -> Thresholds | None:
    try:
        return Thresholds.from_json(job.backpressure)
    except ConfigurationError as exc:
        # Deploy validates this; a bad row must not stop backpressure for the rest.
        log.warning("job %s/%s: ignoring invalid backpressure: %s", job.dag_name, job.job_name, exc)
        return None


async def load_job_graph(tx: Transaction) -> list[JobNode]:
    """The live jobs (:func:`trace_core.dag.live_jobs`) with their dataset edges.

    The one place that knows where the job graph comes from.
    """
    return [
        JobNode(
            job_id=job.job_id,
            dag_name=job.dag_name,
            job_name=job.job_name,
            operator=job.operator,
            priority_tier=job.priority_tier,
            input_datasets=tuple(str(d) for d in job.input_datasets),
            output_datasets=tuple(str(d) for d in job.output_datasets),
            thresholds=_thresholds(job),
        )
        for job in await live_jobs(tx)
    ]


async def measure_queues(tx: Transaction, now: datetime) -> dict[uuid.UUID, QueueMeasurement]:
    """Depth and age of every job's queue, in one grouped query.

    Jobs with no queued task are absent (their measurement is zero).
    """
    return {
        job_id: QueueMeasurement(
            q.depth,
            0.0
            if q.oldest_created_at is None
            else max(0.0, (now - q.oldest_created_at).total_seconds()),
        )
        for job_id, q in (await tx.concurrency.queued_by_job()).items()
    }


async def read_paused(tx: Transaction) -> dict[uuid.UUID, str | None]:
    """Every paused job and its reason (whoever paused it)."""
    return await tx.job_states.paused_jobs()


# --- the service ------------------------------------------------------------


@dataclass(frozen=True)
class BackpressureReport:
    """What one :meth:`BackpressureMonitor.run_once` saw and did."""

    measurements: dict[uuid.UUID, QueueMeasurement]
    plan: BackpressurePlan
    paused: list[uuid.UUID] = field(default_factory=list)
    """Producers this round paused."""
    resumed: list[uuid.UUID] = field(default_factory=list)
    """Producers this round resumed."""


class BackpressureMonitor(DispatcherService):
    """Pauses and resumes producers from queue measurements; see the module doc."""

    def __init__(
        self,
        repo: Repository,
        *,
        clock: Clock | None = None,
        config: BackpressureConfig | None = None,
    ) -> None:
        self.config = config or BackpressureConfig()
        super().__init__(repo, self.config.interval_seconds, clock=clock)

    def handicap_seconds(self, tier: str) -> float:
        """The claim-order handicap the router gives a new task of a job in ``tier``."""
        return self.config.handicap_seconds(tier)

    async def paused_jobs(self) -> dict[uuid.UUID, str]:
        """Every paused job and why (the router creates no tasks for them)."""
        async with self.repo.read() as tx:
            paused = await read_paused(tx)
        return {job_id: reason or "paused" for job_id, reason in paused.items()}

    async def run_once(self) -> BackpressureReport:
        """Measure every queue, then pause and resume producers accordingly."""
        now = self.clock.now()
        # Read without the write lock (SQLite has one writer); the writes below
        # are conditional, so a concurrent monitor cannot make us journal twice.
        async with self.repo.read() as tx:
            jobs = await load_job_graph(tx)
            measurements = await measure_queues(tx, now)
            current = await read_paused(tx)
        ours = {
            job_id: reason
            for job_id, reason in current.items()
            if reason is not None and reason.startswith(PAUSE_PREFIX)
        }
        plan = plan_backpressure(jobs, measurements, self.config, paused=ours.keys())
        report = BackpressureReport(measurements, plan)
        work = []
        for job_id in by_job_id(plan.pauses.keys() | ours.keys()):
            pause = plan.pauses.get(job_id)
            if pause is None:
                work.append(job_id)  # ours, no longer needed: resume
            elif job_id in ours:
                if cause_labels(ours[job_id]) != pause.cause_labels:
                    work.append(job_id)  # another set of queues holds it now
            elif job_id not in current:
                work.append(job_id)  # a new pause (one set by hand is left alone)
        if not work:
            return report
        async with self.repo.transaction() as wtx:
            # One row at a time in job id order: the lock order of every
            # job_states locker (see job_states.py), so none deadlock.
            for job_id in work:
                pause = plan.pauses.get(job_id)
                if pause is None:
                    if await self._resume(wtx, job_id, ours[job_id], now):
                        report.resumed.append(job_id)
                elif job_id not in ours:
                    if await self._pause(wtx, job_id, pause, plan, now):
                        report.paused.append(job_id)
                else:
                    await self._relabel(wtx, job_id, pause, now)
        return report

    async def _pause(
        self,
        tx: Transaction,
        job_id: uuid.UUID,
        pause: Pause,
        plan: BackpressurePlan,
        now: datetime,
    ) -> bool:
        if not await upsert_job_state(
            tx,
            job_id,
            {"paused": True, "pause_reason": pause.reason, "paused_at": now},
            now=now,
            expected={"paused": False},
        ):
            return False  # paused meanwhile (by another monitor, or by hand)
        detail = {
            "causes": [
                {
                    "job_id": str(c.job_id),
                    "job": c.label,
                    "depth": plan.pressures[c.job_id].measurement.depth,
                    "age_seconds": plan.pressures[c.job_id].measurement.age_seconds,
                    "reason": c.reason,
                }
                for c in pause.causes
            ]
        }
        await tx.journal.append(job_id, "paused", pause.reason, now=now, detail=detail)
        return True

    async def _resume(self, tx: Transaction, job_id: uuid.UUID, reason: str, now: datetime) -> bool:
        if not await tx.job_states.resume_if_paused_by(job_id, PAUSE_PREFIX, now=now):
            return False
        await tx.journal.append(
            job_id,
            "resumed",
            "backpressure cleared; was " + reason.removeprefix(PAUSE_PREFIX),
            now=now,
            detail={"previous_reason": reason},
        )
        return True

    async def _relabel(
        self, tx: Transaction, job_id: uuid.UUID, pause: Pause, now: datetime
    ) -> None:
        # Still paused, for another set of queues: the reason follows, no journal
        # entry (the journal records transitions, not every change of cause).
        await tx.job_states.relabel_if_paused_by(job_id, PAUSE_PREFIX, pause.reason, now=now)
