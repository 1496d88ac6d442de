"""The transactions that move inbox jobs, and the wake-up after their commit.

Every service that changes a job's status (:class:`~trace_core.euterpe.jobs.InboxJobs`,
:class:`~trace_core.euterpe.job_maintenance.InboxMaintenance`) does it in a
:meth:`JobWriter.scope`: the protocol's write, then
:meth:`WriteScope.record` for the history rows and events, in one
transaction; after the commit, ``on_commit`` gets the ids of the events
written (euterpe-contract.md §12: a deliverer is woken at once).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime

from trace_core.clock import Clock
from trace_core.euterpe.job_records import Transition, record
from trace_core.storage.protocol import Repository, Transaction, within

__all__ = ["JobWriter", "OnCommit", "WriteScope"]

log = logging.getLogger(__name__)

OnCommit = Callable[[Sequence[uuid.UUID]], None]
"""Called with the ids of the events a commit wrote."""


@dataclass
class WriteScope:
    """One open transaction moving jobs; ``now`` is the time of all its rows."""

    t: Transaction
    now: datetime
    writer: JobWriter
    events: list[uuid.UUID] = field(default_factory=list)

    async def record(self, transitions: Sequence[Transition]) -> None:
        """Write the history rows and events of ``transitions`` (whose status
        changes this transaction already made)."""
        self.events += await record(
            self.t,
            transitions,
            now=self.now,
            event_max_attempts=self.writer.event_max_attempts,
            new_event_id=self.writer.new_event_id,
        )


class JobWriter:
    """Opens :class:`WriteScope`\\ s and calls ``on_commit`` after theirs."""

    def __init__(
        self,
        repo: Repository,
        clock: Clock,
        *,
        event_max_attempts: int,
        new_event_id: Callable[[], uuid.UUID] = uuid.uuid4,
        on_commit: OnCommit | None = None,
    ) -> None:
        self.repo = repo
        self.clock = clock
        self.event_max_attempts = event_max_attempts
        self.new_event_id = new_event_id
        self.on_commit = on_commit

    @asynccontextmanager
    async def scope(self, tx: Transaction | None = None) -> AsyncIterator[WriteScope]:
        """A new write transaction, or the caller's ``tx`` joined (then the
        caller commits, and the transaction's notification of
        :data:`~trace_core.euterpe.job_records.EVENTS_CHANNEL` is the wake-up)."""
        async with within(self.repo, tx) as t:
            scope = WriteScope(t, self.clock.now(), self)
            yield scope
        if tx is None:
            self.committed(scope.events)

    def committed(self, events: Sequence[uuid.UUID]) -> None:
        """Call ``on_commit`` after a commit that wrote ``events``. A failing
        hook is logged, not raised: the transition is committed already."""
        hook = self.on_commit
        if not events or hook is None:
            return
        try:
            hook(list(events))
        except Exception:
            log.exception("euterpe: on_commit hook failed after %d events", len(events))
