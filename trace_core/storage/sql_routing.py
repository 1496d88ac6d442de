"""The routing area (:mod:`trace_core.storage.ports.routing`) in SQL, for both engines.

Postgres locks the pending events it routes (in key order), writes bulk rows
from one JSON parameter, and routes the common case in ONE statement
(:data:`_ROUTE`). When every dependent an event batch reaches reads a single
input (so its task's dedupe key is the event's own unit key, its pinned
inputs are its one edge plus the unit, and it needs no join check) and none
of them is paused, the whole routing decision is a join of the batch's
events with its dependents. The server then derives every task column from
the stored event rows and writes tasks, ``task_inputs``, wake-ups and the
events' outcomes in one statement: no per-task Python and no per-task JSON to
build, send and parse, which were most of the cost of routing (client and
server alike). Its meaning is exactly the generic planner's
(:mod:`trace_core.dispatcher.routing`); multi-input joins and paused jobs
take the generic path. SQLite, without data-modifying CTEs, runs the same
decision as a few statements in the transaction
(:mod:`~trace_core.storage.sqlite_routing`). Task ids are time-ordered
(:func:`~trace_core.storage.bulk.id_block`): one statement's tasks are
consecutive ids, so their primary-key entries are appended, not scattered
over the index. When every live reactive job reads one input and none is
paused, the same statement also locks the events itself
(:data:`_LOCK_AND_ROUTE`): a routing transaction is then the topology reads,
that statement (which notifies the wake-up channels too) and the commit.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection, Sequence
from datetime import datetime
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import AsyncConnection

from trace_core.storage import schema
from trace_core.storage.bulk import (
    bulk_insert,
    id_block,
    json_records,
    records_param,
    unprepared,
    uuid_array,
    wakeup_params,
    wakeup_rows_sql,
)
from trace_core.storage.ports.routing import (
    LockedRoute,
    RouteOutcome,
    SetRoute,
    SingleInputJob,
    StoredEvent,
    TaskInput,
    Wakeup,
)
from trace_core.storage.sql_area import SqlArea, SqlStatements
from trace_core.storage.sqlite_routing import route_single_input_events_sqlite

__all__ = ["SqlRoutingOps"]


# ev: the batch with each event's status and own unit (dedupe key, input
# entry, task_inputs key); docs: each event's input_versions document for each
# distinct pinned edge (:pins), built once per event, not once per task (the
# dependents of a dataset version mostly pin the same edge); j: the
# dependents with the index of their edge in :pins; cand: one row per (event,
# job) whose edge pins the event's version, with the id its task gets if
# created. ins names its arbiter: without one, every unique index
# (the primary key too) is probed before each insert. tally: tasks created
# and decisions (each version's dependents per event). When every decision
# created its task (the common case), made is cand itself and each event's
# outcome its version's one detail (per_version): no join of cand with the
# inserted ids and no aggregate per event.
# Otherwise made joins cand on the inserted ids (not on the ~100-character
# dedupe key) and outcomes are aggregated per event; the one-time filters on
# tally leave the other branch unexecuted.
def _events(source: str, status: str) -> str:
    """The ``ev`` CTE: each event of ``source`` (SQL naming the rows as ``e``)
    with its ``status`` (an SQL expression) and its own unit."""
    return f"""ev AS (
    SELECT e.id, e.dataset_uuid, e.dataset_version, e.partition_key, e.received_at,
           {status} AS status,
           CASE WHEN e.partition_key IS NOT NULL
                THEN 'partition:' || e.dataset_uuid || ':' || e.dataset_version || ':'
                     || e.partition_key
                ELSE 'cursor:' || e.dataset_uuid || ':' || e.dataset_version || ':' || e.cursor
           END AS dedupe_key,
           CASE WHEN e.partition_key IS NULL THEN jsonb_build_object('cursor', e.cursor)
                WHEN e.range_start IS NULL THEN jsonb_build_object('partition_key', e.partition_key)
                ELSE jsonb_build_object('partition_key', e.partition_key,
                                        'start', e.range_start, 'end', e.range_end)
           END AS unit,
           coalesce(e.partition_key, 'cursor:' || e.cursor) AS input_key
    FROM {source}
)"""


_ROUTE_REST = (
    """docs AS MATERIALIZED (  -- else inlined into cand: built once per task again
    SELECT ev.*, ARRAY(
        SELECT jsonb_build_object('inputs', jsonb_build_array(p.pinned || ev.unit),
                                  'trigger_event_id', CAST(ev.id AS text))
        FROM jsonb_array_elements(CAST(:pins AS jsonb)) WITH ORDINALITY AS p(pinned, n)
        ORDER BY p.n
    ) AS input_versions
    FROM ev
), j AS (
    SELECT * FROM jsonb_to_recordset(CAST(:jobs AS jsonb)) AS j(
        job_id uuid, job_name text, dataset_version uuid, pin integer,
        max_attempts integer, queued_at timestamptz)
), cand AS (
    SELECT d.id AS event_id, d.dataset_uuid, d.partition_key, d.received_at,
           d.input_versions[j.pin] AS input_versions, d.input_key, d.dedupe_key, j.job_id,
           j.job_name, j.max_attempts, j.queued_at,
           CAST(:id_prefix || lpad(to_hex(row_number() OVER ()), 8, '0') AS uuid) AS task_id
    FROM docs AS d JOIN j ON j.dataset_version = d.dataset_version
), ins AS (
    INSERT INTO tasks (id, job_id, dedupe_key, status, attempt, claim_version, partitions,
                       input_versions, max_attempts, created_at, queued_at)
    SELECT task_id, job_id, dedupe_key, 'Queued', 1, 0,
           CASE WHEN partition_key IS NOT NULL THEN ARRAY[partition_key] END,
           input_versions, max_attempts, :now, queued_at
    FROM cand ORDER BY task_id
    ON CONFLICT (job_id, dedupe_key) WHERE dedupe_key IS NOT NULL DO NOTHING
    RETURNING id
), per_version AS (  -- each version's dependents: how many, and the detail when all are created
    SELECT dataset_version, count(*) AS jobs,
           jsonb_object_agg(job_name, 'created') AS all_created
    FROM j GROUP BY dataset_version
), tally AS MATERIALIZED (
    SELECT (SELECT count(*) FROM ins) AS created,
           (SELECT coalesce(sum(v.jobs), 0) FROM ev JOIN per_version v
                ON v.dataset_version = ev.dataset_version) AS decisions
), made AS (  -- narrow: what inputs, outcomes and wake-ups need of the tasks made
    SELECT task_id, event_id, dataset_uuid, input_key, received_at FROM cand
    WHERE (SELECT created = decisions FROM tally)  -- all made: no join
    UNION ALL
    SELECT cand.task_id, cand.event_id, cand.dataset_uuid, cand.input_key, cand.received_at
    FROM cand JOIN ins ON ins.id = cand.task_id
    WHERE (SELECT created < decisions FROM tally)
), inputs AS (  -- tasks made just now: no inputs row can exist, so no ON CONFLICT
    INSERT INTO task_inputs (task_id, input_dataset_uuid, input_partition_key, input_version)
    SELECT task_id, dataset_uuid, input_key, received_at FROM made ORDER BY task_id
), outcome AS (
    SELECT ev.id AS event_id, v.jobs AS created, 0 AS existing, v.all_created AS detail
    FROM ev JOIN per_version v ON v.dataset_version = ev.dataset_version
    WHERE (SELECT created = decisions FROM tally)  -- all made: the version's one detail
    UNION ALL
    SELECT cand.event_id, count(made.task_id), count(*) - count(made.task_id),
           jsonb_object_agg(cand.job_name,
                            CASE WHEN made.task_id IS NULL THEN 'existing' ELSE 'created' END)
    FROM cand LEFT JOIN made ON made.task_id = cand.task_id
    WHERE (SELECT created < decisions FROM tally)
    GROUP BY cand.event_id
), outcomes AS (
    UPDATE events SET route_status = ev.status,
                      routed_at = :now,
                      tasks_created = events.tasks_created + coalesce(outcome.created, 0),
                      tasks_existing = events.tasks_existing + coalesce(outcome.existing, 0),
                      route_detail = outcome.detail
    FROM ev LEFT JOIN outcome ON outcome.event_id = ev.id
    WHERE events.id = ev.id
), wake AS (
    """
    + wakeup_rows_sql("made", "task_id")
    + """
), note AS (  -- the wake-up channels, when tasks were made: no pg_notify trip at commit
    SELECT count(pg_notify(ch, '')) AS n
    FROM jsonb_array_elements_text(CAST(:channels AS jsonb)) AS ch
    WHERE (SELECT created FROM tally) > 0
)
"""
)
"""Everything after ``ev`` (the CTEs ``docs`` to ``note``)."""

_ROUTE = sa.text(
    "WITH "
    + _events(
        # a primary-key lookup, not a join with every event
        "unnest(CAST(:ids AS uuid[])) AS s(id) JOIN events e ON e.id = s.id\n"
        "    WHERE e.id = ANY(CAST(:ids AS uuid[]))",
        "CASE WHEN e.id = ANY(CAST(:not_current AS uuid[])) THEN 'not_current' ELSE 'routed' END",
    )
    + ", "
    + _ROUTE_REST
    + "SELECT created, decisions, (SELECT n FROM note) FROM tally\n"
)

# The same, with the events locked by the statement itself, in the order
# lock_pending_events takes (the one order every writer of event rows takes),
# and each event's status from the live versions: one round trip and one
# pass over the event rows fewer than locking them first. Every event among
# the ids is locked and only the pending ones are routed: with the status
# test in the locking WHERE, the planner estimated the batch at a couple of
# rows (its default selectivity, or the share of pending events in the whole
# table) and joined the events with their outcomes by nested loops, a pass
# over the batch per event. An event that is not pending any more is rare
# (a route_event row handled again); its lock only defers an accept's count
# of its redeliveries to the router, as for any event being routed.
_LOCK_AND_ROUTE = sa.text(
    """WITH locked AS MATERIALIZED (
    SELECT e.id, e.dataset_uuid, e.dataset_version, e.cursor, e.partition_key, e.range_start,
           e.range_end, e.received_at, e.route_status = 'pending' AS pending
    FROM events e
    WHERE e.id = ANY(CAST(:ids AS uuid[]))
    ORDER BY e.dataset_version, e.unit_key COLLATE "C"
    FOR UPDATE OF e
), """
    + _events(
        "locked AS e WHERE e.pending",
        "CASE WHEN e.dataset_version = ANY(CAST(:live AS uuid[])) THEN 'routed' "
        "ELSE 'not_current' END",
    )
    + ", "
    + _ROUTE_REST
    + """SELECT created, decisions, (SELECT n FROM note), (SELECT count(*) FROM ev),
       (SELECT count(*) FROM ev WHERE status = 'not_current')
FROM tally
"""
)


def _select_events() -> sa.Select[Any]:
    """The columns of :class:`StoredEvent`, in its field order."""
    e = schema.events
    return sa.select(
        e.c.id,
        e.c.dataset_uuid,
        e.c.dataset_version,
        e.c.unit_key,
        e.c.cursor,
        e.c.partition_key,
        e.c.range_start,
        e.c.range_end,
        e.c.received_at,
    )


def _text(value: uuid.UUID | datetime) -> str:
    return value.hex if isinstance(value, uuid.UUID) else value.isoformat()


class _RoutingStatements(SqlStatements, Protocol):
    """What routing needs of its transaction besides statements
    (:class:`~trace_core.storage.sql.SqlTransaction` has it)."""

    channels: set[str]
    notified: set[str]
    """Channels a statement notified itself (none is notified again at commit)."""

    async def _connection(self) -> AsyncConnection:
        """The transaction's SQLAlchemy connection (to run a statement unprepared)."""
        ...


class SqlRoutingOps(SqlArea):
    """:class:`~trace_core.storage.ports.routing.RoutingOps` on a SQL transaction."""

    def __init__(self, tx: _RoutingStatements) -> None:
        super().__init__(tx)
        self._sql = tx  # its connection (unprepared statements) and its channels

    async def lock_pending_events(self, event_ids: Collection[uuid.UUID]) -> list[StoredEvent]:
        if not event_ids:
            return []
        e = schema.events
        pg = self.engine_name == "postgres"
        query = _select_events()
        if pg:
            # One array parameter, not hundreds of expanded IN parameters, joined
            # as a table: psycopg prepares the statement after a few runs, and
            # in that generic plan ``id = ANY(:ids)`` is a filter comparing
            # every event row with every id (linear in the table, times the
            # batch); joined, each id is one primary-key lookup.
            ids = (
                sa.func.unnest(
                    # each id once: a repeated id must not return (and lock) its row twice
                    sa.cast(
                        sa.bindparam("ids", uuid_array(dict.fromkeys(event_ids))),
                        postgresql.ARRAY(sa.Uuid()),
                    )
                )
                .table_valued(sa.column("id", sa.Uuid()))
                .render_derived(name="wanted")
            )
            query = query.join(ids, e.c.id == ids.c.id).where(e.c.route_status == "pending")
        else:
            query = query.where(e.c.id.in_(list(event_ids)), e.c.route_status == "pending")
        if pg:
            # Locked in unique-key order (bytewise, as Python sorts them), the one
            # order every writer of event rows takes: accepts insert and count in
            # it (skipping rows held here), and deferred counts wait in it.
            query = query.order_by(e.c.dataset_version, e.c.unit_key.collate("C")).with_for_update(
                of=e
            )
        events = [StoredEvent(*row) for row in await self._rows("pending events", query)]
        return sorted(events, key=lambda ev: (ev.received_at, ev.id))

    async def event_history(
        self,
        versions: Collection[uuid.UUID],
        *,
        after: tuple[datetime, uuid.UUID] | None,
        limit: int,
    ) -> list[StoredEvent]:
        if not versions:
            return []
        e = schema.events
        stmt = _select_events().where(e.c.dataset_version.in_(set(versions)))
        if after is not None:
            stmt = stmt.where(
                sa.or_(
                    e.c.received_at > after[0],
                    sa.and_(e.c.received_at == after[0], e.c.id > after[1]),
                )
            )
        stmt = stmt.order_by(e.c.received_at, e.c.id).limit(limit)
        return [StoredEvent(*row) for row in await self._rows("event history", stmt)]

    async def insert_task_inputs_if_absent(self, rows: Sequence[TaskInput]) -> None:
        if not rows:
            return
        ti = schema.task_inputs
        if self.engine_name == "postgres":
            text: dict[Any, str] = {}  # few distinct datasets and event times: format once
            records = [
                {
                    "task_id": row.task_id.hex,
                    "input_dataset_uuid": text.get(row.dataset_uuid)
                    or text.setdefault(row.dataset_uuid, _text(row.dataset_uuid)),
                    "input_partition_key": row.partition_key,
                    "input_version": text.get(row.version)
                    or text.setdefault(row.version, _text(row.version)),
                }
                for row in rows
            ]
            stmt = bulk_insert(ti, list(records[0])).on_conflict_do_nothing()
            await self._run("task inputs", stmt, {"rows": records_param(records)})
            return
        values = [
            {
                "task_id": row.task_id,
                "input_dataset_uuid": row.dataset_uuid,
                "input_partition_key": row.partition_key,
                "input_version": row.version,
            }
            for row in rows
        ]
        await self._run("task inputs", self._tx.insert(ti).on_conflict_do_nothing(), values)

    async def store_route_outcomes(self, outcomes: Sequence[RouteOutcome]) -> None:
        if not outcomes:
            return
        e = schema.events
        if self.engine_name == "postgres":
            r = json_records([e.c.id, *[e.c[name] for name in _EVENT_OUTCOME]])
            stmt = (
                sa.update(e)
                .where(e.c.id == r.c.id)
                .values(
                    route_status=r.c.route_status,
                    routed_at=r.c.routed_at,
                    tasks_created=e.c.tasks_created + r.c.tasks_created,
                    tasks_existing=e.c.tasks_existing + r.c.tasks_existing,
                    route_detail=r.c.route_detail,
                )
            )
            rows = [
                {
                    "id": o.event_id,
                    "route_status": o.status,
                    "routed_at": o.routed_at,
                    "tasks_created": o.tasks_created,
                    "tasks_existing": o.tasks_existing,
                    "route_detail": o.detail,
                }
                for o in outcomes
            ]
            await self._run("route outcomes", stmt, {"rows": records_param(rows)})
            return
        # executemany binds may not reuse column names: prefix them
        stmt = (
            sa.update(e)
            .where(e.c.id == sa.bindparam("b_id"))
            .values(
                route_status=sa.bindparam("b_route_status"),
                routed_at=sa.bindparam("b_routed_at"),
                tasks_created=e.c.tasks_created + sa.bindparam("b_tasks_created"),
                tasks_existing=e.c.tasks_existing + sa.bindparam("b_tasks_existing"),
                route_detail=sa.bindparam("b_route_detail", type_=e.c.route_detail.type),
            )
        )
        params = [
            {
                "b_id": o.event_id,
                "b_route_status": o.status,
                "b_routed_at": o.routed_at,
                "b_tasks_created": o.tasks_created,
                "b_tasks_existing": o.tasks_existing,
                "b_route_detail": None if o.detail is None else dict(o.detail),
            }
            for o in outcomes
        ]
        await self._run("route outcomes", stmt, params)

    @property
    def routes_in_one_statement(self) -> bool:
        # SQLite: a few set-based statements in the caller's transaction
        # (:mod:`~trace_core.storage.sqlite_routing`), same meaning.
        return True

    async def route_single_input_events(
        self,
        event_ids: Collection[uuid.UUID],
        not_current: Collection[uuid.UUID],
        jobs: Sequence[SingleInputJob],
        *,
        now: datetime,
        wakeup: Wakeup,
    ) -> SetRoute:
        if self.engine_name == "sqlite":
            done = await route_single_input_events_sqlite(
                self, event_ids, not_current, jobs, now=now, wakeup=wakeup
            )
            if done.created:
                self._sql.channels.update(wakeup.channels)
            return done
        params = {"ids": uuid_array(event_ids), "not_current": uuid_array(not_current)}
        created, decisions = (await self._route(_ROUTE, params, jobs, now, wakeup))[:2]
        return SetRoute(int(created), int(decisions))

    @property
    def locks_and_routes_in_one_statement(self) -> bool:
        return self.engine_name == "postgres"

    async def lock_and_route_single_input_events(
        self,
        event_ids: Collection[uuid.UUID],
        live_versions: Collection[uuid.UUID],
        jobs: Sequence[SingleInputJob],
        *,
        now: datetime,
        wakeup: Wakeup,
    ) -> LockedRoute:
        if not self.locks_and_routes_in_one_statement:
            raise NotImplementedError("set-based routing needs Postgres")
        params = {"ids": uuid_array(set(event_ids)), "live": uuid_array(set(live_versions))}
        created, decisions, _, events, not_current = await self._route(
            _LOCK_AND_ROUTE, params, jobs, now, wakeup
        )
        return LockedRoute(int(created), int(decisions), int(events), int(not_current))

    async def _route(
        self,
        statement: sa.TextClause,
        params: dict[str, Any],
        jobs: Sequence[SingleInputJob],
        now: datetime,
        wakeup: Wakeup,
    ) -> Sequence[Any]:
        """Run a set-based routing statement (:data:`_ROUTE` or
        :data:`_LOCK_AND_ROUTE`) with ``params`` and the jobs' and wake-up's
        parameters; its answer row (created, decisions, notified, ...)."""
        # Each distinct pinned edge once: its input_versions document is built
        # once per event, not once per task.
        pins: dict[tuple[tuple[str, Any], ...], int] = {}
        rows = []
        for job in jobs:
            edge = tuple(sorted(job.pinned.items()))
            pin = pins.get(edge) or pins.setdefault(edge, len(pins) + 1)
            rows.append(
                {
                    "job_id": job.job_id.hex,
                    "job_name": job.job_name,
                    "dataset_version": job.dataset_version.hex,
                    "pin": pin,
                    "max_attempts": job.max_attempts,
                    "queued_at": job.queued_at.isoformat(),
                }
            )
        params |= {
            "pins": records_param([dict(edge) for edge in pins]),
            "jobs": records_param(rows),
            "id_prefix": id_block(),
            "channels": json.dumps(sorted(wakeup.channels)),
            **wakeup_params(wakeup, now),
        }
        conn = await self._sql._connection()
        # Prepared, the statement would soon run a generic plan that is blind to
        # the batch size: it estimates one row per CTE and joins thousands by
        # nested loops. Unprepared, each batch is planned with its parameters.
        async with unprepared(conn):
            answer = (await self._rows("route events", statement, params))[0]
        if answer[0]:  # tasks created
            self._sql.channels.update(wakeup.channels)
        if answer[2]:  # the statement notified them: in-process listeners still woken at commit
            self._sql.notified.update(wakeup.channels)
        return tuple(answer)


_EVENT_OUTCOME = ("route_status", "routed_at", "tasks_created", "tasks_existing", "route_detail")
