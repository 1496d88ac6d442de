"""Set-based routing on Postgres: the common case in ONE statement.

When every dependent an event batch reaches reads a single input (so its
task's dedupe key is the event's own unit key, its pinned inputs are its one
edge plus the unit, and it needs no join check) and none of them is paused,
the whole routing decision is a join of the batch's events with its
dependents. The server then derives every task column from the stored event
rows and writes tasks, ``task_inputs``, wake-ups and the events' outcomes
in one statement: no per-task Python and no per-task JSON to build, send
and parse, which were most of the cost of routing (client and server alike).

The meaning is exactly the generic planner's (:mod:`trace_core.dispatcher.routing`);
multi-input joins, paused jobs and SQLite take the generic path. Task ids are
time-ordered (:func:`~trace_core.storage.bulk.id_block`): one statement's
tasks are consecutive ids, so their primary-key entries are appended, not
scattered over the index.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa

from trace_core.dispatcher.topology import Dependent, InputEdge
from trace_core.storage.bulk import (
    id_block,
    records_param,
    unprepared,
    uuid_array,
    wakeup_rows_sql,
)
from trace_core.storage.protocol import NewOutboxRow, TaskWakeup
from trace_core.storage.sql import SqlTransaction

__all__ = ["SetRoute", "route_in_sql", "set_based"]


def set_based(dependents: Mapping[uuid.UUID, list[tuple[Dependent, InputEdge]]]) -> bool:
    """Whether every dependent reads one input only (no join to check)."""
    return all(len(job.inputs) == 1 for deps in dependents.values() for job, _ in deps)


@dataclass(frozen=True)
class SetRoute:
    """What :func:`route_in_sql` did."""

    created: int
    """Tasks created (each with its wake-up)."""
    decisions: int
    """(event, job) pairs decided: a task created or found existing."""


# ev: the batch with each event's status and own unit (dedupe key, input
# entry, task_inputs key); docs: each event's input_versions document for each
# distinct pinned edge (:pins), built once per event, not once per task (the
# dependents of a dataset version mostly pin the same edge); j: the
# dependents with the index of their edge in :pins; cand: one row per (event,
# job) whose edge pins the event's version, with the id its task gets if
# created. ins names its arbiter: without one, every unique index
# (the primary key too) is probed before each insert. made joins on that id,
# not on the ~100-character dedupe key.
_ROUTE = sa.text(
    """
WITH ev AS (
    SELECT e.id, e.dataset_uuid, e.dataset_version, e.partition_key, e.received_at,
           CASE WHEN e.id = ANY(CAST(:not_current AS uuid[])) THEN 'not_current' ELSE 'routed'
           END AS status,
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
    FROM unnest(CAST(:ids AS uuid[])) AS s(id)
    JOIN events e ON e.id = s.id
    WHERE e.id = ANY(CAST(:ids AS uuid[]))  -- a primary-key lookup, not a join with every event
), docs AS MATERIALIZED (  -- else inlined into cand: built once per task again
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
), made AS (
    SELECT cand.* FROM cand JOIN ins ON ins.id = cand.task_id
), inputs AS (  -- tasks made just now: no inputs row can exist, so no ON CONFLICT
    INSERT INTO task_inputs (task_id, input_dataset_uuid, input_partition_key, input_version)
    SELECT task_id, dataset_uuid, input_key, received_at FROM made ORDER BY task_id
), outcome AS (
    SELECT cand.event_id, count(made.task_id) AS created,
           count(*) - count(made.task_id) AS existing,
           jsonb_object_agg(cand.job_name,
                            CASE WHEN made.task_id IS NULL THEN 'existing' ELSE 'created' END)
               AS detail
    FROM cand LEFT JOIN made ON made.task_id = cand.task_id
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
)
SELECT (SELECT count(*) FROM made), (SELECT count(*) FROM cand)
"""
)


async def route_in_sql(
    st: SqlTransaction,
    event_ids: Collection[uuid.UUID],
    not_current: Iterable[uuid.UUID],
    jobs: Sequence[tuple[Dependent, float]],
    *,
    now: datetime,
    wakeup: TaskWakeup,
) -> SetRoute:
    """Route the events ``event_ids`` to ``jobs`` (single-input dependents, each
    with its tier's handicap in seconds); they become ``routed``, except those
    of ``not_current`` (events of versions no live DAG version points at).

    Creates the tasks with their ``task_inputs`` rows and their wake-ups (the
    ``enqueue_task`` rows of :class:`~trace_core.storage.protocol.TaskWakeup`,
    built on the server, so no task id makes a round trip), and stores each
    event's outcome, in the caller's transaction.
    """
    pins = {edge: n for n, edge in enumerate(dict.fromkeys(job.inputs[0] for job, _ in jobs), 1)}
    rows = [
        {
            "job_id": job.job_id.hex,
            "job_name": job.job_name,
            "dataset_version": job.inputs[0].dataset_version.hex,
            "pin": pins[job.inputs[0]],
            "max_attempts": job.max_attempts,
            "queued_at": (now + timedelta(seconds=handicap)).isoformat(),
        }
        for job, handicap in jobs
    ]
    # Prepared, the statement would soon run a generic plan that is blind to
    # the batch size: it estimates one row per CTE and joins thousands by
    # nested loops. Unprepared, each batch is planned with its parameters.
    async with unprepared(st.connection):
        result = await st.connection.execute(
            _ROUTE,
            {
                "ids": uuid_array(event_ids),
                "not_current": uuid_array(not_current),
                "pins": records_param([edge.pinned for edge in pins]),
                "jobs": records_param(rows),
                "id_prefix": id_block(),
                "now": now,
                "wake_kind": wakeup.outbox_kind,
                "wake_chunk": wakeup.chunk,
                "wake_attempts": NewOutboxRow.max_attempts,
            },
        )
    created, decisions = result.one()
    if created:
        st.channels.update(wakeup.channels)
    return SetRoute(int(created), int(decisions))
