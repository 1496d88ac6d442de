"""The lifecycle of an inbox job (euterpe-contract.md §3, §4, §5, §8).

:class:`InboxJobs` is the one way Euterpe's services move a job: the API
enqueues, workers claim, advance, heartbeat, succeed and fail, a maintenance
loop reclaims expired leases, requeues due retries and prunes old jobs. The
ownership protocol is the generic one (:class:`~trace_core.leasing.LeaseQueue`
over :data:`~trace_core.model.INBOX_JOBS`); every transition writes its
history row and its webhook event in the transaction of the status change
(:mod:`trace_core.euterpe.job_records`).

Counters are kept apart (§5): ``attempt_count`` moves only when a claim starts
an execution attempt (a hand-back with a later availability refunds it);
``credential_refresh_count`` only through :meth:`InboxJobs.record_credential_refresh`,
each with its own budget. Every write of a worker presents its whole fence
(job id, attempt, lease token and claim_version); a stale one changes
nothing and raises :class:`~trace_core.errors.StaleClaim`.
"""

from __future__ import annotations

import logging
import random
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from trace_core.clock import Clock, SystemClock
from trace_core.errors import ConfigurationError, InvalidInput, NotFound, StaleClaim
from trace_core.euterpe.events import NormalizedError
from trace_core.euterpe.job_outputs import validate_outputs
from trace_core.euterpe.job_records import Transition, error_text, record
from trace_core.euterpe.job_status import JobPruned, JobStatus, job_status_of
from trace_core.leasing import FailOutcome, LeaseConfig, LeaseQueue, ReclaimHooks, ReclaimReport
from trace_core.model import INBOX_JOBS, ClaimOutcome, Fence, Lease
from trace_core.retry import RetryClass, RetryPolicy
from trace_core.storage.ports.inbox import NewInboxJob, SealedCredentialColumns
from trace_core.storage.protocol import Repository, Transaction, within

__all__ = ["InboxJobs", "JobsConfig", "RefreshAllowance"]

log = logging.getLogger(__name__)

STAGES = ("fetching", "processing", "uploading")
"""The stages a worker advances through between ``claimed`` and ``succeeded``."""

_TERMINAL = ("succeeded", "dead_letter")

OnCommit = Callable[[Sequence[uuid.UUID]], None]


@dataclass(frozen=True)
class JobsConfig:
    """Settings of the job lifecycle."""

    lease_seconds: float = 60.0
    """How long a claim lasts without a heartbeat."""
    max_attempts: int = 5
    """Execution attempts of a job unless the enqueue says otherwise."""
    event_max_attempts: int = 10
    """Delivery attempts of each webhook event (the deliverer's own budget)."""
    max_claim_batch: int = 25
    """Upper bound on one claim round."""
    prune_batch: int = 500
    """Jobs removed per pruning transaction."""

    def __post_init__(self) -> None:
        if self.lease_seconds <= 0:
            raise ConfigurationError("JobsConfig.lease_seconds must be > 0")
        for name in ("max_attempts", "event_max_attempts", "max_claim_batch", "prune_batch"):
            if getattr(self, name) < 1:
                raise ConfigurationError(f"JobsConfig.{name} must be >= 1")


@dataclass(frozen=True)
class RefreshAllowance:
    """The answer of :meth:`InboxJobs.record_credential_refresh`."""

    allowed: bool
    """Whether the worker may call the requester's ``refresh_url`` now."""
    count: int
    """Credential refreshes of the job so far, this one included when allowed."""
    budget: int


class InboxJobs:
    """The job lifecycle service over ``LeaseQueue(repo, INBOX_JOBS)``.

    ``on_commit`` (settable at any time) is called with the ids of the events
    written, after each commit of this service that wrote some, so that a
    deliverer in this process can be woken at once (§12); the transactions
    also notify :data:`~trace_core.euterpe.job_records.EVENTS_CHANNEL`.
    """

    def __init__(
        self,
        repo: Repository,
        *,
        clock: Clock | None = None,
        config: JobsConfig | None = None,
        retry: RetryPolicy | None = None,
        rng: random.Random | None = None,
        on_commit: OnCommit | None = None,
        new_event_id: Callable[[], uuid.UUID] = uuid.uuid4,
    ) -> None:
        self.repo = repo
        self.clock = clock or SystemClock()
        self.config = config or JobsConfig()
        self.retry = retry or RetryPolicy()
        self._rng = rng or random.Random()
        self.on_commit = on_commit
        self._new_event_id = new_event_id
        self.queue = LeaseQueue(
            repo,
            INBOX_JOBS,
            clock=self.clock,
            config=LeaseConfig(
                lease_seconds=self.config.lease_seconds, max_batch=self.config.max_claim_batch
            ),
            retry=self.retry,
            rng=self._rng,
        )

    # --- the requester's side ------------------------------------------------

    async def enqueue(
        self,
        tx: Transaction | None = None,
        *,
        requester_id: str,
        request: Mapping[str, Any],
        job_id: uuid.UUID | None = None,
        status_webhook_url: str | None = None,
        refresh_url: str | None = None,
        sealed: SealedCredentialColumns | None = None,
        credential_version: int = 0,
        max_attempts: int | None = None,
    ) -> uuid.UUID:
        """Insert a ``queued`` job with its history row and ``queued`` event, in
        one transaction (``tx`` to join the caller's, e.g. with its idempotency
        key); its id. ``job_id`` lets the caller seal credentials for the id
        first (the AAD binds it)."""
        if not requester_id:
            raise InvalidInput("requester_id", "must not be empty")
        attempts = self.config.max_attempts if max_attempts is None else max_attempts
        if attempts < 1:
            raise InvalidInput("max_attempts", f"must be >= 1, got {attempts}")
        if credential_version < 0:
            raise InvalidInput("credential_version", "must be >= 0")
        job = NewInboxJob(
            job_id=job_id or uuid.uuid4(),
            requester_id=requester_id,
            request=dict(request),
            status_webhook_url=status_webhook_url,
            refresh_url=refresh_url,
            max_attempts=attempts,
            available_at=self.clock.now(),
            credential_version=credential_version,
            sealed=sealed,
        )
        now = self.clock.now()
        async with within(self.repo, tx) as t:
            await t.inbox.insert_job(job, now=now)
            events = await self._record(t, [Transition(job.job_id, [(None, "queued")])], now)
        if tx is None:
            self._committed(events)
        return job.job_id

    async def status(self, job_id: uuid.UUID, *, requester_id: str | None = None) -> JobStatus:
        """The status read model of a job (§6).

        :class:`NotFound` for an unknown job, and for another requester's when
        ``requester_id`` is given (its existence is not revealed);
        :class:`~trace_core.euterpe.job_status.JobPruned` for a pruned one."""
        async with self.repo.read() as t:
            found = await t.inbox.job_status(job_id)
            tomb = await t.inbox.tombstone(job_id) if found is None else None
        if found is not None and requester_id in (None, found.job.requester_id):
            return job_status_of(found)
        if tomb is not None and requester_id in (None, tomb.requester_id):
            raise JobPruned(tomb)
        raise NotFound(f"inbox job {job_id} does not exist")

    # --- the worker's side ---------------------------------------------------

    async def claim_batch(self, worker_id: str, limit: int) -> list[Lease]:
        """Lease up to ``limit`` queued jobs; each claim writes its history and
        ``claimed`` event in the claim's transaction."""
        now = self.clock.now()
        async with self.repo.transaction() as t:
            leases = await self.queue.claim_batch(worker_id, limit, tx=t)
            events = await self._record(t, [self._claimed(lease) for lease in leases], now)
        self._committed(events)
        return leases

    async def claim(self, job_id: uuid.UUID, worker_id: str) -> ClaimOutcome:
        """Lease one job by id, or say why not (nothing is written then)."""
        now = self.clock.now()
        async with self.repo.transaction() as t:
            outcome = await self.queue.claim(job_id, worker_id, tx=t)
            lease = outcome.lease
            events = await self._record(t, [self._claimed(lease)] if lease else [], now)
        self._committed(events)
        return outcome

    async def heartbeat(self, fence: Fence) -> datetime:
        """Extend the lease; the new expiry. No history: the stage did not change."""
        return await self.queue.heartbeat(_whole(fence))

    async def advance(self, fence: Fence, stage: str) -> None:
        """``claimed -> fetching -> processing -> uploading``, fenced;
        :class:`~trace_core.errors.InvalidTransition` for a stage out of order."""
        fence = _whole(fence)
        if stage not in STAGES:
            raise InvalidInput("stage", f"must be one of {list(STAGES)}, got {stage!r}")
        [source] = INBOX_JOBS.lifecycle.sources_of(stage) & INBOX_JOBS.leased
        await self._write(
            fence,
            lambda t: self.queue.advance(fence, stage, tx=t),
            lambda _: Transition(_job_id(fence), [(source, stage)]),
        )

    async def succeed(self, fence: Fence, outputs: Sequence[Mapping[str, Any]]) -> None:
        """``uploading -> succeeded`` with the outputs (each ``{key, size,
        sha256, preset}``), stored with the status in one fenced write."""
        fence = _whole(fence)
        checked = validate_outputs(outputs)
        await self._write(
            fence,
            lambda t: self.queue.complete(fence, values={"outputs": checked}, tx=t),
            lambda _: Transition(_job_id(fence), [("uploading", "succeeded")], outputs=checked),
        )

    async def release(
        self, fence: Fence, *, reason: str, available_at: datetime | None = None
    ) -> None:
        """Hand a leased job back to ``queued`` (a worker shutting down), not
        before ``available_at`` (default now); the attempt is refunded: the
        execution did not fail."""
        fence = _whole(fence)
        when = available_at or self.clock.now()
        await self._write(
            fence,
            lambda t: self.queue.requeue(fence, reason=reason, available_at=when, tx=t),
            lambda before: Transition(_job_id(fence), [(before, "queued")], reason=reason),
        )

    async def fail(
        self, fence: Fence, error: NormalizedError, *, http_status: int | None = None
    ) -> FailOutcome:
        """Fail the current attempt with ``error``, classified by
        :meth:`RetryPolicy.classify` (``http_status``, else the error's own):

        - retryable (423, 5xx, a retryable local error) or throttled (429):
          ``failed`` with a retry time while attempts remain, else ``failed``
          then ``dead_letter`` in one transaction;
        - fatal: ``failed`` then ``dead_letter`` at once;
        - credential refresh (401/403): while the refresh budget remains, the
          job goes back to ``queued`` after a backoff without spending an
          execution attempt; once spent, ``failed`` then ``dead_letter``.

        Every status passed is in the history and has its event, carrying
        ``error``; the outcome's ``path`` lists them."""
        fence = _whole(fence)
        status = http_status if http_status is not None else error.http_status
        retry_class = self.retry.classify(status, retryable=error.retryable)
        text = error_text(error)
        now = self.clock.now()
        async with self.repo.transaction() as t:
            before = (await t.inbox.lock_jobs_for_transition([_job_id(fence)])).get(_job_id(fence))
            if before is None:
                raise NotFound(f"inbox job {fence.item_id} does not exist")
            outcome = None
            if retry_class is RetryClass.CREDENTIAL_REFRESH:
                decision = self.retry.decide(
                    retry_class,
                    attempt=max(1, fence.attempt),
                    max_attempts=before.max_attempts,
                    now=now,
                    credential_refreshes=before.credential_refresh_count,
                    rng=self._rng,
                )
                if decision.retry:
                    delay = self.retry.normal.delay(
                        max(1, before.credential_refresh_count), self._rng
                    )
                    await self.queue.requeue(fence, reason=text, available_at=now + delay, tx=t)
                    outcome = FailOutcome("queued", True, ("queued",))
                else:
                    retry_class = RetryClass.FATAL  # the refresh budget is spent
            if outcome is None:
                outcome = await self.queue.fail(fence, text, retry_class=retry_class, tx=t)
            steps = _chain(before.status, outcome.path)
            events = await self._record(
                t, [Transition(_job_id(fence), steps, reason=error.code, error=error)], now
            )
        self._committed(events)
        return outcome

    async def record_credential_refresh(self, fence: Fence) -> RefreshAllowance:
        """Count one credential refresh of the current claim (§7), before the
        worker calls the requester's ``refresh_url``; whether the budget
        (:attr:`RetryPolicy.max_credential_refreshes`) allowed it. Never
        touches ``attempt_count`` nor the status."""
        fence = _whole(fence)
        budget = self.retry.max_credential_refreshes
        async with self.repo.transaction() as t:
            counted = await t.inbox.count_credential_refresh_if_current_claim(fence, budget=budget)
        if counted is None:
            raise StaleClaim(INBOX_JOBS.name, fence.item_id, "not the current claim of a live job")
        return RefreshAllowance(counted.counted, counted.count, budget)

    # --- maintenance ---------------------------------------------------------

    async def reclaim_expired(self, *, limit: int | None = None) -> ReclaimReport:
        """Fail every expired lease (a new claim_version fences the old holder
        out): retried, or ``failed`` then ``dead_letter`` when exhausted, with
        the same history and events as a worker's failure."""
        now = self.clock.now()
        stages: dict[Any, str] = {}
        errors: dict[Any, NormalizedError] = {}
        events: list[uuid.UUID] = []

        async def reasons(t: Transaction, fences: Sequence[Fence]) -> Mapping[Any, str]:
            snaps = await t.inbox.lock_jobs_for_transition([_job_id(f) for f in fences])
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
            error = errors[fence.item_id]
            steps = _chain(stages[fence.item_id], outcome.path)
            events.extend(
                await self._record(
                    t, [Transition(_job_id(fence), steps, reason=error.code, error=error)], now
                )
            )

        report = await self.queue.reclaim_expired(
            limit=limit, hooks=ReclaimHooks(reasons=reasons, failed=failed)
        )
        self._committed(events)
        return report

    async def requeue_due(self, *, limit: int | None = None) -> list[uuid.UUID]:
        """Move failed jobs whose retry time came back to ``queued`` (each with
        its history row and ``queued`` event); the ids moved."""
        now = self.clock.now()
        async with self.repo.transaction() as t:
            ids = [_job_id(i) for i in await self.queue.requeue_due(limit=limit, tx=t)]
            transitions = [Transition(i, [("failed", "queued")], reason="retry due") for i in ids]
            events = await self._record(t, transitions, now)
        self._committed(events)
        return ids

    async def dead_letter_failed(
        self, job_ids: Sequence[uuid.UUID], *, error: NormalizedError
    ) -> set[uuid.UUID]:
        """Dead-letter failed jobs at once (an operator's "unrecoverable"
        decision, §3 ``failed -> dead_letter``), with their history and
        ``dead_letter`` events; the ids moved. Jobs in any other status are
        left alone (the table has no other edge into ``dead_letter``)."""
        now = self.clock.now()
        async with self.repo.transaction() as t:
            moved = await self.queue.dead_letter(job_ids, reason=error_text(error), tx=t)
            ids = sorted(_job_id(i) for i in moved)
            transitions = [
                Transition(i, [("failed", "dead_letter")], reason=error.code, error=error)
                for i in ids
            ]
            events = await self._record(t, transitions, now)
        self._committed(events)
        return set(ids)

    async def prune(self, older_than: timedelta) -> list[uuid.UUID]:
        """Remove finished jobs (succeeded or dead-lettered more than
        ``older_than`` ago, with every event delivered or dead-lettered),
        leaving a tombstone each; in batches, one transaction each. The ids."""
        if older_than < timedelta(0):
            raise InvalidInput("older_than", "must not be negative")
        pruned: list[uuid.UUID] = []
        while True:
            now = self.clock.now()
            async with self.repo.transaction() as t:
                batch = await t.inbox.prune_finished_before(
                    now - older_than,
                    statuses=_TERMINAL,
                    limit=self.config.prune_batch,
                    now=now,
                )
            pruned.extend(tomb.job_id for tomb in batch)
            if len(batch) < self.config.prune_batch:
                return pruned

    # --- internals -----------------------------------------------------------

    async def _write(
        self,
        fence: Fence,
        write: Callable[[Transaction], Any],
        transition: Callable[[str], Transition],
    ) -> None:
        """One fenced protocol write and its records, in one transaction.
        ``transition`` gets the status the job was in before the write."""
        now = self.clock.now()
        async with self.repo.transaction() as t:
            job_id = _job_id(fence)
            snaps = await t.inbox.lock_jobs_for_transition([job_id])
            before = snaps[job_id].status if job_id in snaps else ""
            await write(t)  # raises StaleClaim / InvalidTransition / NotFound
            events = await self._record(t, [transition(before)], now)
        self._committed(events)

    async def _record(
        self, t: Transaction, transitions: Sequence[Transition], now: datetime
    ) -> list[uuid.UUID]:
        return await record(
            t,
            transitions,
            now=now,
            event_max_attempts=self.config.event_max_attempts,
            new_event_id=self._new_event_id,
        )

    @staticmethod
    def _claimed(lease: Lease) -> Transition:
        return Transition(_job_id(lease), [("queued", "claimed")])

    def _committed(self, events: Sequence[uuid.UUID]) -> None:
        """Call ``on_commit`` after a commit that wrote events. A failing hook
        is logged, not raised: the transition is committed already."""
        hook = self.on_commit
        if not events or hook is None:
            return
        try:
            hook(list(events))
        except Exception:
            log.exception("euterpe: on_commit hook failed after %d events", len(events))


def _whole(fence: Fence) -> Fence:
    """``fence``, refused unless it is whole: a worker's write names the
    claim_version too (§4: ``WHERE job_id=? AND claim_version=?``)."""
    if fence.claim_version is None:
        raise ConfigurationError(
            f"inbox job {fence.item_id}: a worker's write must present its claim_version"
        )
    return fence


def _job_id(item: Fence | Lease | object) -> uuid.UUID:
    """The job id of a fence, a lease or a protocol answer (inbox ids are UUIDs)."""
    value = item.item_id if isinstance(item, (Fence, Lease)) else item
    if not isinstance(value, uuid.UUID):
        raise ConfigurationError(f"an inbox job id is a UUID, got {value!r}")
    return value


def _chain(source: str, path: Sequence[str]) -> list[tuple[str | None, str]]:
    """``source -> path[0] -> path[1] …`` as steps."""
    steps: list[tuple[str | None, str]] = []
    for target in path:
        steps.append((source, target))
        source = target
    return steps
