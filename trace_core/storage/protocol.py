"""The repository port: semantic operations, not SQL.

A :class:`Repository` hands out transactions; a :class:`Transaction` has the
operations. ``async with repo.transaction() as tx`` is the one path for "state
change plus outbox row in one transaction". Fenced operations return what
matched (rows, ids or ``None``); the core turns "nothing matched" into
:class:`~trace_core.errors.StaleClaim` or
:class:`~trace_core.errors.InvalidTransition` after inspecting the item.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, NamedTuple, Protocol

from trace_core.model import Fence, Holder, ItemState, Lease, QueueSpec
from trace_core.storage.ports import DeployOps, LaunchOps, RegistryOps, SourceOps, TaskOps
from trace_core.storage.ports.api_keys import ApiKeyOps
from trace_core.storage.ports.attempts import AttemptOps
from trace_core.storage.ports.catalog import CatalogOps
from trace_core.storage.ports.concurrency import ConcurrencyOps
from trace_core.storage.ports.events import EventOps
from trace_core.storage.ports.explain import ExplainOps
from trace_core.storage.ports.handover import HandoverOps
from trace_core.storage.ports.inbox import InboxOps
from trace_core.storage.ports.inbox_credentials import InboxCredentialOps
from trace_core.storage.ports.job_states import JobStateOps
from trace_core.storage.ports.journal import JournalOps
from trace_core.storage.ports.lineage import LineageOps
from trace_core.storage.ports.operator_state import OperatorStateOps
from trace_core.storage.ports.payload import PayloadOps
from trace_core.storage.ports.people import PeopleOps
from trace_core.storage.ports.reaper import ReaperOps
from trace_core.storage.ports.routing import RoutingOps
from trace_core.storage.ports.standalone import StandaloneOps
from trace_core.storage.ports.status import StatusOps
from trace_core.storage.ports.webhook_delivery import WebhookDeliveryOps
from trace_core.storage.ports.webhook_receipts import WebhookReceiptOps
from trace_core.wakeup import Subscription, WakeupHub

__all__ = [
    "IdempotencyRecord",
    "JoinedTransaction",
    "NewOutboxRow",
    "NewTask",
    "Repository",
    "TaskCreated",
    "TaskWakeup",
    "Transaction",
    "within",
]

ItemId = uuid.UUID | int


class NewTask(NamedTuple):
    """A task to create. ``dedupe_key`` makes creation idempotent per job.

    ``handicap_seconds`` is added to the creation time for the claim order:
    bulk-tier work yields to normal work created up to this much later, and
    ages in after it.

    A named tuple rather than a frozen dataclass: a batch enqueue makes
    thousands, and a frozen dataclass's ``__init__`` (one ``object.__setattr__``
    per field) cost more per task than the server's insert.
    """

    job_id: uuid.UUID
    dedupe_key: str | None = None
    partitions: Sequence[str] | None = None
    input_versions: Mapping[str, Any] | None = None
    max_attempts: int = 3
    handicap_seconds: float = 0.0


@dataclass(frozen=True)
class TaskWakeup:
    """How newly runnable tasks are announced, in the transaction that made them so.

    ``outbox_kind`` names the outbox rows carrying ``{"task_ids": [...]}`` (up
    to ``chunk`` ids each; ``None`` writes none, for deployments whose workers
    only poll); every channel in ``channels`` is notified at commit.
    """

    outbox_kind: str | None
    channels: tuple[str, ...]
    chunk: int = 500


class TaskCreated(NamedTuple):
    """The task id for a :class:`NewTask`; ``created`` is False for a duplicate
    (a named tuple, as :class:`NewTask`, for the same reason)."""

    task_id: uuid.UUID
    created: bool
    dedupe_key: str | None


@dataclass(frozen=True)
class NewOutboxRow:
    """A side effect to perform after commit."""

    kind: str
    payload: Mapping[str, Any]
    available_at: datetime | None = None
    max_attempts: int = 10


@dataclass(frozen=True)
class IdempotencyRecord:
    """The stored state of one idempotency key."""

    scope: str
    key: str
    request_hash: str
    status: Literal["in_flight", "completed"]
    response: Any
    created_at: datetime
    expires_at: datetime
    claimed: bool = field(default=False)
    """True when this call inserted (or took over an expired) key."""


class Transaction(Protocol):
    """One database transaction with the semantic operations.

    Besides the ownership protocol below, the operations of each area of the
    port (:mod:`trace_core.storage.ports`) are reached as an attribute, e.g.
    ``await tx.registry.find_org(slug)``; they run in this transaction.
    """

    engine_name: str

    # --- the areas of the port ----------------------------------------------

    @property
    def registry(self) -> RegistryOps:
        """Orgs, the dataset registry and dataset versions."""
        ...

    @property
    def deploy(self) -> DeployOps:
        """DAG versions, their pointer sets and their jobs."""
        ...

    @property
    def tasks(self) -> TaskOps:
        """Task lookups by job and runtime."""
        ...

    @property
    def attempts(self) -> AttemptOps:
        """Task attempts as records (opened by claims, closed by the protocol's writes)."""
        ...

    @property
    def lineage(self) -> LineageOps:
        """Column lineage per output dataset, read up- and downstream."""
        ...

    @property
    def job_states(self) -> JobStateOps:
        """The per-job state rows of the Dispatcher's services (pauses, scale state, ...)."""
        ...

    @property
    def concurrency(self) -> ConcurrencyOps:
        """Task counts per job and operator, and the concurrency gate's claim reads."""
        ...

    @property
    def sources(self) -> SourceOps:
        """Source runs and cron schedules."""
        ...

    @property
    def launch(self) -> LaunchOps:
        """Which tasks a wake-up may start, with their job's runtime."""
        ...

    @property
    def operator_state(self) -> OperatorStateOps:
        """Versioned per-job operator state."""
        ...

    @property
    def payload(self) -> PayloadOps:
        """What task payloads are built from (tasks, their jobs, pointers)."""
        ...

    @property
    def standalone(self) -> StandaloneOps:
        """Jobs outside any deployed DAG, for the task queue on its own."""
        ...

    @property
    def reaper(self) -> ReaperOps:
        """What the reaper reads about running attempts and their leases."""
        ...

    @property
    def handover(self) -> HandoverOps:
        """Revoking at once the leases of a holder known to be gone."""
        ...

    @property
    def explain(self) -> ExplainOps:
        """Why a job did or did not run, and the task totals of metrics."""
        ...

    @property
    def status(self) -> StatusOps:
        """What a DAG has done so far: its datasets, tasks and outbox backlog."""

    ...

    @property
    def events(self) -> EventOps:
        """Accepting events: event rows, redelivery counts, version progress."""
        ...

    @property
    def routing(self) -> RoutingOps:
        """Routing stored events: pending events, task inputs, route outcomes."""
        ...

    @property
    def journal(self) -> JournalOps:
        """The job journal: why a job did or did not run."""
        ...

    @property
    def api_keys(self) -> ApiKeyOps:
        """Euterpe's requester API keys (digests only)."""
        ...

    @property
    def people(self) -> PeopleOps:
        """Users, org roles, memberships and datasets' read roles (org-scoped)."""
        ...

    @property
    def catalog(self) -> CatalogOps:
        """An org's DAGs, datasets, jobs and tasks, for people's reads (org-scoped)."""
        ...

    @property
    def inbox_credentials(self) -> InboxCredentialOps:
        """Inbox jobs' sealed storage credentials (guarded refresh and re-wrap)."""
        ...

    @property
    def inbox(self) -> InboxOps:
        """Euterpe's inbox jobs: insertion, history, webhook events, refresh counter, pruning."""
        ...

    @property
    def webhook_receipts(self) -> WebhookReceiptOps:
        """A webhook receiver's memory: nonces in their replay window, event ids seen."""
        ...

    @property
    def webhook_delivery(self) -> WebhookDeliveryOps:
        """The webhook deliverer's claim in stage order, and each event's target."""
        ...

    # --- the ownership protocol, one implementation for every queue ---------

    async def claim(
        self,
        queue: QueueSpec,
        *,
        worker_id: str,
        lease_seconds: float,
        now: datetime,
        limit: int = 1,
        item_id: ItemId | None = None,
    ) -> list[Lease]:
        """Atomically lease up to ``limit`` ready items (or the one ``item_id``).

        Sets the claimed status, worker, a fresh lease token, the expiry and the
        heartbeat; increments ``claim_version``, and the attempt when a new
        attempt starts. Concurrent claimers never receive the same item.
        """
        ...

    async def create_claimed_tasks(
        self, tasks: Sequence[NewTask], *, now: datetime, worker_id: str, lease_seconds: float
    ) -> list[Lease]:
        """Insert one task already claimed by ``worker_id`` (the hand-off of
        :meth:`~trace_core.tasks.TaskQueue.claim_wait`): the row, its attempt
        and lease exactly as :meth:`claim` would leave them, no wake-up.

        Inserts nothing, and returns no lease, when a ``Queued`` task would be
        claimed before it (``queued_at`` no later) or its dedupe key has a task.
        In a :meth:`Repository.statement` scope it is the last statement: it
        commits by itself.
        """
        ...

    async def inspect(self, queue: QueueSpec, item_id: ItemId) -> ItemState | None:
        """The ownership columns of one item, or ``None`` if it does not exist."""
        ...

    async def heartbeat(
        self,
        queue: QueueSpec,
        fence: Fence,
        *,
        now: datetime,
        expires_at: datetime,
        holder: Holder | None = None,
    ) -> datetime | None:
        """Extend a live lease matching ``fence`` (and ``holder``, tasks only:
        :class:`~trace_core.model.Holder`); the new expiry, or ``None`` if stale."""
        ...

    async def transition(
        self,
        queue: QueueSpec,
        fence: Fence,
        *,
        sources: Collection[str],
        target: str,
        now: datetime,
        values: Mapping[str, Any] | None = None,
        attempt_result: Mapping[str, Any] | None = None,
        holder: Holder | None = None,
    ) -> bool:
        """Fenced move from one of ``sources`` to ``target``; False if nothing matched.

        ``values`` names columns to set, or the roles ``error`` (the queue's
        error column), ``ready_at`` (its availability gate, ignored where there
        is none) and ``refund_attempt`` (True: the claim being undone spends no
        attempt). ``attempt_result`` (tasks): the result the attempt's record is
        closed with, written by the same statement as the task row (Postgres)
        or in the same step (SQLite); ``None`` keeps the record's. ``holder``
        (tasks): the write also requires what it says
        (:class:`~trace_core.model.Holder`).
        """
        ...

    async def complete_many(
        self,
        queue: QueueSpec,
        fences: Sequence[Fence],
        *,
        sources: Collection[str],
        now: datetime,
    ) -> set[ItemId]:
        """Fenced batch move to the done status in one statement; the ids that matched."""
        ...

    async def fail(
        self,
        queue: QueueSpec,
        fence: Fence,
        *,
        now: datetime,
        retryable: bool,
        retry_at: datetime | None,
        error: str,
        expired_before: datetime | None = None,
        timed_out: bool = False,
    ) -> tuple[tuple[str, ...], bool] | None:
        """Fenced failure of a leased item: retry (while budget remains) or dead-letter.

        Returns the statuses the item moved through, in order (the last is
        its new status; an inbox job dead-letters through ``failed``, the only
        way its lifecycle allows), and whether a retry is scheduled, or
        ``None`` if stale. With ``expired_before`` it
        only matches a lease that expired before then (the reclaim path).
        With ``expired_before`` or ``timed_out`` (an attempt that ran too
        long) the failure is a timeout: queues whose expiry bumps
        ``claim_version`` fence the holder out; tasks keep the timeout mark
        that lets the attempt's late reply in (interface-contracts.md).
        """
        ...

    async def expired(self, queue: QueueSpec, *, now: datetime, limit: int) -> list[Fence]:
        """Fences of leased items whose lease expired before ``now``."""
        ...

    async def requeue_due(self, queue: QueueSpec, *, now: datetime, limit: int) -> list[ItemId]:
        """Move failures whose retry time has come back to ready; the ids moved."""
        ...

    async def force_transition(
        self,
        queue: QueueSpec,
        item_ids: Sequence[ItemId],
        *,
        sources: Collection[str],
        target: str,
        now: datetime,
        error: str | None = None,
    ) -> set[ItemId]:
        """Unfenced administrative move (cancellation); bumps ``claim_version``."""
        ...

    # --- tasks, outbox ------------------------------------------------------

    async def create_tasks(
        self, tasks: Sequence[NewTask], *, now: datetime, wakeup: TaskWakeup | None = None
    ) -> list[TaskCreated]:
        """Insert tasks; a duplicate ``(job_id, dedupe_key)`` returns the existing id.

        With ``wakeup``, the tasks actually inserted are announced too (see
        :meth:`wake_tasks`); the engine may do all of it in one statement.
        """
        ...

    async def wake_tasks(
        self, task_ids: Sequence[uuid.UUID], wakeup: TaskWakeup, *, now: datetime
    ) -> None:
        """Write the wake-up outbox rows of ``task_ids`` and notify the channels."""
        ...

    async def insert_outbox(self, rows: Sequence[NewOutboxRow], *, now: datetime) -> list[int]:
        """Insert outbox rows in this transaction; their ids."""
        ...

    def notify(self, channel: str) -> None:
        """Wake listeners of ``channel`` once this transaction commits."""
        ...

    # --- idempotency keys ---------------------------------------------------

    async def idempotency_claim(
        self,
        scope: str,
        key: str,
        request_hash: str,
        *,
        now: datetime,
        expires_at: datetime,
    ) -> IdempotencyRecord:
        """Claim a key with one atomic insert, or return its stored record."""
        ...

    async def idempotency_complete(
        self, scope: str, key: str, request_hash: str, response: Any, *, now: datetime
    ) -> bool:
        """Store the response of an in-flight key; False if it was not ours."""
        ...

    async def idempotency_release(self, scope: str, key: str, request_hash: str) -> bool:
        """Drop an in-flight key whose request failed before any effect."""
        ...

    async def idempotency_sweep(self, *, now: datetime, limit: int) -> int:
        """Delete up to ``limit`` expired keys; how many were deleted."""
        ...


class Repository(Protocol):
    """A database: the factory of transactions, plus wake-ups."""

    engine_name: str
    hub: WakeupHub
    """This process's wake-ups, and the book of consumers waiting for a hand-off."""
    identity: str
    """Which database this is (no password), so that a hand-off through a shared
    :attr:`hub` reaches only consumers of the same database."""

    def transaction(self) -> AbstractAsyncContextManager[Transaction]:
        """A write transaction (on SQLite, ``BEGIN IMMEDIATE``)."""
        ...

    def statement(self) -> AbstractAsyncContextManager[Transaction]:
        """For one protocol statement that is atomic by itself; the engine may
        skip the explicit transaction around it (Postgres autocommit)."""
        ...

    def read(self) -> AbstractAsyncContextManager[Transaction]:
        """A read-only transaction."""
        ...

    def autocommit(self) -> AbstractAsyncContextManager[Transaction]:
        """Several statements that each commit by themselves (Postgres), for
        reads that need no snapshot across statements; SQLite: a write transaction."""
        ...

    async def listen(self, channel: str, max_wait: float = 10.0) -> bool:
        """Subscribe to commits on ``channel`` made by other processes, where the
        engine can (Postgres LISTEN); True once in effect."""
        ...

    async def subscribe(self, channel: str) -> Subscription:
        """Wake-ups of ``channel`` for a consumer loop, losing none that fire
        while the consumer is busy; includes other processes where possible."""
        ...

    async def ping(self) -> None:
        """One round trip to the database, for readiness checks;
        :class:`~trace_core.errors.DatabaseUnavailable` when it cannot be reached."""
        ...

    async def close(self) -> None:
        """Release connections and listeners."""
        ...


class JoinedTransaction(AbstractAsyncContextManager[Transaction]):
    """A caller's open transaction used as if opened here: nothing is
    committed or rolled back on exit (the caller owns it)."""

    def __init__(self, tx: Transaction) -> None:
        self._tx = tx

    async def __aenter__(self) -> Transaction:
        return self._tx

    async def __aexit__(self, *exc: object) -> None:
        return None


def within(repo: Repository, tx: Transaction | None) -> AbstractAsyncContextManager[Transaction]:
    """Join ``tx`` when given, else open a new write transaction on ``repo``."""
    return JoinedTransaction(tx) if tx is not None else repo.transaction()
