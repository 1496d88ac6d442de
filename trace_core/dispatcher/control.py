"""The task-facing operations of the Dispatcher (what workers call).

``/internal/task-claim``, ``task-fetch``, ``heartbeat``, ``task-complete``
and ``events`` map one-to-one onto these methods; the HTTP layer only
translates. Completion with final events is one transaction: the events are
accepted (fenced by the attempt) and the task completed (fenced by attempt
and lease token) together, or neither.

With a :class:`~trace_core.dispatcher.capabilities.CapabilityIssuer`, a
claimed payload also carries ``capability_token``, issued for the claimed
``(task_id, attempt)``. If the token cannot be issued, the fresh attempt is
failed at once (terminally when issuing can never succeed, for instance a
location no token can grant; with a retry otherwise) and the claim is
answered as not claimed: no worker runs an attempt it could not authorize.
A heartbeat that presents the attempt's current token gets a fresh one when
that token nears its expiry (:meth:`TaskControl.refresh_capability`), so an
attempt that holds its lease for hours keeps its data access.

Cost per call. A claim reads the task with its job, claims (a job without a
concurrency limit: one statement, no transaction), then reads the task's
state, the output pointers and a source's progress (one round trip on
Postgres); a heartbeat and a completion without final events are one fenced
statement each. What never changes is read once and remembered, bounded: a
task's job, a job's lease length and whether it is an always-on source (only
those heartbeats look up a directive). Reads that need no snapshot across
statements run without ``BEGIN``/``COMMIT`` on Postgres (READ COMMITTED
takes a snapshot per statement anyway).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from trace_core.authoring.events import AcceptResult, DatasetEvent
from trace_core.clock import Clock, SystemClock
from trace_core.dag.lineage_record import carries_lineage, record_output_lineage
from trace_core.dispatcher.bounded import BoundedMemo
from trace_core.dispatcher.concurrency import JobLimits
from trace_core.dispatcher.events import EventGateway, Producer
from trace_core.dispatcher.payload import build_payloads, task_payloads, task_rows
from trace_core.errors import ConfigurationError, NotFound
from trace_core.leasing import FailOutcome
from trace_core.model import ClaimOutcome, Fence, Holder, Lease, NotClaimedReason
from trace_core.retry import RetryClass
from trace_core.storage.protocol import Repository, Transaction
from trace_core.storage.scopes import per_statement_reads
from trace_core.tasks import TaskQueue

if TYPE_CHECKING:  # the security stack is imported only by whoever configures it
    from trace_core.dispatcher.capabilities import CapabilityIssuer
    from trace_core.security.claims import CapabilityClaims

__all__ = ["ClaimedTask", "Claimer", "JobFacts", "TaskControl"]

log = logging.getLogger(__name__)

_TASK_JOBS = 65_536  # tasks whose job is remembered
_JOBS = 4_096  # jobs whose facts are remembered


class Claimer(Protocol):
    """Claims one task by id for a worker (the Dispatcher's concurrency gate).

    ``job_id`` and ``limits`` are the task's job and its claim settings when
    the caller read them already; a claimer may use them to skip its own read.
    """

    async def __call__(
        self,
        task_id: uuid.UUID,
        worker_id: str,
        *,
        job_id: uuid.UUID | None = None,
        limits: JobLimits | None = None,
    ) -> ClaimOutcome:
        """The claim's outcome."""
        ...


@dataclass(frozen=True)
class JobFacts:
    """What the task endpoints need of a job (``jobs`` rows never change)."""

    limits: JobLimits
    always_on: bool
    """An always-on source: its running task's heartbeat carries a directive."""

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> JobFacts:
        """From a :func:`~trace_core.dispatcher.payload.task_rows` row."""
        source = row["source"]
        kind = source.get("kind") if isinstance(source, Mapping) else None
        return cls(
            JobLimits.from_row(row["job_id"], row["scaling"], row["heartbeat_timeout_seconds"]),
            always_on=row["activation"] == "source" and kind == "always_on",
        )


@dataclass(frozen=True)
class ClaimedTask:
    """A claim's answer: the outcome and, when claimed, the full task payload."""

    outcome: ClaimOutcome
    task: dict[str, Any] | None


class TaskControl:
    """Claim, fetch, heartbeat, emit, complete and fail tasks, fenced."""

    def __init__(
        self,
        repo: Repository,
        *,
        clock: Clock | None = None,
        tasks: TaskQueue | None = None,
        gateway: EventGateway | None = None,
        claim: Claimer | None = None,
        directive: Callable[[uuid.UUID], Awaitable[str]] | None = None,
        capabilities: CapabilityIssuer | None = None,
        on_release: Callable[[uuid.UUID], Awaitable[object]] | None = None,
    ) -> None:
        self.repo = repo
        self.clock = clock or SystemClock()
        self.tasks = tasks or TaskQueue(repo, clock=self.clock)
        self.gateway = gateway or EventGateway(repo, clock=self.clock)
        self._claim: Claimer = claim or self._plain_claim
        """The claim path; the Dispatcher passes its concurrency gate (limits and
        per-job leases) here."""
        self._task_jobs: BoundedMemo[uuid.UUID, uuid.UUID] = BoundedMemo(_TASK_JOBS)
        self._jobs: BoundedMemo[uuid.UUID, JobFacts] = BoundedMemo(_JOBS)
        self._directive = directive
        self._capabilities = capabilities
        """Issues each claimed attempt's capability token, when configured."""
        self._on_release = on_release
        """Called with the task id after an attempt completed or failed (the
        Dispatcher wakes tasks waiting for the job's concurrency slot)."""

    async def claim(self, task_id: uuid.UUID, worker_id: str) -> ClaimedTask:
        """Lease the task's next attempt and return its payload, or why not.

        With a capability issuer the payload carries ``capability_token``.
        """
        async with self._reads() as tx:
            rows = await task_rows(tx, [task_id])
        if not rows:
            return ClaimedTask(ClaimOutcome(None, NotClaimedReason.NOT_FOUND), None)
        row = rows[0]
        facts = self._remember(row)
        outcome = await self._claim(task_id, worker_id, job_id=row["job_id"], limits=facts.limits)
        lease = outcome.lease
        if lease is None:
            return ClaimedTask(outcome, None)
        async with self._reads() as tx:
            # Status and attempt as they are now, not as the claim left them: a
            # task canceled right after the claim is seen canceled, and its
            # operator is not started. Read with the pointers (and a source's
            # progress) in one round trip on Postgres.
            view = await tx.payload.claimed_view(
                task_id, row["dag_version_id"], progress=row["activation"] == "source"
            )
            if view.status is None:
                raise NotFound(f"task {task_id} does not exist")
            claimed = {**row, "attempt": view.attempt, "status": view.status}
            payload = (await build_payloads(tx, [claimed], view=view))[task_id]
        if self._capabilities is None:
            return ClaimedTask(outcome, payload)
        return await self._authorized(task_id, outcome, lease, payload, self._capabilities)

    async def _plain_claim(
        self,
        task_id: uuid.UUID,
        worker_id: str,
        *,
        job_id: uuid.UUID | None = None,
        limits: JobLimits | None = None,
    ) -> ClaimOutcome:
        """The claim without a concurrency gate (limits are not enforced)."""
        return await self.tasks.claim(task_id, worker_id)

    async def _authorized(
        self,
        task_id: uuid.UUID,
        outcome: ClaimOutcome,
        lease: Lease,
        payload: dict[str, Any],
        capabilities: CapabilityIssuer,
    ) -> ClaimedTask:
        """The claimed payload with its token, or the attempt failed and a refusal."""
        try:
            token = await capabilities.issue_for(payload)
        except Exception as exc:
            # InvalidInput is a ConfigurationError: the payload itself cannot be
            # granted, so another attempt would fail the same way.
            final = isinstance(exc, ConfigurationError)
            log.warning(
                "no capability token for task %s attempt %s (%s): %s",
                task_id,
                lease.attempt,
                "failing it" if final else "retrying it",
                exc,
            )
            fence = Fence(task_id, lease.attempt, lease.lease_token)
            failed = await self.fail(
                fence, f"capability token not issued: {exc}", retryable=not final
            )
            reason = (
                NotClaimedReason.NOT_READY if failed.retrying else NotClaimedReason.DEAD_LETTERED
            )
            return ClaimedTask(ClaimOutcome(None, reason), None)
        return ClaimedTask(outcome, {**payload, "capability_token": token})

    async def fetch(self, task_id: uuid.UUID) -> dict[str, Any]:
        """The full task payload (read-only); :class:`NotFound` if there is no such task."""
        async with self._reads() as tx:
            payloads = await task_payloads(tx, [task_id])
        if task_id not in payloads:
            raise NotFound(f"task {task_id} does not exist")
        return payloads[task_id]

    async def record_transport(
        self, task_id: uuid.UUID, attempt: int, *, stream: str, message_id: str
    ) -> bool:
        """Note on the attempt record which stream message delivered it (the v1
        contract's ``stream``), while the attempt runs; whether it wrote. A
        separate write after the claim: if it is lost, the attempt only lacks
        the note. One statement, atomic by itself: no ``BEGIN``/``COMMIT``
        round trips on Postgres."""
        async with self.repo.statement() as tx:
            return await tx.attempts.set_transport_if_running(
                task_id, attempt, stream=stream, message_id=message_id
            )

    async def heartbeat(self, fence: Fence, *, holder: Holder | None = None) -> datetime:
        """Extend the current attempt's lease by the job's heartbeat timeout;
        :class:`StaleClaim` if it is not current (or the write refused what
        ``holder`` says)."""
        facts = await self._facts(_task_id(fence))
        lease = None if facts is None else facts.limits.lease_seconds
        return await self.tasks.heartbeat(fence, lease_seconds=lease, holder=holder)

    async def directive(self, task_id: uuid.UUID) -> str:
        """What a running source should do now: ``run``, ``pause`` (backpressure)
        or ``stop`` (shutdown drain); always ``run`` without a source supervisor
        and for tasks that are not an always-on source's run."""
        if self._directive is None:
            return "run"
        facts = await self._facts(task_id)
        if facts is not None and not facts.always_on:
            return "run"
        return str(await self._directive(task_id))

    async def refresh_capability(
        self, task_id: uuid.UUID, attempt: int, token: str | None
    ) -> str | None:
        """A fresh capability token for ``(task_id, attempt)`` when ``token``
        (the attempt's current one) nears its expiry; else ``None``.

        Call it only after a fenced call of that attempt succeeded (the
        heartbeat): the fence is what makes the caller the lease holder.
        ``None`` also without a capability issuer, without a token, and for a
        token that does not verify (expired included): the attempt then keeps
        what it has.
        """
        if self._capabilities is None or not token:
            return None
        return await self._renewed(
            task_id, attempt, self._capabilities.refresh(token, task_id, attempt)
        )

    async def renew_capability(self, claims: CapabilityClaims) -> str | None:
        """:meth:`refresh_capability` for claims verified already (a task-scoped
        call's token); the same rule and the same precondition."""
        if self._capabilities is None:
            return None
        renewal = self._capabilities.renew_if_due(claims)
        return await self._renewed(claims.task_id, claims.attempt, renewal)

    async def _renewed(
        self, task_id: uuid.UUID, attempt: int, renewal: Awaitable[str | None]
    ) -> str | None:
        """The renewal's token; ``None`` if issuing failed (a signer outage):
        the heartbeat itself succeeded, and the next one asks again."""
        try:
            return await renewal
        except Exception as exc:
            log.warning("task %s attempt %d: capability not renewed: %s", task_id, attempt, exc)
            return None

    async def emit(
        self, task_id: uuid.UUID, attempt: int, events: Sequence[DatasetEvent]
    ) -> AcceptResult:
        """Accept mid-task events from the task's current attempt."""
        return await self.gateway.accept(events, producer=Producer(task_id, attempt))

    async def complete(
        self,
        fence: Fence,
        *,
        events: Sequence[DatasetEvent] = (),
        outputs: Sequence[Mapping[str, Any]] | None = None,
        result: Mapping[str, Any] | None = None,
        holder: Holder | None = None,
    ) -> AcceptResult:
        """Accept the final events and complete the attempt, atomically (without
        events the completion is one fenced statement).

        ``result`` (artifact pointers, timings, outputs ...) is kept on the
        attempt's record, by the completion's own write; ``holder``, when
        given, is checked by it (:class:`~trace_core.model.Holder`).
        """
        if not events and not carries_lineage(outputs):
            await self.tasks.complete(fence, outputs=outputs, result=result, holder=holder)
            accepted = AcceptResult([], 0, 0)
        else:
            async with self.repo.transaction() as tx:
                if events:
                    accepted = await self.gateway.accept(
                        events, producer=Producer(_task_id(fence), fence.attempt), tx=tx
                    )
                else:
                    accepted = AcceptResult([], 0, 0)
                # column lineage reported in outputs[i]["lineage"] commits with the output
                outputs = await record_output_lineage(tx, _task_id(fence), outputs)
                await self.tasks.complete(
                    fence, outputs=outputs, tx=tx, result=result, holder=holder
                )
        await self._released(fence)
        return accepted

    async def fail(
        self,
        fence: Fence,
        error: str,
        *,
        retryable: bool = True,
        detail: Mapping[str, Any] | None = None,
    ) -> FailOutcome:
        """Fail the current attempt: a retry with backoff, or terminal.

        ``detail`` (``{code, message, stack, retryable}``) replaces the error
        the attempt's record is closed with, in the transaction of the failure.
        """
        retry_class = RetryClass.RETRYABLE if retryable else RetryClass.FATAL
        if detail is None:
            outcome = await self.tasks.fail(fence, error, retry_class=retry_class)
        else:
            async with self.repo.transaction() as tx:
                outcome = await self.tasks.fail(fence, error, retry_class=retry_class, tx=tx)
                await tx.attempts.set_error_if_ended(
                    _task_id(fence), fence.attempt, statuses=("Failed",), error=detail
                )
        await self._released(fence)
        return outcome

    def _reads(self) -> AbstractAsyncContextManager[Transaction]:
        """Reads without a snapshot across statements
        (:func:`~trace_core.storage.scopes.per_statement_reads`)."""
        return per_statement_reads(self.repo)

    def _remember(self, row: Mapping[str, Any]) -> JobFacts:
        """Keep the task's job and the job's facts from a :func:`task_rows` row."""
        self._task_jobs.put(row["id"], row["job_id"])
        return self._jobs.get(row["job_id"]) or self._jobs.put(
            row["job_id"], JobFacts.from_row(row)
        )

    async def _facts(self, task_id: uuid.UUID) -> JobFacts | None:
        """The facts of the task's job (read once); ``None`` if there is no such task."""
        job_id = self._task_jobs.get(task_id)
        facts = None if job_id is None else self._jobs.get(job_id)
        if facts is not None:
            return facts
        async with self._reads() as tx:
            rows = await task_rows(tx, [task_id])
        return self._remember(rows[0]) if rows else None

    async def _released(self, fence: Fence) -> None:
        """A running slot of the task's job is free: wake who waits for it."""
        if self._on_release is not None:
            await self._on_release(_task_id(fence))


def _task_id(fence: Fence) -> uuid.UUID:
    item = fence.item_id
    return item if isinstance(item, uuid.UUID) else uuid.UUID(str(item))
