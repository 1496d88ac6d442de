"""The lifecycle of an inbox job (euterpe-contract.md §3, §4, §5, §8).

:class:`InboxJobs` is how the API and the workers move a job: enqueue, claim,
advance, heartbeat, succeed, release and fail, plus the status read; the
maintenance side (reclaim, due retries, pruning) is
:class:`~trace_core.euterpe.job_maintenance.InboxMaintenance`. The ownership
protocol is the generic one (:class:`~trace_core.leasing.LeaseQueue` over
:data:`~trace_core.model.INBOX_JOBS`); every transition writes its history row
and its webhook event in the transaction of the status change
(:mod:`trace_core.euterpe.job_writer`).

Counters are kept apart (§5): ``attempt_count`` moves only when a claim starts
an execution attempt (a hand-back refunds it: the execution did not fail);
``credential_refresh_count`` only through :meth:`InboxJobs.record_credential_refresh`;
each has its own budget. Every write of a worker presents its whole fence
(job id, attempt, lease token and claim_version); a stale one changes
nothing and raises :class:`~trace_core.errors.StaleClaim`.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from trace_core.clock import Clock, SystemClock
from trace_core.errors import ConfigurationError, InvalidInput, NotFound, StaleClaim
from trace_core.euterpe.events import NormalizedError
from trace_core.euterpe.job_outputs import validate_outputs
from trace_core.euterpe.job_records import Transition, chain, error_text, job_id_of
from trace_core.euterpe.job_status import JobPruned, JobStatus, job_status_of
from trace_core.euterpe.job_writer import JobWriter, OnCommit, WriteScope
from trace_core.leasing import FailOutcome, LeaseConfig, LeaseQueue
from trace_core.model import INBOX_JOBS, ClaimOutcome, Fence, Lease
from trace_core.retry import RetryClass, RetryPolicy
from trace_core.storage.ports import JobSnapshot, NewInboxJob, SealedCredentials
from trace_core.storage.protocol import Repository, Transaction

__all__ = ["STAGES", "InboxJobs", "JobsConfig", "RefreshAllowance"]

STAGES = ("fetching", "processing", "uploading")
"""The stages a worker advances through between ``claimed`` and ``succeeded``."""


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
    written, after each commit of this service (and of its
    :class:`~trace_core.euterpe.job_maintenance.InboxMaintenance`) that wrote
    some, so that a deliverer in this process is woken at once (§12); the
    transactions also notify :data:`~trace_core.euterpe.job_records.EVENTS_CHANNEL`.
    ``new_event_id`` is the source of event ids (injectable like the clock).
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
        self.rng = rng or random.Random()
        self.writer = JobWriter(
            repo,
            self.clock,
            event_max_attempts=self.config.event_max_attempts,
            new_event_id=new_event_id,
            on_commit=on_commit,
        )
        self.queue = LeaseQueue(
            repo,
            INBOX_JOBS,
            clock=self.clock,
            config=LeaseConfig(
                lease_seconds=self.config.lease_seconds, max_batch=self.config.max_claim_batch
            ),
            retry=self.retry,
            rng=self.rng,
        )

    @property
    def on_commit(self) -> OnCommit | None:
        """The hook called after each commit that wrote events."""
        return self.writer.on_commit

    @on_commit.setter
    def on_commit(self, hook: OnCommit | None) -> None:
        self.writer.on_commit = hook

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
        sealed: SealedCredentials | None = None,
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
        async with self.writer.scope(tx) as w:
            job = NewInboxJob(
                job_id=job_id or uuid.uuid4(),
                requester_id=requester_id,
                request=dict(request),
                status_webhook_url=status_webhook_url,
                refresh_url=refresh_url,
                max_attempts=attempts,
                available_at=w.now,
                credential_version=credential_version,
                sealed=sealed,
            )
            await w.t.inbox.insert_job(job, now=w.now)
            await w.record([Transition(job.job_id, [(None, "queued")])])
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
        async with self.writer.scope() as w:
            leases = await self.queue.claim_batch(worker_id, limit, tx=w.t)
            await w.record([_claimed(lease) for lease in leases])
        return leases

    async def claim(self, job_id: uuid.UUID, worker_id: str) -> ClaimOutcome:
        """Lease one job by id, or say why not (nothing is written then)."""
        async with self.writer.scope() as w:
            outcome = await self.queue.claim(job_id, worker_id, tx=w.t)
            if outcome.lease is not None:
                await w.record([_claimed(outcome.lease)])
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
        await self._move(
            fence, lambda w, _: self.queue.advance(fence, stage, tx=w.t), lambda: ((stage,), {})
        )

    async def succeed(self, fence: Fence, outputs: Sequence[Mapping[str, Any]]) -> None:
        """``uploading -> succeeded`` with the outputs (each ``{key, size,
        sha256, preset}``), stored with the status in one fenced write."""
        fence = _whole(fence)
        checked = validate_outputs(outputs)
        await self._move(
            fence,
            lambda w, _: self.queue.complete(fence, values={"outputs": checked}, tx=w.t),
            lambda: (("succeeded",), {"outputs": checked}),
        )

    async def release(
        self, fence: Fence, *, reason: str, available_at: datetime | None = None
    ) -> None:
        """Hand a leased job back to ``queued`` (a worker shutting down), not
        before ``available_at`` (default now); the attempt is refunded: the
        execution did not fail."""
        fence = _whole(fence)
        when = available_at or self.clock.now()
        await self._move(
            fence,
            lambda w, _: self.queue.requeue(fence, reason=reason, available_at=when, tx=w.t),
            lambda: (("queued",), {"reason": reason}),
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
          execution attempt (the backoff counts one credential refresh);
          once spent, ``failed`` then ``dead_letter``.

        Every status passed is in the history and has its event, carrying
        ``error``; the outcome's ``path`` lists them."""
        fence = _whole(fence)
        status = http_status if http_status is not None else error.http_status
        retry_class = self.retry.classify(status, retryable=error.retryable)
        text = error_text(error)
        outcomes: list[FailOutcome] = []

        async def write(w: WriteScope, before: JobSnapshot) -> None:
            nonlocal retry_class
            refreshes = before.credential_refresh_count
            if retry_class is RetryClass.CREDENTIAL_REFRESH:
                decision = self.retry.decide(
                    retry_class,
                    attempt=max(1, fence.attempt),
                    max_attempts=before.max_attempts,
                    now=w.now,
                    credential_refreshes=refreshes,
                    rng=self.rng,
                )
                if decision.retry:
                    # The new credentials did not come: try again later, handing
                    # the attempt back (refunded). The backoff is a refresh try
                    # of its own, so the loop ends within the refresh budget even
                    # for a worker that never records one. A stale fence counts
                    # nothing, and the requeue then says why.
                    await w.t.inbox.count_credential_refresh_if_current_claim(
                        fence, budget=self.retry.max_credential_refreshes
                    )
                    later = w.now + self.retry.normal.delay(refreshes + 1, self.rng)
                    await self.queue.requeue(fence, reason=text, available_at=later, tx=w.t)
                    outcomes.append(FailOutcome("queued", True, ("queued",)))
                    return
                retry_class = RetryClass.FATAL  # the refresh budget is spent
            outcomes.append(await self.queue.fail(fence, text, retry_class=retry_class, tx=w.t))

        await self._move(
            fence, write, lambda: (outcomes[0].path, {"reason": error.code, "error": error})
        )
        return outcomes[0]

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

    # --- internals -----------------------------------------------------------

    async def _move(
        self,
        fence: Fence,
        write: Callable[[WriteScope, JobSnapshot], Awaitable[Any]],
        passed: Callable[[], tuple[Sequence[str], dict[str, Any]]],
    ) -> None:
        """One fenced protocol write and its records, in one transaction.

        The job's row is locked and read first: the stage it leaves is the
        first step's source. ``write`` raises StaleClaim / InvalidTransition /
        NotFound, and then nothing is kept; ``passed`` gives, after it, the
        statuses the job passed and the other fields of its :class:`Transition`."""
        job_id = job_id_of(fence)
        async with self.writer.scope() as w:
            before = (await w.t.inbox.lock_jobs_for_transition([job_id])).get(job_id)
            if before is None:
                raise NotFound(f"inbox job {job_id} does not exist")
            await write(w, before)
            path, extra = passed()
            await w.record([Transition(job_id, chain(before.status, path), **extra)])


def _claimed(lease: Lease) -> Transition:
    return Transition(job_id_of(lease), [("queued", "claimed")])


def _whole(fence: Fence) -> Fence:
    """``fence``, refused unless it is whole: a worker's write names the
    claim_version too (§4: ``WHERE job_id=? AND claim_version=?``)."""
    if fence.claim_version is None:
        raise ConfigurationError(
            f"inbox job {fence.item_id}: a worker's write must present its claim_version"
        )
    return fence
