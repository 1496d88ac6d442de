"""SQLite: set-based routing of single-input events, a few statements per batch.

The SQLite side of
:meth:`~trace_core.storage.ports.routing.RoutingOps.route_single_input_events`
(Postgres runs it as one statement of data-modifying CTEs,
:mod:`trace_core.storage.sql_routing`). SQLite has no data-modifying CTEs, so
the batch is four writes and one read in the caller's transaction, each a
join of the batch's events with its dependents done by SQLite, not a row per
task built in Python:

1. the tasks (``INSERT … SELECT … ON CONFLICT DO NOTHING``), with ids made by
   SQLite from one time-ordered block (:func:`~trace_core.storage.bulk.id_block`
   plus the candidate's ordinal), so the tasks this batch created are exactly
   the tasks whose id lies in the block: later statements find them by a
   primary-key range, and no id makes a round trip;
2. their ``task_inputs`` rows (new tasks: no conflict possible);
3. their wake-up rows (:class:`~trace_core.storage.protocol.TaskWakeup`'s
   outbox rows, ``chunk`` ids each, in id order);
4. each event's outcome (status, ``routed_at``, added counts, detail).

Every statement derives the candidates, one row per (event, job) whose pinned
version is the event's, from the same CTEs (:func:`_candidates`), and a
candidate's id from its event's and its job's places in the parameters, so it
gets the same id in each. A task's ``input_versions`` document is joined as
text from the pinned edge and the event's unit (no JSON parsed per task);
an edge naming a unit member is merged by ``json_patch`` instead (it is
``{**pinned, **unit}`` here: the unit's values are scalars). The (event, job)
pairs decided are counted per version, not per candidate.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from trace_core.storage import schema
from trace_core.storage.bulk import id_block, wakeup_params
from trace_core.storage.ports.routing import SetRoute, SingleInputJob, Wakeup
from trace_core.storage.sql_area import SqlArea

__all__ = ["route_single_input_events_sqlite"]


def _dashed(column: str) -> str:
    """SQL: a 32-hex id column as ``str(uuid.UUID)`` writes it (8-4-4-4-12)."""
    return (
        f"substr({column}, 1, 8) || '-' || substr({column}, 9, 4) || '-' || "
        f"substr({column}, 13, 4) || '-' || substr({column}, 17, 4) || '-' || "
        f"substr({column}, 21)"
    )


# ev: the batch's events with their status and own unit (dedupe key, input
# entry, task_inputs key, trigger id); j: the dependents; cand: one row per
# (event, job) whose edge pins the event's version, with the id its task gets
# if created: the block's prefix and (event's place in :ids) x jobs + (job's
# place in :jobs) + 1, the same in every statement without a sort (a window
# over the wide rows cost more than the inserts). :ids is a JSON array of
# distinct 32-hex ids, so each event is one primary-key lookup. The columns
# only the task insert reads (texts and documents built per event and per
# task) are left out of the other statements (:func:`_candidates`).
_EV = """
WITH ev AS MATERIALIZED (
    SELECT s.key AS n, e.id, e.dataset_uuid, e.dataset_version, e.received_at,
           CASE WHEN e.id IN (SELECT value FROM json_each(:not_current))
                THEN 'not_current' ELSE 'routed' END AS status,
           coalesce(e.partition_key, 'cursor:' || e.cursor) AS input_key{task_columns}
    FROM json_each(:ids) AS s JOIN events AS e ON e.id = s.value{ev_order}
), j AS MATERIALIZED (
    SELECT key AS n, json_extract(value, '$.job_name') AS job_name,
           json_extract(value, '$.dataset_version') AS dataset_version{job_columns}
    FROM json_each(:jobs)
), cand AS (
    SELECT ev.id AS event_id, ev.dataset_uuid, ev.received_at, ev.input_key, j.job_name,
           :id_prefix || printf('%08x', ev.n * :job_count + j.n + 1) AS task_id{cand_columns}
    FROM {pairs}
)
"""

_EV_TASK_COLUMNS = f""",
           e.partition_key, {_dashed("e.id")} AS trigger_id,
           CASE WHEN e.partition_key IS NOT NULL
                THEN 'partition:' || {_dashed("e.dataset_uuid")} || ':'
                     || {_dashed("e.dataset_version")} || ':' || e.partition_key
                ELSE 'cursor:' || {_dashed("e.dataset_uuid")} || ':'
                     || {_dashed("e.dataset_version")} || ':' || e.cursor
           END AS dedupe_key,
           CASE WHEN e.partition_key IS NULL THEN json_object('cursor', e.cursor)
                WHEN e.range_start IS NULL THEN json_object('partition_key', e.partition_key)
                ELSE json_object('partition_key', e.partition_key,
                                 'start', e.range_start, 'end', e.range_end)
           END AS unit"""

_JOB_TASK_COLUMNS = """,
           json_extract(value, '$.job_id') AS job_id,
           json_extract(value, '$.pinned') AS pinned,
           json_extract(value, '$.pinned_head') AS pinned_head,
           json_extract(value, '$.max_attempts') AS max_attempts,
           json_extract(value, '$.queued_at') AS queued_at"""

_CAND_TASK_COLUMNS = """,
           ev.partition_key, ev.unit, ev.dedupe_key, ev.trigger_id, j.job_id, j.pinned,
           j.pinned_head, j.max_attempts, j.queued_at"""


def _candidates(*, for_tasks: bool) -> str:
    """The candidates' CTEs; with ``for_tasks`` the columns of the task rows too."""
    if not for_tasks:
        return _EV.format(
            task_columns="",
            ev_order="",
            job_columns="",
            cand_columns="",
            pairs="ev JOIN j ON j.dataset_version = ev.dataset_version",
        )
    # The tasks in the dedupe index's order: jobs (sorted by id) outside, each
    # job's events in key order inside. Events arrive in any order, so taken
    # as they come a batch's inserts land all over that index (the one index
    # keyed by text), each touching a page another one evicted; in key order
    # each page is read and dirtied once. Only the cost changes: ids come from
    # the places in the parameters, whatever order the rows take.
    return _EV.format(
        task_columns=_EV_TASK_COLUMNS,
        ev_order="\n    ORDER BY dedupe_key",
        job_columns=_JOB_TASK_COLUMNS,
        cand_columns=_CAND_TASK_COLUMNS,
        pairs="j CROSS JOIN ev WHERE j.dataset_version = ev.dataset_version",
    )


# The tasks this batch created: the ids of its block (a primary-key range).
_MADE = "SELECT id FROM tasks WHERE id BETWEEN :id_low AND :id_high"

_NOW = sa.bindparam("now", type_=schema.tasks.c.created_at.type)

# INSERT first (the candidates as the SELECT's WITH): the driver reports the
# rows inserted only for a statement that starts as one.
_TASKS = sa.text(
    """
INSERT INTO tasks (id, job_id, dedupe_key, status, attempt, claim_version, partitions,
                   input_versions, max_attempts, created_at, queued_at)"""
    + _candidates(for_tasks=True)
    + """SELECT task_id, job_id, dedupe_key, 'Queued', 1, 0,
       CASE WHEN partition_key IS NOT NULL THEN json_array(partition_key) END,
       CASE WHEN pinned_head IS NOT NULL  -- the document as text: no JSON parsed per task
            THEN '{"inputs":[' || pinned_head || ',' || substr(unit, 2)
                 || '],"trigger_event_id":"' || trigger_id || '"}'
            ELSE json_object('inputs', json_array(json_patch(json(pinned), json(unit))),
                             'trigger_event_id', trigger_id)
       END,
       max_attempts, :now, queued_at
FROM cand WHERE true
ON CONFLICT (job_id, dedupe_key) WHERE dedupe_key IS NOT NULL DO NOTHING"""
).bindparams(_NOW)

_INPUTS = sa.text(
    _candidates(for_tasks=False)
    + """
INSERT INTO task_inputs (task_id, input_dataset_uuid, input_partition_key, input_version)
SELECT cand.task_id, cand.dataset_uuid, cand.input_key, cand.received_at
FROM cand JOIN tasks AS t ON t.id = cand.task_id"""
)

# One row per chunk of ids; the subquery is read in id order (the range scan
# of the primary key), and each chunk's array is built from its own ordered
# range, so ids keep their order inside a row as rows do across rows. An id
# is written dashed as the block's dashed prefix and its last 8 digits (one
# concatenation: cutting every id in five cost more than the rest).
_WAKE = sa.text(
    f"""
INSERT INTO outbox (kind, payload, status, available_at, attempts, claim_version,
                    max_attempts, created_at)
SELECT :wake_kind,
       json_object('task_ids', (SELECT json_group_array(:block_dashed || substr(w.id, 25))
                                FROM (SELECT id FROM tasks
                                      WHERE id BETWEEN c.low AND c.high ORDER BY id) AS w)),
       'Pending', :now, 0, 0, :wake_attempts, :now
FROM (SELECT min(id) AS low, max(id) AS high
      FROM (SELECT id, (row_number() OVER (ORDER BY id) - 1) / :wake_chunk AS chunk
            FROM ({_MADE}))
      GROUP BY chunk) AS c
WHERE :wake_kind IS NOT NULL
ORDER BY c.low"""
).bindparams(_NOW)

# Every event of the batch gets its status; one without candidates (no
# dependent pins its version) adds nothing and has no detail, as on Postgres.
_OUTCOMES = sa.text(
    _candidates(for_tasks=False)
    + """, outcome AS (
    SELECT cand.event_id, count(t.id) AS created, count(*) - count(t.id) AS existing,
           json_group_object(cand.job_name,
                             CASE WHEN t.id IS NULL THEN 'existing' ELSE 'created' END)
               AS detail
    FROM cand LEFT JOIN tasks AS t ON t.id = cand.task_id
    GROUP BY cand.event_id
), decided AS (
    SELECT ev.id, ev.status, outcome.created, outcome.existing, outcome.detail
    FROM ev LEFT JOIN outcome ON outcome.event_id = ev.id
)
UPDATE events SET route_status = decided.status,
                  routed_at = :now,
                  tasks_created = events.tasks_created + coalesce(decided.created, 0),
                  tasks_existing = events.tasks_existing + coalesce(decided.existing, 0),
                  route_detail = decided.detail
FROM decided WHERE events.id = decided.id"""
).bindparams(_NOW)

# The batch's events per version: times the jobs pinning each version, the
# (event, job) pairs decided.
_PER_VERSION = sa.text(
    """
SELECT e.dataset_version, count(*)
FROM json_each(:ids) AS s JOIN events AS e ON e.id = s.value
GROUP BY e.dataset_version"""
)


def _stored_time(value: datetime) -> str:
    """``value`` as the SQLite columns store it (naive UTC, the dialect's
    fixed-width text), for times that travel inside a JSON parameter."""
    return value.astimezone(UTC).replace(tzinfo=None).strftime("%Y-%m-%d %H:%M:%S.%f")


_UNIT_KEYS = frozenset({"cursor", "partition_key", "start", "end"})


def _pinned_head(pinned: Mapping[str, Any]) -> str | None:
    """The pinned edge's JSON object without its closing brace, for a task's
    input entry made by joining texts (the edge, then the unit's members);
    ``None`` when that would not be ``{**pinned, **unit}`` (an empty edge, or
    one naming a unit member, which the unit replaces), so SQLite merges it."""
    if not pinned or not _UNIT_KEYS.isdisjoint(pinned):
        return None
    return json.dumps(dict(pinned), separators=(",", ":"))[:-1]


async def route_single_input_events_sqlite(
    area: SqlArea,
    event_ids: Collection[uuid.UUID],
    not_current: Collection[uuid.UUID],
    jobs: Sequence[SingleInputJob],
    *,
    now: datetime,
    wakeup: Wakeup,
) -> SetRoute:
    """:meth:`~trace_core.storage.ports.routing.RoutingOps.route_single_input_events`
    on SQLite, in the transaction of ``area`` (see the module docstring).
    The caller notifies ``wakeup``'s channels when tasks were created."""
    prefix = id_block()
    params: dict[str, Any] = {
        "ids": json.dumps([i.hex for i in dict.fromkeys(event_ids)]),
        "not_current": json.dumps([i.hex for i in not_current]),
        "jobs": json.dumps(
            [
                {
                    "job_id": job.job_id.hex,
                    "job_name": job.job_name,
                    "dataset_version": job.dataset_version.hex,
                    "pinned": json.dumps(dict(job.pinned)),
                    "pinned_head": _pinned_head(job.pinned),
                    "max_attempts": job.max_attempts,
                    "queued_at": _stored_time(job.queued_at),
                }
                for job in sorted(jobs, key=lambda job: job.job_id.hex)
            ]
        ),
        "job_count": len(jobs),
        "id_prefix": prefix,
        "id_low": prefix + "00000000",
        "id_high": prefix + "ffffffff",
        "block_dashed": str(uuid.UUID(prefix + "00000000"))[:-8],
        **wakeup_params(wakeup, now),
    }
    created = (await area._run("route events: tasks", _TASKS, params)).rowcount
    if created:
        await area._run("route events: task inputs", _INPUTS, params)
        await area._run("route events: wake-ups", _WAKE, params)
    await area._run("route events: outcomes", _OUTCOMES, params)
    readers = Counter(job.dataset_version.hex for job in jobs)
    per_version = await area._rows("route events: decisions", _PER_VERSION, params)
    decisions = sum(readers[version] * int(n) for version, n in per_version)
    return SetRoute(int(created), decisions)
