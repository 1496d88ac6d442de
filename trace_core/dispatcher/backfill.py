"""Backfill: a rematerializing job starts from the history of its inputs.

When a deploy creates a building DAG version, its reactive jobs that build a
new dataset version only see *new* events through routing. The history their
inputs already hold is replayed to them once (:meth:`EventRouter.replay`),
after which a ``backfilled`` journal entry marks the job done. The replay is
idempotent (dedupe keys), so a crash midway just replays again on the next
round; a job paused by backpressure is retried on a later round.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from trace_core.clock import Clock
from trace_core.dag import live_jobs
from trace_core.dispatcher.periodic import DispatcherService, require_positive
from trace_core.dispatcher.routing import EventRouter
from trace_core.storage.protocol import Repository

__all__ = ["BACKFILLED", "BackfillConfig", "Backfiller"]

log = logging.getLogger(__name__)

BACKFILLED = "backfilled"
"""Journal kind marking a building job whose input history was replayed."""


@dataclass(frozen=True)
class BackfillConfig:
    """Backfill settings."""

    interval_seconds: float = 5.0

    def __post_init__(self) -> None:
        require_positive("BackfillConfig.interval_seconds", self.interval_seconds)


class Backfiller(DispatcherService):
    """Replays input history to building jobs, once each (see the module docstring)."""

    def __init__(
        self,
        repo: Repository,
        router: EventRouter,
        *,
        clock: Clock | None = None,
        config: BackfillConfig | None = None,
    ) -> None:
        self.config = config or BackfillConfig()
        super().__init__(repo, self.config.interval_seconds, clock=clock)
        self.router = router

    async def run_once(self) -> list[uuid.UUID]:
        """Backfill every building job not backfilled yet; the jobs completed now."""
        async with self.repo.read() as tx:
            building = {
                job.job_id
                for job in await live_jobs(tx)
                if job.role == "building" and job.activation == "reactive"
            }
            if not building:
                return []
            done = await tx.journal.jobs_with_entry(BACKFILLED, building)
        completed = []
        for job_id in sorted(building - done):
            report = await self.router.replay({job_id})
            if report.deferred:
                continue  # paused: its history waits for the pause to lift
            async with self.repo.transaction() as tx:
                await tx.journal.append(
                    job_id,
                    BACKFILLED,
                    f"replayed {report.events} input events: {report.tasks_created} tasks"
                    f" created, {report.tasks_existing} existed",
                    now=self.clock.now(),
                    detail={"events": report.events, "created": report.tasks_created},
                )
            log.info("backfilled job %s from %d input events", job_id, report.events)
            completed.append(job_id)
        return completed
