"""The events area of the repository port: accepting upstream events.

Reached as ``tx.events`` on any :class:`~trace_core.storage.protocol.Transaction`.
An event row is stored once per ``(dataset_version, unit_key)``; a
redelivery only counts (``deliveries``, ``last_received_at``). Accepting also
advances the versions' progress rows (``dataset_version_progress``). What to
accept (producer fencing, validation, the outbox rows) is decided by
:mod:`trace_core.dispatcher.events`; this area reads and writes.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

from trace_core.ranges import Range

__all__ = [
    "EventKey",
    "EventOps",
    "NewEvent",
    "ProducerAttempt",
    "ProgressFold",
    "RouteRows",
    "StoredEvents",
]

EventKey = tuple[uuid.UUID, str]
"""``(dataset_version, unit_key)``: what makes an event unique."""


@dataclass(frozen=True)
class ProducerAttempt:
    """The task an event producer claims to be, as stored."""

    status: str
    attempt: int
    replying: bool
    """Whether the task's status accepts a reply of its current attempt
    (the status test of a fenced completion, late replies included)."""
    output_datasets: tuple[uuid.UUID, ...]
    """The datasets the task's job produces."""


@dataclass(frozen=True)
class NewEvent:
    """One unit of work to store (the first copy of its key in a request)."""

    dataset_uuid: uuid.UUID
    dataset_version: uuid.UUID
    unit_key: str
    cursor: str | None
    partition_key: str | None
    start: int | None
    end: int | None
    copies: int
    """How many copies of this unit the request carried (its deliveries)."""
    position: int = 0
    """Where the unit's first copy stands in the request (orders the ids of
    :meth:`EventOps.accept_in_one_statement`'s outbox rows)."""
    int_cursor: int | None = None
    """The cursor when the producer sent an integer (it advances ``max_cursor``)."""


@dataclass(frozen=True)
class StoredEvents:
    """What :meth:`EventOps.store_events` did."""

    ids: dict[EventKey, uuid.UUID]
    """The event id of every key given, new or stored before."""
    fresh: set[uuid.UUID]
    """The ids of the events inserted now."""
    later: dict[uuid.UUID, int] = field(default_factory=dict)
    """Redelivered events whose count was left for later (Postgres: a routing
    holds them) -> copies not counted yet (see
    :meth:`EventOps.apply_deferred_deliveries`)."""


@dataclass(frozen=True)
class ProgressFold:
    """What one acceptance adds to one dataset version's progress row."""

    version: uuid.UUID
    dataset_uuid: uuid.UUID
    spans: Sequence[Range]
    """Merged inclusive block ranges."""
    max_cursor: int | None
    """The highest integer cursor, if any."""
    events: int
    """New events counted."""


@dataclass(frozen=True)
class RouteRows:
    """The outbox rows :meth:`EventOps.accept_in_one_statement` writes: the
    ids of the new events, ``chunk`` per row, as ``{ids_key: [...]}``, then
    (when some redelivery counts were left for later) one row
    ``{deferred_key: [[id, copies], ...] (by id), "at": at}``; all of kind
    ``kind`` with ``max_attempts``, ``channel`` notified at commit."""

    kind: str
    ids_key: str
    chunk: int
    deferred_key: str
    at: str
    channel: str
    max_attempts: int


class EventOps(Protocol):
    """Event rows and progress rows, inside one transaction."""

    async def lock_producer_attempt(self, task_id: uuid.UUID) -> ProducerAttempt | None:
        """The task's current attempt, its status and its job's outputs;
        ``None`` for an unknown task.

        On Postgres the task row is share-locked until the transaction ends,
        so a claim of a newer attempt waits for this acceptance to commit
        (and an acceptance waits for such a claim): "current attempt" is
        judged consistently. SQLite's write transactions are serialized already.
        """
        ...

    async def datasets_of_versions(
        self, version_ids: Collection[uuid.UUID]
    ) -> dict[uuid.UUID, uuid.UUID]:
        """dataset version -> its dataset, for those of ``version_ids`` that exist."""
        ...

    async def lock_producer_and_versions(
        self, task_id: uuid.UUID, version_ids: Collection[uuid.UUID]
    ) -> tuple[ProducerAttempt | None, dict[uuid.UUID, uuid.UUID]]:
        """:meth:`lock_producer_attempt` and :meth:`datasets_of_versions`
        together, as one round trip where the engine has them (Postgres).
        The versions may be left unread (``{}``) for an unknown task."""
        ...

    async def store_events(
        self, events: Sequence[NewEvent], *, producer: tuple[uuid.UUID, int] | None, now: datetime
    ) -> StoredEvents:
        """Insert the events whose key is new; count the others as redelivered.

        A new event is stored ``pending`` with ``deliveries = copies``,
        received at ``now``, its origin ``task`` (``producer`` is ``(task id,
        attempt)``) or ``manual`` (``producer`` is ``None``); its id is
        time-ordered. A stored event's ``deliveries`` grows by ``copies`` and
        its ``last_received_at`` becomes ``now`` — at once, except on
        Postgres for a row another transaction holds (an event being
        routed): its count is returned in ``later``, not waited for. Rows are
        written in the order given (callers pass them in key order, the order
        routing locks events in). Every key must be distinct; empty in, empty out.
        """
        ...

    async def apply_deferred_deliveries(
        self, counts: Mapping[uuid.UUID, int], *, at: datetime
    ) -> None:
        """Add ``counts`` (event id -> copies) to the events' ``deliveries``;
        ``last_received_at`` becomes ``at`` unless it is later already. Waits
        for transactions holding the rows, locking them in routing's order.
        Unknown ids are skipped."""
        ...

    async def advance_progress(self, folds: Sequence[ProgressFold], *, now: datetime) -> None:
        """Fold each into its version's progress row, created if absent, in
        the order given (callers sort by version: one lock order).

        The stored ranges become the merge of the stored and the new ones
        (touching ranges join), the cursor the higher one, the event count
        the sum; ``updated_at`` is ``now``.
        """
        ...

    @property
    def accepts_in_one_statement(self) -> bool:
        """Whether :meth:`accept_in_one_statement` is available (Postgres)."""
        ...

    async def accept_in_one_statement(
        self,
        events: Sequence[NewEvent],
        *,
        producer: tuple[uuid.UUID, int] | None,
        now: datetime,
        rows: RouteRows,
    ) -> StoredEvents:
        """:meth:`store_events`, :meth:`advance_progress` for the new events
        (by version: merged ranges, the highest ``int_cursor``, their count)
        and the outbox rows of ``rows``, as one statement.

        ``later`` of the answer holds only the counts the statement could not
        see (a unit another transaction stored after the statement began):
        the caller leaves them for the router as :meth:`store_events`'s.
        Raises ``NotImplementedError`` where :attr:`accepts_in_one_statement`
        is false.
        """
        ...
