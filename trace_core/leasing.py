"""The ownership protocol, written once for every durable queue.

Atomic claim (one by id, or the next N), lease TTL, heartbeat, fenced writes,
reclaim on expiry, retries with backoff and dead-lettering, cancellation. The
repository executes; this module holds the policy and turns "no row matched"
into a precise answer by inspecting the item afterwards.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from trace_core.clock import Clock, SystemClock
from trace_core.errors import ConfigurationError, InvalidTransition, NotFound, StaleClaim
from trace_core.model import (
    ClaimOutcome,
    Fence,
    Holder,
    ItemState,
    Lease,
    NotClaimedReason,
    QueueSpec,
)
from trace_core.retry import RetryClass, RetryPolicy
from trace_core.storage.protocol import Repository, Transaction, within

__all__ = ["FailOutcome", "LeaseConfig", "LeaseQueue", "ReclaimHooks", "ReclaimReport"]

ItemId = Any

_REVOKED_WITHIN = timedelta(microseconds=1)
"""The fenced failure after a revocation applies to leases that expired no later
than the revocation (``lease_expires_at < now + this``)."""


@dataclass(frozen=True)
class LeaseConfig:
    """Lease settings of one queue."""

    lease_seconds: float = 30.0
    """How long a claim lasts without a heartbeat."""
    max_batch: int = 1000
    """Upper bound on one claim, reclaim or requeue round."""

    def __post_init__(self) -> None:
        if self.lease_seconds <= 0:
            raise ConfigurationError("LeaseConfig.lease_seconds must be > 0")
        if self.max_batch < 1:
            raise ConfigurationError("LeaseConfig.max_batch must be >= 1")


@dataclass(frozen=True)
class FailOutcome:
    """Where a failed item went."""

    status: str
    retrying: bool
    """True if a retry is scheduled; False if the item is dead-lettered."""
    path: tuple[str, ...] = ()
    """Every status the failure moved the item through, in order (the last is
    ``status``): ``("failed", "dead_letter")`` for an exhausted inbox job, whose
    lifecycle has no edge from a leased stage to the dead letter."""


@dataclass(frozen=True)
class ReclaimReport:
    """What one reclaim round did."""

    retried: list[ItemId] = field(default_factory=list)
    dead_lettered: list[ItemId] = field(default_factory=list)


@dataclass(frozen=True)
class ReclaimHooks:
    """How a caller of :meth:`LeaseQueue.reclaim_expired` words and records the
    failures of expired leases, inside the reclaim's transaction."""

    reasons: Callable[[Transaction, Sequence[Fence]], Awaitable[Mapping[ItemId, str]]]
    """The error text of each expired lease (an id it leaves out gets the default)."""
    failed: Callable[[Transaction, Fence, FailOutcome, str], Awaitable[None]]
    """Called for each lease failed, with the outcome and the error text written."""


class LeaseQueue:
    """The protocol for one queue (:data:`~trace_core.model.TASKS`, ``OUTBOX`` …).

    Every method takes an optional ``tx``: pass one to join a larger
    transaction (state change + outbox row), or leave it out to run alone.
    """

    def __init__(
        self,
        repo: Repository,
        queue: QueueSpec,
        *,
        clock: Clock | None = None,
        config: LeaseConfig | None = None,
        retry: RetryPolicy | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.repo = repo
        self.queue = queue
        self.clock = clock or SystemClock()
        self.config = config or LeaseConfig()
        self.retry = retry or RetryPolicy()
        self._rng = rng or random.Random()

    # --- claims -------------------------------------------------------------

    async def claim_batch(
        self,
        worker_id: str,
        limit: int,
        *,
        tx: Transaction | None = None,
        lease_seconds: float | None = None,
    ) -> list[Lease]:
        """Lease up to ``limit`` ready items in one round trip (poll driven).

        ``lease_seconds`` overrides the configured lease (a job's heartbeat timeout).
        """
        if not 1 <= limit <= self.config.max_batch:
            raise ConfigurationError(
                f"claim limit must be within 1..{self.config.max_batch}, got {limit}"
            )
        async with self._tx(tx, single=True) as t:
            return await t.claim(
                self.queue,
                worker_id=worker_id,
                lease_seconds=lease_seconds or self.config.lease_seconds,
                now=self.clock.now(),
                limit=limit,
            )

    async def claim(
        self,
        item_id: ItemId,
        worker_id: str,
        *,
        tx: Transaction | None = None,
        lease_seconds: float | None = None,
    ) -> ClaimOutcome:
        """Lease one item by id (wake-up driven), or say why not.

        ``lease_seconds`` overrides the configured lease (a job's heartbeat timeout).
        The claim is one atomic statement (autocommit on Postgres); a refusal
        is explained by reading the item afterwards.
        """
        async with self._tx(tx, single=True) as t:
            leases = await t.claim(
                self.queue,
                worker_id=worker_id,
                lease_seconds=lease_seconds or self.config.lease_seconds,
                now=self.clock.now(),
                item_id=item_id,
            )
            if leases:
                return ClaimOutcome(leases[0])
            state = await t.inspect(self.queue, item_id)
        return ClaimOutcome(None, self.refusal_reason(state))

    def refusal_reason(self, state: ItemState | None) -> NotClaimedReason:
        """Why an item in ``state`` cannot be claimed (``None``: there is no such item).

        The reason :meth:`claim` gives when nothing was leased; callers that
        refuse a claim themselves (a concurrency limit) use it for items that
        are not claimable at all, so every refusal reads the same.
        """
        q = self.queue
        if state is None:
            return NotClaimedReason.NOT_FOUND
        if state.status in q.leased:
            return NotClaimedReason.ALREADY_RUNNING
        if state.status == q.done:
            return NotClaimedReason.COMPLETED
        if state.status == "Canceled":
            return NotClaimedReason.CANCELED
        if q.is_dead_letter(state.status, state.retry_at):
            return NotClaimedReason.DEAD_LETTERED
        return NotClaimedReason.NOT_READY

    # --- fenced writes ------------------------------------------------------

    async def heartbeat(
        self,
        fence: Fence,
        *,
        tx: Transaction | None = None,
        lease_seconds: float | None = None,
        holder: Holder | None = None,
    ) -> datetime:
        """Extend the lease; raises :class:`StaleClaim` if it is not current
        (or, with ``holder``, tasks only, if the write refused what it says:
        the error then names the fence's state only)."""
        now = self.clock.now()
        async with self._tx(tx, single=True) as t:
            expires = await t.heartbeat(
                self.queue,
                fence,
                now=now,
                expires_at=now + timedelta(seconds=lease_seconds or self.config.lease_seconds),
                holder=holder,
            )
            if expires is None:
                await self._explain(t, fence, None)
        assert expires is not None
        return expires

    async def advance(
        self,
        fence: Fence,
        target: str,
        *,
        values: Mapping[str, Any] | None = None,
        tx: Transaction | None = None,
    ) -> None:
        """Fenced stage change (e.g. ``claimed -> fetching``) within the lease."""
        q = self.queue
        if target not in q.leased:
            raise ConfigurationError(
                f"{q.name}: advance() moves between leased stages; {target!r} is not one "
                "(use complete(), fail() or requeue())"
            )
        sources = q.lifecycle.sources_of(target) & q.leased
        await self._transition(fence, sources, target, values, tx)

    async def complete(
        self,
        fence: Fence,
        *,
        values: Mapping[str, Any] | None = None,
        tx: Transaction | None = None,
        attempt_result: Mapping[str, Any] | None = None,
        holder: Holder | None = None,
    ) -> None:
        """Fenced success. Raises :class:`StaleClaim` or :class:`InvalidTransition`.

        ``attempt_result`` (tasks): kept on the attempt's record by the same
        write; ``holder`` (tasks): checked by it (as :meth:`heartbeat`)."""
        q = self.queue
        await self._transition(
            fence, q.lifecycle.sources_of(q.done), q.done, values, tx, attempt_result, holder
        )

    async def complete_many(
        self, fences: Sequence[Fence], *, tx: Transaction | None = None
    ) -> set[ItemId]:
        """Fenced success for many items in one statement.

        Returns the ids that were still current; the others were stale and were
        left untouched (the caller decides whether that is an error).
        """
        q = self.queue
        async with self._tx(tx, single=True) as t:
            return await t.complete_many(
                q, fences, sources=q.lifecycle.sources_of(q.done), now=self.clock.now()
            )

    async def requeue(
        self,
        fence: Fence,
        *,
        reason: str,
        tx: Transaction | None = None,
        available_at: datetime | None = None,
    ) -> None:
        """Fenced hand-back of a leased item to ready (graceful release).

        ``available_at`` postpones the next claim, on queues with an
        availability gate (the outboxes, the inbox); it spends no attempt.
        """
        q = self.queue
        sources = q.lifecycle.sources_of(q.ready) & q.leased
        if not sources:
            raise InvalidTransition(q.lifecycle.name, q.claimed, q.ready, fence.item_id)
        values: dict[str, Any] = {"error": reason}
        if available_at is not None:
            values["ready_at"] = available_at
            values["refund_attempt"] = True
        await self._transition(fence, sources, q.ready, values, tx)

    async def fail(
        self,
        fence: Fence,
        error: str,
        *,
        retry_class: RetryClass = RetryClass.RETRYABLE,
        tx: Transaction | None = None,
        timed_out: bool = False,
    ) -> FailOutcome:
        """Fenced failure: retry with backoff while the row's attempts remain,
        else dead-letter. ``RetryClass.FATAL`` dead-letters at once.

        ``timed_out``: the system fails an attempt that ran too long (not the
        holder reporting its own failure), which keeps a task's late reply
        acceptable (see :meth:`Transaction.fail`)."""
        outcome = await self._fail(
            fence, error, retry_class, tx=tx, expired_before=None, timed_out=timed_out
        )
        assert outcome is not None
        return outcome

    async def _fail(
        self,
        fence: Fence,
        error: str,
        retry_class: RetryClass,
        *,
        tx: Transaction | None,
        expired_before: datetime | None,
        timed_out: bool = False,
    ) -> FailOutcome | None:
        now = self.clock.now()
        # The row's own max_attempts decides in SQL whether a retry remains;
        # here we only need the backoff for the case that it does.
        # A forged or malformed attempt (< 1) must still reach the fenced
        # update, which refuses it as stale; it must not break the backoff.
        attempt = max(1, fence.attempt)
        decision = self.retry.decide(
            retry_class,
            attempt=attempt,
            max_attempts=attempt + 1,
            now=now,
            rng=self._rng,
        )
        async with self._tx(tx) as t:
            result = await t.fail(
                self.queue,
                fence,
                now=now,
                retryable=decision.retry,
                retry_at=decision.retry_at,
                error=error,
                expired_before=expired_before,
                timed_out=timed_out,
            )
            if result is None:
                if expired_before is not None:
                    return None  # heartbeated or finished meanwhile: not ours to fail
                await self._explain(t, fence, self.queue.retry_to)
        assert result is not None
        path, retrying = result
        return FailOutcome(path[-1], retrying, path)

    # --- maintenance --------------------------------------------------------

    async def reclaim_expired(
        self, *, limit: int | None = None, hooks: ReclaimHooks | None = None
    ) -> ReclaimReport:
        """Fail every expired lease: retry with backoff, or dead-letter when exhausted.

        Each failure is the fenced "fail only if still expired" write: a holder
        that heartbeats between the scan and the write keeps its lease. Queues
        whose expiry bumps ``claim_version`` fence the old holder out here;
        tasks keep the old fence until the next claim (late replies).
        ``hooks`` word each failure and record it in the same transaction.
        """
        now = self.clock.now()
        async with self.repo.transaction() as t:
            fences = await t.expired(self.queue, now=now, limit=limit or self.config.max_batch)
            return await self._fail_taken_back(
                t,
                fences,
                lambda fence: f"lease expired (attempt {fence.attempt})",
                expired_before=now,
                hooks=hooks,
            )

    async def reclaim_held_by(
        self,
        worker_prefix: str,
        *,
        reason: str,
        limit: int | None = None,
        hooks: ReclaimHooks | None = None,
    ) -> ReclaimReport:
        """Take back at once every lease whose holder's worker id starts with
        ``worker_prefix``: retry with backoff, or dead-letter when exhausted.

        Only for a holder *known* to be gone (the lite platform proves it with
        its data directory lock): unlike :meth:`reclaim_expired` nothing waits
        for the lease to run out. The leases are revoked first, which bumps
        their ``claim_version`` (a ghost of the holder is fenced out of every
        write), then failed by the same fenced write as an expired lease, in
        one transaction. ``reason`` is the error text of each failure (``hooks``
        may word it per item and record each failure).
        """
        now = self.clock.now()
        async with self.repo.transaction() as t:
            fences = await t.handover.revoke_leases(
                self.queue,
                worker_prefix=worker_prefix,
                now=now,
                limit=limit or self.config.max_batch,
            )
            # The revoked leases expired at ``now``; a lease taken since (none can
            # be: the rows stayed leased) would expire later and is left alone.
            return await self._fail_taken_back(
                t, fences, lambda _: reason, expired_before=now + _REVOKED_WITHIN, hooks=hooks
            )

    async def _fail_taken_back(
        self,
        t: Transaction,
        fences: Sequence[Fence],
        reason_of: Callable[[Fence], str],
        *,
        expired_before: datetime,
        hooks: ReclaimHooks | None,
    ) -> ReclaimReport:
        """Fail each lease taken back (expired or revoked) in ``t``: retry with
        backoff or dead-letter. The write is fenced to a lease still expired
        before ``expired_before`` (a holder that heartbeated meanwhile keeps
        it); ``hooks`` may word each failure (else ``reason_of``) and record it."""
        report = ReclaimReport()
        if not fences:
            return report
        reasons = await hooks.reasons(t, fences) if hooks is not None else {}
        for fence in fences:
            found = reasons.get(fence.item_id)
            reason = reason_of(fence) if found is None else found
            outcome = await self._fail(
                fence, reason, RetryClass.RETRYABLE, tx=t, expired_before=expired_before
            )
            if outcome is None:
                continue
            (report.retried if outcome.retrying else report.dead_lettered).append(fence.item_id)
            if hooks is not None:
                await hooks.failed(t, fence, outcome, reason)
        return report

    async def requeue_due(
        self, *, limit: int | None = None, tx: Transaction | None = None
    ) -> list[ItemId]:
        """Move failures whose retry time has come back to ready; the ids moved."""
        if not self.queue.requeues_later:
            return []
        async with self._tx(tx) as t:
            return await t.requeue_due(
                self.queue, now=self.clock.now(), limit=limit or self.config.max_batch
            )

    async def cancel(
        self,
        item_ids: Sequence[ItemId],
        *,
        reason: str = "canceled",
        tx: Transaction | None = None,
    ) -> set[ItemId]:
        """Cancel items that are not finished; the ids that were canceled."""
        q = self.queue
        if "Canceled" not in q.lifecycle.statuses:
            raise ConfigurationError(f"{q.name} has no Canceled status")
        async with self._tx(tx) as t:
            return await t.force_transition(
                q,
                item_ids,
                sources=q.lifecycle.sources_of("Canceled"),
                target="Canceled",
                now=self.clock.now(),
                error=reason,
            )

    async def dead_letter(
        self, item_ids: Sequence[ItemId], *, reason: str, tx: Transaction | None = None
    ) -> set[ItemId]:
        """Dead-letter items at once (unrecoverable policy), from wherever allowed."""
        q = self.queue
        async with self._tx(tx) as t:
            return await t.force_transition(
                q,
                item_ids,
                sources=q.lifecycle.sources_of(q.dead),
                target=q.dead,
                now=self.clock.now(),
                error=reason,
            )

    async def inspect(self, item_id: ItemId) -> ItemState:
        """The ownership state of one item; :class:`NotFound` if none."""
        async with self.repo.read() as t:
            state = await t.inspect(self.queue, item_id)
        if state is None:
            raise NotFound(f"{self.queue.name} item {item_id} does not exist")
        return state

    # --- internals ----------------------------------------------------------

    def _tx(
        self, tx: Transaction | None, *, single: bool = False
    ) -> AbstractAsyncContextManager[Transaction]:
        """The caller's transaction, or a new one (``single``: one statement)."""
        if tx is None and single:
            return self.repo.statement()
        return within(self.repo, tx)

    async def _transition(
        self,
        fence: Fence,
        sources: Collection[str],
        target: str,
        values: Mapping[str, Any] | None,
        tx: Transaction | None,
        attempt_result: Mapping[str, Any] | None = None,
        holder: Holder | None = None,
    ) -> None:
        # One fenced UPDATE, atomic by itself; the read that explains a miss
        # needs no transaction around it.
        async with self._tx(tx, single=True) as t:
            ok = await t.transition(
                self.queue,
                fence,
                sources=sources,
                target=target,
                now=self.clock.now(),
                values=values,
                attempt_result=attempt_result,
                holder=holder,
            )
            if not ok:
                await self._explain(t, fence, target)

    async def _explain(self, t: Transaction, fence: Fence, target: str | None) -> None:
        """Raise the precise reason a fenced write matched nothing."""
        q = self.queue
        state = await t.inspect(q, fence.item_id)
        if state is None:
            raise NotFound(f"{q.name} item {fence.item_id} does not exist")
        current = (
            state.lease_token == fence.lease_token
            and state.attempt == fence.attempt
            and (fence.claim_version is None or fence.claim_version == state.claim_version)
        )
        if not current:
            raise StaleClaim(
                q.name,
                fence.item_id,
                f"presented attempt {fence.attempt}"
                + (f"/claim_version {fence.claim_version}" if fence.claim_version else "")
                + f", current attempt {state.attempt}/claim_version {state.claim_version}"
                + f" in status {state.status}",
            )
        if target is not None and not q.lifecycle.allows(state.status, target):
            raise InvalidTransition(q.lifecycle.name, state.status, target, fence.item_id)
        raise StaleClaim(q.name, fence.item_id, f"lease no longer live (status {state.status})")
