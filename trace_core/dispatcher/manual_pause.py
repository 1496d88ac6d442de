"""Pausing a job by hand, and lifting only that pause: :class:`ManualPause`.

A manual pause is the very ``job_states.paused`` flag backpressure sets, so
it takes effect where backpressure's does: the router holds the job's events,
sources, cron, backfill and the manual trigger start nothing for it. What
tells the two apart is the reason: a manual pause reads
``"manual by <who>"`` (:data:`MANUAL_PREFIX`), and the backpressure monitor
only ever lifts or relabels reasons starting with its own prefix, so it never
lifts a manual pause. A manual resume, conversely, lifts only a manual pause:
a job held by backpressure stays held until its queues drain.

Pausing a job that backpressure holds turns that pause into a manual one
(the person's decision wins; once they resume, backpressure pauses it again
on its next round if the queues are still over their limits). Pausing a job
already paused by hand changes nothing, and keeps who paused it first.
Both transitions are journaled.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from dataclasses import dataclass

from trace_core.clock import Clock, SystemClock
from trace_core.errors import InvalidInput, NotFound
from trace_core.storage.ports.job_states import by_job_id
from trace_core.storage.protocol import Repository

__all__ = ["MANUAL_PREFIX", "ManualPause", "PauseChange"]

MANUAL_PREFIX = "manual by "
"""How the reason of a pause set by hand starts."""

_MAX_WHO = 200
_LIVE = ("current", "building")


@dataclass(frozen=True)
class PauseChange:
    """One job's pause state after a manual pause or resume."""

    job_id: uuid.UUID
    paused: bool
    reason: str | None
    changed: bool
    """Whether this request changed it (False: it already was so, or, for a
    resume, the job is held by backpressure, which a person does not lift)."""


class ManualPause:
    """Pause and resume jobs by hand; see the module docstring."""

    def __init__(self, repo: Repository, *, clock: Clock | None = None) -> None:
        self.repo = repo
        self.clock = clock or SystemClock()

    async def live_job_ids(self, org_slug: str, dag: str, job: str) -> list[uuid.UUID]:
        """Every live job ``dag/job`` of org ``org_slug`` (the current version's,
        and the building one's during a rebuild): what a machine's pause names.
        :class:`~trace_core.errors.NotFound` (the explainer's words) when none is."""
        async with self.repo.read() as tx:
            org_id = await tx.registry.find_org(org_slug)
            jobs = [] if org_id is None else await tx.catalog.jobs(org_id)
        found = [
            j.job_id
            for j in jobs
            if j.dag_name == dag and j.name == job and j.version_status in _LIVE
        ]
        if not found:
            raise NotFound(f"no job {job!r} in DAG {dag!r} of org {org_slug!r}")
        return found

    async def pause(self, job_ids: Collection[uuid.UUID], *, by: str) -> list[PauseChange]:
        """Pause ``job_ids`` by hand on behalf of ``by`` (who, for the reason)."""
        who = by.strip()
        if not who or len(who) > _MAX_WHO:
            raise InvalidInput("by", f"must be 1..{_MAX_WHO} non-blank characters")
        reason = MANUAL_PREFIX + who
        now = self.clock.now()
        changes = []
        async with self.repo.transaction() as tx:
            ordered = by_job_id(job_ids)
            # Rows created and locked first, in lock order: the read below and
            # the write after it cannot interleave with a backpressure round.
            await tx.job_states.ensure(ordered, now=now)
            await tx.job_states.lock(ordered)
            for job_id in ordered:
                paused, was = await tx.job_states.pause_state(job_id)
                if paused and was is not None and was.startswith(MANUAL_PREFIX):
                    changes.append(PauseChange(job_id, True, was, False))
                    continue
                await tx.job_states.update_if_matches(
                    job_id, {"paused": True, "pause_reason": reason, "paused_at": now}, now=now
                )
                detail = {"previous_reason": was} if paused else {}
                await tx.journal.append(job_id, "paused", reason, now=now, detail=detail)
                changes.append(PauseChange(job_id, True, reason, True))
        return changes

    async def resume(self, job_ids: Collection[uuid.UUID], *, by: str) -> list[PauseChange]:
        """Lift the manual pause of ``job_ids``; any other pause is left alone."""
        now = self.clock.now()
        changes = []
        async with self.repo.transaction() as tx:
            for job_id in by_job_id(job_ids):
                paused, was = await tx.job_states.pause_state(job_id)
                if await tx.job_states.resume_if_paused_by(job_id, MANUAL_PREFIX, now=now):
                    await tx.journal.append(
                        job_id,
                        "resumed",
                        f"resumed by {by.strip()}; was {was}",
                        now=now,
                        detail={"previous_reason": was},
                    )
                    changes.append(PauseChange(job_id, False, None, True))
                else:
                    changes.append(PauseChange(job_id, paused, was, False))
        return changes
