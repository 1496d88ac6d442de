"""The events area (:mod:`trace_core.storage.ports.events`) in SQL, for both engines.

Postgres and SQLite differ in three places. Storing: Postgres inserts the
new rows sent as columns and counts redeliveries without waiting for a
routing that holds them (:data:`_COUNT_NOW`), and an acceptance can do all
its writes in one statement (:mod:`~trace_core.storage.sql_events_accept`);
SQLite upserts (its writers are serialized, nothing holds a row).
Progress: Postgres merges ranges on the server (:data:`_FOLD`), SQLite reads, merges with
:func:`~trace_core.ranges.merge_ranges` and writes back. The producer check
share-locks the task row on Postgres only.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from trace_core.model import TASKS
from trace_core.ranges import merge_ranges
from trace_core.storage import schema
from trace_core.storage.bulk import records_param, uuid_array
from trace_core.storage.ports.events import (
    EventKey,
    NewEvent,
    ProducerAttempt,
    ProgressFold,
    RouteRows,
    StoredEvents,
)
from trace_core.storage.sql_area import SqlArea, SqlStatements
from trace_core.storage.sql_events_accept import ACCEPT_EVENTS
from trace_core.storage.sql_events_insert import INSERT_EVENTS, insert_events_params
from trace_core.storage.sql_events_parts import COUNT_CTES, FOLD_MERGE
from trace_core.storage.sql_leasing import reply_accepted
from trace_core.storage.sqlite_events import STORE_EVENTS, store_events_params

__all__ = ["SqlEventOps"]

# Redeliveries counted at once where no routing holds them (see COUNT_CTES).
_COUNT_NOW = sa.text(
    """
WITH c AS (
    SELECT * FROM jsonb_to_recordset(CAST(:rows AS jsonb))
        AS c(dataset_version uuid, unit_key text, n integer)
), """
    + COUNT_CTES
    + """
SELECT found.id, found.dataset_version, found.unit_key, found.n, bumped.id IS NOT NULL
FROM found LEFT JOIN bumped ON bumped.id = found.id
"""
)

# Deferred counts, applied by the router: wait for each row, locked in routing's order.
_APPLY = sa.text(
    """
WITH c AS (
    SELECT * FROM jsonb_to_recordset(CAST(:rows AS jsonb)) AS c(id uuid, n integer)
), locked AS (
    SELECT e.id FROM events e WHERE e.id IN (SELECT id FROM c)
    ORDER BY e.dataset_version, e.unit_key COLLATE "C"
    FOR UPDATE
)
UPDATE events
SET deliveries = events.deliveries + c.n,
    last_received_at = greatest(events.last_received_at, CAST(:at AS timestamptz))
FROM c JOIN locked ON locked.id = c.id
WHERE events.id = c.id
"""
)

# One version's progress: insert the row or merge into it (see FOLD_MERGE).
_FOLD = sa.text(
    """
INSERT INTO dataset_version_progress AS p
       (dataset_version, dataset_uuid, ranges, max_cursor, events, updated_at)
VALUES (:version, :dataset_uuid, CAST(:ranges AS jsonb), CAST(:max_cursor AS bigint), :events,
        :now)
"""
    + FOLD_MERGE
)


def _producer(row: Sequence[Any]) -> ProducerAttempt:
    status, attempt, replying, outputs = row[:4]
    return ProducerAttempt(
        str(status), int(attempt), bool(replying), tuple(uuid.UUID(str(o)) for o in outputs or ())
    )


class _EventStatements(SqlStatements, Protocol):
    """What accepting needs of its transaction besides statements
    (:class:`~trace_core.storage.sql.SqlTransaction` has it)."""

    channels: set[str]
    """Channels to wake after commit."""
    notified: set[str]
    """Channels a statement notified itself (none is notified again at commit)."""


class SqlEventOps(SqlArea):
    """:class:`~trace_core.storage.ports.events.EventOps` on a SQL transaction."""

    def __init__(self, tx: _EventStatements) -> None:
        super().__init__(tx)
        self._sql = tx  # its notification bookkeeping

    def _producer_query(self, task_id: uuid.UUID) -> sa.Select[Any]:
        t, j = schema.tasks, schema.jobs
        # The same status test as a fenced completion (one rule for every reply).
        replying = reply_accepted(TASKS).label("replying")
        return (
            sa.select(t.c.status, t.c.attempt, replying, j.c.output_datasets)
            .join(j, j.c.id == t.c.job_id)
            .where(t.c.id == task_id)
        )

    async def lock_producer_attempt(self, task_id: uuid.UUID) -> ProducerAttempt | None:
        stmt = self._producer_query(task_id)
        if self.engine_name == "postgres":
            stmt = stmt.with_for_update(read=True, of=schema.tasks)
        rows = await self._rows("producer attempt", stmt)
        return _producer(rows[0]) if rows else None

    async def lock_producer_and_versions(
        self, task_id: uuid.UUID, version_ids: Collection[uuid.UUID]
    ) -> tuple[ProducerAttempt | None, dict[uuid.UUID, uuid.UUID]]:
        if self.engine_name != "postgres" or not version_ids:
            # SQLite: in-process, a second statement costs no round trip
            found = await self.lock_producer_attempt(task_id)
            return found, await self.datasets_of_versions(version_ids)
        # Postgres: the versions' owners ride on the producer row as one JSON
        # object (an acceptance is a chain of round trips: one fewer here).
        v = schema.dataset_versions
        wanted = sa.cast(
            sa.bindparam("versions", uuid_array(set(version_ids))), postgresql.ARRAY(sa.Uuid())
        )
        owners = (
            sa.select(sa.func.jsonb_object_agg(v.c.id, v.c.dataset_uuid))
            .where(v.c.id == sa.func.any(wanted))
            .scalar_subquery()
        )
        stmt = (
            self._producer_query(task_id)
            .add_columns(sa.type_coerce(owners, postgresql.JSONB))
            .with_for_update(read=True, of=schema.tasks)
        )
        rows = await self._rows("producer attempt", stmt)
        if not rows:
            return None, {}
        return _producer(rows[0]), {
            uuid.UUID(version): uuid.UUID(dataset)
            for version, dataset in (rows[0][4] or {}).items()
        }

    async def datasets_of_versions(
        self, version_ids: Collection[uuid.UUID]
    ) -> dict[uuid.UUID, uuid.UUID]:
        if not version_ids:
            return {}
        v = schema.dataset_versions
        stmt = sa.select(v.c.id, v.c.dataset_uuid).where(v.c.id.in_(set(version_ids)))
        return {row[0]: row[1] for row in await self._rows("dataset versions", stmt)}

    async def store_events(
        self, events: Sequence[NewEvent], *, producer: tuple[uuid.UUID, int] | None, now: datetime
    ) -> StoredEvents:
        if not events:
            return StoredEvents({}, set())
        copies = {(ev.dataset_version, ev.unit_key): ev.copies for ev in events}
        if self.engine_name == "postgres":
            return await self._store_events_pg(events, copies, producer, now)
        stmt = STORE_EVENTS  # one JSON parameter (:mod:`~trace_core.storage.sqlite_events`)
        rows = store_events_params(events, producer=producer, now=now)
        ids: dict[EventKey, uuid.UUID] = {}
        fresh: set[uuid.UUID] = set()
        for row_id, version, unit_key, deliveries in await self._rows("store events", stmt, rows):
            ids[(version, unit_key)] = row_id
            # inserted now: its count is this request's copies; else it grew past them
            if deliveries == copies[(version, unit_key)]:
                fresh.add(row_id)
        return StoredEvents(ids, fresh)

    @property
    def accepts_in_one_statement(self) -> bool:
        return self.engine_name == "postgres"

    async def accept_in_one_statement(
        self,
        events: Sequence[NewEvent],
        *,
        producer: tuple[uuid.UUID, int] | None,
        now: datetime,
        rows: RouteRows,
    ) -> StoredEvents:
        if not self.accepts_in_one_statement:
            raise NotImplementedError("accepting in one statement needs Postgres")
        if not events:
            return StoredEvents({}, set())
        params = {
            **insert_events_params(events, producer=producer, now=now, fold=True),
            "kind": rows.kind,
            "ids_key": rows.ids_key,
            "chunk": rows.chunk,
            "deferred_key": rows.deferred_key,
            "at": rows.at,
            "max_attempts": rows.max_attempts,
            "channel": rows.channel,
        }
        ids: dict[EventKey, uuid.UUID] = {}
        fresh: set[uuid.UUID] = set()
        unseen: list[NewEvent] = []
        notified = False
        answered = await self._fixed_rows("accept events", ACCEPT_EVENTS, params)
        for event, (inserted, stored, note) in zip(events, answered, strict=True):
            notified = notified or bool(note)
            key = (event.dataset_version, event.unit_key)
            if inserted is not None:
                ids[key] = inserted
                fresh.add(inserted)
            elif stored is not None:
                ids[key] = stored  # counted now, or in the statement's deferred row
            else:
                unseen.append(event)
        if notified:
            # the statement notified the relays itself: no second pg_notify at
            # commit, but in-process listeners are woken after it all the same
            self._sql.channels.add(rows.channel)
            self._sql.notified.add(rows.channel)
        later: dict[uuid.UUID, int] = {}
        if unseen:
            # stored by another acceptance after the statement began: count them
            # as store_events does (they are not new here)
            counted = await self._count_redeliveries(
                {(ev.dataset_version, ev.unit_key): ev.copies for ev in unseen}, now
            )
            for key, (event_id, deferred) in counted.items():
                ids[key] = event_id
                if deferred:
                    later[event_id] = deferred
        return StoredEvents(ids, fresh, later)

    async def _count_redeliveries(
        self, copies: Mapping[EventKey, int], now: datetime
    ) -> dict[EventKey, tuple[uuid.UUID, int]]:
        """:data:`_COUNT_NOW` for stored units: key -> (id, copies left for
        the router, 0 if counted now)."""
        stored = [
            {"dataset_version": version.hex, "unit_key": unit_key, "n": n}
            for (version, unit_key), n in copies.items()
        ]
        params = {"rows": records_param(stored), "now": now}
        return {
            (version, unit_key): (event_id, 0 if counted else int(n))
            for event_id, version, unit_key, n, counted in await self._rows(
                "count redeliveries", _COUNT_NOW, params
            )
        }

    async def _store_events_pg(
        self,
        events: Sequence[NewEvent],
        copies: Mapping[EventKey, int],
        producer: tuple[uuid.UUID, int] | None,
        now: datetime,
    ) -> StoredEvents:
        """Insert the new events, sent as columns (:data:`INSERT_EVENTS`);
        count redeliveries without waiting for a routing that holds them
        (:data:`_COUNT_NOW`)."""
        params = insert_events_params(events, producer=producer, now=now)
        inserted = await self._fixed_rows("store events", INSERT_EVENTS, params)
        ids: dict[EventKey, uuid.UUID] = {
            (version, unit_key): row_id for row_id, version, unit_key in inserted
        }
        fresh = set(ids.values())
        later: dict[uuid.UUID, int] = {}
        stored = {key: n for key, n in copies.items() if key not in ids}
        if stored:
            for key, (event_id, deferred) in (await self._count_redeliveries(stored, now)).items():
                ids[key] = event_id
                if deferred:
                    later[event_id] = deferred
        return StoredEvents(ids, fresh, later)

    async def apply_deferred_deliveries(
        self, counts: Mapping[uuid.UUID, int], *, at: datetime
    ) -> None:
        if not counts:
            return
        if self.engine_name != "postgres":
            # Nothing holds a SQLite row: the counts were applied at once and
            # none is ever deferred; apply any given all the same.
            e = schema.events
            stmt = (
                sa.update(e)
                .where(e.c.id == sa.bindparam("b_id", type_=e.c.id.type))
                .values(
                    deliveries=e.c.deliveries + sa.bindparam("b_n"),
                    # one text format for every stored time: max() compares them
                    last_received_at=sa.func.max(
                        e.c.last_received_at,
                        sa.bindparam("b_at", type_=e.c.last_received_at.type),
                    ),
                )
            )
            params = [{"b_id": i, "b_n": n, "b_at": at} for i, n in counts.items()]
            await self._run("apply redeliveries", stmt, params)
            return
        rows = [{"id": str(i), "n": int(n)} for i, n in counts.items()]
        await self._run("apply redeliveries", _APPLY, {"rows": records_param(rows), "at": at})

    async def advance_progress(self, folds: Sequence[ProgressFold], *, now: datetime) -> None:
        for fold in folds:
            if self.engine_name == "postgres":
                await self._fold_in_sql(fold, now)
            else:
                await self._fold_in_python(fold, now)

    async def _fold_in_sql(self, fold: ProgressFold, now: datetime) -> None:
        """Postgres: merge on the server (:data:`_FOLD`)."""
        params = {
            "version": fold.version,
            "dataset_uuid": fold.dataset_uuid,
            "ranges": json.dumps([list(r) for r in fold.spans]),
            "max_cursor": fold.max_cursor,
            "events": fold.events,
            "now": now,
        }
        await self._run("advance progress", _FOLD, params)

    async def _fold_in_python(self, fold: ProgressFold, now: datetime) -> None:
        """SQLite: read the row, merge with :func:`merge_ranges`, write it back
        (in-process, the round trips cost nothing; SQLite has no range types)."""
        p = schema.dataset_version_progress
        absent = (
            self._tx.insert(p)
            .values(
                dataset_version=fold.version,
                dataset_uuid=fold.dataset_uuid,
                ranges=[],
                max_cursor=None,
                events=0,
                updated_at=now,
            )
            .on_conflict_do_nothing()
        )
        await self._run("advance progress", absent)
        read = sa.select(p.c.ranges, p.c.max_cursor, p.c.events).where(
            p.c.dataset_version == fold.version
        )
        ranges, max_cursor, events = (await self._rows("advance progress", read))[0]
        cursors = [c for c in (fold.max_cursor, max_cursor) if c is not None]
        write = (
            sa.update(p)
            .where(p.c.dataset_version == fold.version)
            .values(
                ranges=[list(r) for r in merge_ranges([*(ranges or ()), *fold.spans])],
                max_cursor=max(int(c) for c in cursors) if cursors else None,
                events=int(events) + fold.events,
                updated_at=now,
            )
        )
        await self._run("advance progress", write)
