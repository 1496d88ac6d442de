"""The routing area of the repository port: stored events become tasks.

Reached as ``tx.routing`` on any :class:`~trace_core.storage.protocol.Transaction`.
The router (:mod:`trace_core.dispatcher.routing`) decides which task each
event means for which job; this area reads the events, writes the tasks'
``task_inputs`` rows and the events' outcomes, and, where the engine can,
routes the common case in one set-based statement.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

__all__ = [
    "LockedRoute",
    "RouteOutcome",
    "RoutingOps",
    "SetRoute",
    "SingleInputJob",
    "StoredEvent",
    "TaskInput",
    "Wakeup",
]


class Wakeup(Protocol):
    """How new tasks are announced (:class:`~trace_core.storage.protocol.TaskWakeup`
    is one): outbox rows of ``outbox_kind`` carrying up to ``chunk`` task ids
    (none when it is ``None``), and ``channels`` notified at commit."""

    @property
    def outbox_kind(self) -> str | None: ...

    @property
    def channels(self) -> tuple[str, ...]: ...

    @property
    def chunk(self) -> int: ...


@dataclass(frozen=True)
class StoredEvent:
    """An event row, as routing reads it."""

    id: uuid.UUID
    dataset_uuid: uuid.UUID
    dataset_version: uuid.UUID
    unit_key: str
    cursor: str | None
    partition_key: str | None
    start: int | None
    end: int | None
    received_at: datetime


@dataclass(frozen=True)
class TaskInput:
    """A ``task_inputs`` row: a task read this unit of this input."""

    task_id: uuid.UUID
    dataset_uuid: uuid.UUID
    partition_key: str
    """The partition key, or ``cursor:{cursor}``."""
    version: datetime
    """When the unit was received (the input's version of it)."""


@dataclass(frozen=True)
class RouteOutcome:
    """One event's routing outcome."""

    event_id: uuid.UUID
    status: str
    """``routed``, ``not_current`` or ``pending`` (to be routed again)."""
    routed_at: datetime | None
    tasks_created: int
    tasks_existing: int
    detail: Mapping[str, str] | None
    """job name -> ``created``, ``existing``, ``paused``, ``waiting_for_inputs``."""


@dataclass(frozen=True)
class SingleInputJob:
    """A dependent reading one input, for :meth:`RoutingOps.route_single_input_events`."""

    job_id: uuid.UUID
    job_name: str
    dataset_version: uuid.UUID
    """The version of its input its DAG version pins."""
    pinned: Mapping[str, Any]
    """The input's entry in a task's ``input_versions`` (without the unit);
    jobs pinning the same edge pass equal mappings."""
    max_attempts: int
    queued_at: datetime
    """Its tasks' claim order: now plus its tier's handicap."""


@dataclass(frozen=True)
class SetRoute:
    """What :meth:`RoutingOps.route_single_input_events` did."""

    created: int
    """Tasks created (each with its wake-up)."""
    decisions: int
    """(event, job) pairs decided: a task created or found existing."""


@dataclass(frozen=True)
class LockedRoute(SetRoute):
    """What :meth:`RoutingOps.lock_and_route_single_input_events` did."""

    events: int
    """Pending events found (and routed)."""
    not_current: int
    """Of those, events of versions no live DAG version points at."""


class RoutingOps(Protocol):
    """Event reads and routing writes, inside one transaction."""

    async def lock_pending_events(self, event_ids: Collection[uuid.UUID]) -> list[StoredEvent]:
        """The ``pending`` events among ``event_ids``, oldest first
        (``received_at``, then id); others and unknown ids are left out.

        On Postgres they stay row-locked until the transaction ends, taken in
        key order (``dataset_version``, then ``unit_key`` bytewise), the one
        order every writer of event rows takes. Empty in, empty out.
        """
        ...

    async def event_history(
        self,
        versions: Collection[uuid.UUID],
        *,
        after: tuple[datetime, uuid.UUID] | None,
        limit: int,
    ) -> list[StoredEvent]:
        """Up to ``limit`` stored events of ``versions`` (any status) in
        ``(received_at, id)`` order, strictly after the ``after`` mark when
        given. Empty when ``versions`` is."""
        ...

    async def insert_task_inputs_if_absent(self, rows: Sequence[TaskInput]) -> None:
        """Insert the rows; one already stored (same task and input unit) is
        skipped. Nothing for an empty input."""
        ...

    async def store_route_outcomes(self, outcomes: Sequence[RouteOutcome]) -> None:
        """Store each event's outcome: its status, ``routed_at`` and detail are
        replaced; its task counts add to the stored ones (across deferrals)."""
        ...

    @property
    def routes_in_one_statement(self) -> bool:
        """Whether :meth:`route_single_input_events` is available (both SQL
        engines: one statement on Postgres, a few in the transaction on SQLite)."""
        ...

    async def route_single_input_events(
        self,
        event_ids: Collection[uuid.UUID],
        not_current: Collection[uuid.UUID],
        jobs: Sequence[SingleInputJob],
        *,
        now: datetime,
        wakeup: Wakeup,
    ) -> SetRoute:
        """Route the events ``event_ids`` to ``jobs`` set-based (one statement
        on Postgres; on SQLite a few, in the caller's transaction).

        For each (event, job) whose pinned version is the event's version,
        creates the task of the event's own unit (dedupe key
        ``partition:{dataset}:{version}:{partition}`` or
        ``cursor:{dataset}:{version}:{cursor}``; input_versions the job's pinned
        edge with the unit, and the trigger event), unless the job has it
        already, with its ``task_inputs`` row and its wake-up (``wakeup``'s
        outbox rows; its channels are notified at commit). Every event
        becomes ``routed`` (``not_current`` for those in ``not_current``) with
        its outcome stored as :meth:`store_route_outcomes` does. Returns the
        tasks created and the (event, job) pairs decided. Only where
        :attr:`routes_in_one_statement`; elsewhere it raises
        ``NotImplementedError`` and writes nothing.
        """
        ...

    @property
    def locks_and_routes_in_one_statement(self) -> bool:
        """Whether :meth:`lock_and_route_single_input_events` is available (Postgres)."""
        ...

    async def lock_and_route_single_input_events(
        self,
        event_ids: Collection[uuid.UUID],
        live_versions: Collection[uuid.UUID],
        jobs: Sequence[SingleInputJob],
        *,
        now: datetime,
        wakeup: Wakeup,
    ) -> LockedRoute:
        """:meth:`lock_pending_events` and :meth:`route_single_input_events`
        in one statement: the events among ``event_ids`` are locked (in the
        order :meth:`lock_pending_events` takes; on Postgres the ones no longer
        pending too) and the ``pending`` ones routed to ``jobs``, which must
        hold every single-input dependent any of them can reach;
        events of versions outside ``live_versions`` become ``not_current``.
        Returns what was created and decided, and the events found. Only where
        :attr:`locks_and_routes_in_one_statement`; elsewhere it raises
        ``NotImplementedError`` and writes nothing.
        """
        ...
