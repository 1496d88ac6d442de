"""The maintenance side of the inbox job lifecycle: what a supervisor loop runs.

Reclaim of expired leases (euterpe-contract.md §4), due retries back to
``queued`` (§3 ``failed -> queued``), an operator's dead letter of failed jobs
(§3 ``failed -> dead_letter``) and retention pruning with tombstones (§6
``410 Gone``). Each transition writes the same history rows and events as a
worker's, in its transaction, through the service's
:class:`~trace_core.euterpe.job_writer.JobWriter`.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from trace_core.errors import InvalidInput
from trace_core.euterpe.events import NormalizedError
from trace_core.euterpe.job_records import Transition, chain, error_text, job_id_of
from trace_core.euterpe.job_writer import WriteScope
from trace_core.euterpe.jobs import InboxJobs
from trace_core.leasing import FailOutcome, ReclaimHooks, ReclaimReport
from trace_core.model import Fence
from trace_core.storage.protocol import Transaction

__all__ = ["InboxMaintenance"]

_FINISHED = ("succeeded", "dead_letter")


class InboxMaintenance:
    """Reclaim, due retries, the operator's dead letter and pruning, over the
    queue, clock and writer of an :class:`~trace_core.euterpe.jobs.InboxJobs`."""

    def __init__(self, jobs: InboxJobs) -> None:
        self.jobs = jobs

    async def reclaim_expired(self, *, limit: int | None = None) -> ReclaimReport:
        """Fail every expired lease (a new claim_version fences the old holder
        out): retried, or ``failed`` then ``dead_letter`` when exhausted, with
        a ``lease_expired`` error in the history and events like a worker's
        failure, in the reclaim's transaction."""
        writer = self.jobs.writer
        now = self.jobs.clock.now()
        stages: dict[Any, str] = {}
        errors: dict[Any, NormalizedError] = {}
        written: list[uuid.UUID] = []

        async def reasons(t: Transaction, fences: Sequence[Fence]) -> Mapping[Any, str]:
            snaps = await t.inbox.lock_jobs_for_transition([job_id_of(f) for f in fences])
            for job_id, snap in snaps.items():
                stages[job_id] = snap.status
                errors[job_id] = NormalizedError(
                    code="lease_expired",
                    message=f"lease expired in stage {snap.status} "
                    f"(attempt {snap.attempt_count} of {snap.max_attempts})",
                    retryable=True,
                )
            return {job_id: error_text(err) for job_id, err in errors.items()}

        async def failed(t: Transaction, fence: Fence, outcome: FailOutcome, reason: str) -> None:
            job_id = job_id_of(fence)
            error = errors[job_id]
            w = WriteScope(t, now, writer)
            await w.record(
                [Transition(job_id, chain(stages[job_id], outcome.path), error.code, error)]
            )
            written.extend(w.events)

        report = await self.jobs.queue.reclaim_expired(
            limit=limit, hooks=ReclaimHooks(reasons=reasons, failed=failed)
        )
        writer.committed(written)  # reclaim_expired committed its transaction
        return report

    async def requeue_due(self, *, limit: int | None = None) -> list[uuid.UUID]:
        """Move failed jobs whose retry time came back to ``queued`` (each with
        its history row and ``queued`` event); the ids moved."""
        async with self.jobs.writer.scope() as w:
            ids = [job_id_of(i) for i in await self.jobs.queue.requeue_due(limit=limit, tx=w.t)]
            await w.record([Transition(i, [("failed", "queued")], "retry due") for i in ids])
        return ids

    async def dead_letter_failed(
        self, job_ids: Sequence[uuid.UUID], *, error: NormalizedError
    ) -> set[uuid.UUID]:
        """Dead-letter failed jobs at once (an operator's "unrecoverable"
        decision), with their history and ``dead_letter`` events; the ids
        moved. Jobs in any other status are left alone: the table has no
        other edge into ``dead_letter``."""
        async with self.jobs.writer.scope() as w:
            moved = await self.jobs.queue.dead_letter(job_ids, reason=error_text(error), tx=w.t)
            ids = sorted(job_id_of(i) for i in moved)
            await w.record(
                [Transition(i, [("failed", "dead_letter")], error.code, error) for i in ids]
            )
        return set(ids)

    async def prune(self, older_than: timedelta) -> list[uuid.UUID]:
        """Remove finished jobs (succeeded or dead-lettered more than
        ``older_than`` ago, every event delivered or dead-lettered), leaving
        a tombstone each, in batches of one transaction; the ids removed."""
        if older_than < timedelta(0):
            raise InvalidInput("older_than", "must not be negative")
        batch_size = self.jobs.config.prune_batch
        pruned: list[uuid.UUID] = []
        while True:
            now = self.jobs.clock.now()
            async with self.jobs.repo.transaction() as t:
                batch = await t.inbox.prune_finished_before(
                    now - older_than, statuses=_FINISHED, limit=batch_size, now=now
                )
            pruned.extend(tomb.job_id for tomb in batch)
            if len(batch) < batch_size:
                return pruned
