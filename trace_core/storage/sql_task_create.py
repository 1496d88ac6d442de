"""Postgres: a batch of new tasks, their wake-up rows and the notify in ONE statement.

:meth:`~trace_core.storage.sql.SqlTransaction.create_tasks` sends any number
of tasks as one statement with a handful of parameters, each a whole column:

- ids are made on the server from one time-ordered block
  (:func:`~trace_core.storage.bulk.id_block` plus the row's ordinal), so no id
  travels and the batch's primary-key entries are appended to the index, not
  scattered over it; the client computes the same ids by integer arithmetic;
- a batch's tasks mostly share their job, attempts and claim-order delay:
  those travel once per distinct combination (a "kind": three short array
  literals), and each task sends only its kind's ordinal (one ``join`` of
  small integers), so neither the client formats nor the server parses a
  UUID and a timestamp per task;
- dedupe keys are one JSON array (quoting done by the C encoder), or NULL
  when no task has one; partitions and pinned inputs one JSON array of
  records, or NULL when no task has any (the common case sends nothing).

The server unpacks the columns side by side (``ROWS FROM … WITH
ORDINALITY``), inserts in input order (``ON CONFLICT DO NOTHING``: a dedupe
key that is taken, by another task or by an earlier row of the same batch,
inserts nothing), writes the wake-up rows of the inserted tasks
(:func:`~trace_core.storage.bulk.wakeup_rows_sql`) and notifies, then
answers one row: how many tasks were inserted, and the ordinals of the rows
that were not (NULL when all were), so the common case fetches no ids at all.

A batch without dedupe keys, whose rows are all new, takes a lighter form:
one plain ``INSERT`` of every row, with the wake-up rows, the notify and the
answer read from the input rather than from the inserted rows. A batch
whose dedupe keys are distinct, sent after a batch whose rows were all
inserted, is first tried in that form too, without the speculative insertion
of ``ON CONFLICT`` or the sort into input order. A key taken after all fails
that statement whole (it runs in autocommit, so nothing of it stays) and the
form above runs instead; a stream of batches that repeat keys stops trying
until one inserts every row.
Measured by ``benchmarks.enqueue`` (the ``postgres-enqueue`` pair of
``benchmarks.compare``).
"""

from __future__ import annotations

import functools
import json
import operator
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from trace_core.storage import schema
from trace_core.storage.bulk import (
    consecutive_ids,
    id_block,
    records_param,
    wakeup_params,
    wakeup_rows_sql,
)
from trace_core.storage.protocol import NewTask, TaskWakeup

__all__ = ["NewTaskBatch", "create_tasks_statement", "new_task_batch"]

_INPUT = """kinds AS (
    SELECT k.job_id, k.max_attempts, k.queued_at, k.kind
    FROM ROWS FROM (
        unnest(CAST(:job_ids AS uuid[])),
        unnest(CAST(:max_attempts AS integer[])),
        unnest(CAST(:queued_at AS timestamptz[]))
    ) WITH ORDINALITY AS k(job_id, max_attempts, queued_at, kind)
),
input AS (
    SELECT CAST(:id_prefix || lpad(to_hex(r.n), 8, '0') AS uuid) AS id, r.n, k.job_id,
           r.dedupe_key, k.max_attempts, k.queued_at, r.extra
    FROM ROWS FROM (
        unnest(CAST(:kinds AS integer[])),
        jsonb_array_elements_text(CAST(:dedupe_keys AS jsonb)),
        jsonb_array_elements(CAST(:extras AS jsonb))
    ) WITH ORDINALITY AS r(kind, dedupe_key, extra, n)
    JOIN kinds AS k USING (kind)
)"""

_INSERT = """INSERT INTO tasks (id, job_id, dedupe_key, status, attempt, claim_version,
                       partitions, input_versions, max_attempts, created_at, queued_at)
    SELECT id, job_id, dedupe_key, 'Queued', 1, 0,
           CASE WHEN jsonb_typeof(extra -> 'partitions') = 'array'
                THEN ARRAY(SELECT jsonb_array_elements_text(extra -> 'partitions')) END,
           NULLIF(extra -> 'input_versions', 'null'::jsonb), max_attempts, :now, queued_at
    FROM input{where}"""

# Tasks without a dedupe key cannot conflict (their ids are new): a plain
# INSERT, in any order, which spares each row the speculative insertion of ON
# CONFLICT (a third of the insert's server time). Tasks with one go in input
# order, so of two rows of one batch with the same key the first is inserted
# (as on SQLite), and a key that is taken inserts nothing. The dedupe index
# is the only arbiter: the new ids need no probe of the primary key first.
_INSERTS = (
    "plain AS (" + _INSERT.format(where="\n    WHERE dedupe_key IS NULL") + "\n    RETURNING id)",
    "keyed AS ("
    + _INSERT.format(where="\n    WHERE dedupe_key IS NOT NULL")
    + "\n    ORDER BY n\n    ON CONFLICT (job_id, dedupe_key) WHERE dedupe_key IS NOT NULL"
    + "\n    DO NOTHING RETURNING id)",
    "ins AS (SELECT id FROM plain UNION ALL SELECT id FROM keyed)",
)

# The form for a batch whose rows are all new: every row in one plain INSERT,
# and the wake-up rows, the notify and the answer read the input, not the
# inserted rows (no RETURNING to collect). A batch without dedupe keys is one
# (its ids are new); a batch of distinct keys is tried as one, and a key that
# is taken after all makes the statement fail on the dedupe index (nothing of
# it stays) so that the caller runs the ON CONFLICT form above instead.
# Spared per row: the RETURNING, and for keys the speculative insertion and
# the sort into input order.
_ALL_NEW = ("ins AS (" + _INSERT.format(where="") + ")",)

# The ordinals of rows not inserted, looked for only when some were not.
_ANSWER = """SELECT (SELECT count(*) FROM ins) AS created, {notified} AS notified,
       CASE WHEN (SELECT count(*) FROM ins) < (SELECT count(*) FROM input)
            THEN ARRAY(SELECT n FROM input WHERE id NOT IN (SELECT id FROM ins) ORDER BY n)
       END AS missing"""

_ANSWER_ALL_NEW = """SELECT (SELECT count(*) FROM input) AS created, {notified} AS notified,
       CAST(NULL AS bigint[]) AS missing"""


@functools.cache
def create_tasks_statement(wakeup: TaskWakeup | None, *, all_new: bool = False) -> sa.TextClause:
    """The statement for tasks announced as ``wakeup`` says (built once per
    wake-up: the direct path compiles it once). Its parameters are
    :attr:`NewTaskBatch.params`; it answers ``(created, notified, missing)``.
    ``all_new``: the form for rows that are all new, which fails on a taken
    dedupe key (see :data:`_ALL_NEW`)."""
    ctes = [_INPUT, *(_ALL_NEW if all_new else _INSERTS)]
    made = "input" if all_new else "ins"
    binds = [
        sa.bindparam("now", type_=schema.tasks.c.created_at.type),
    ]
    if wakeup is not None and wakeup.outbox_kind is not None:
        ctes.append(f"wake AS ({wakeup_rows_sql(made, 'id')})")
    notified = "0"
    if wakeup is not None and wakeup.channels:
        # Channel names are the code's constants, bound as literals all the same.
        names = [f"ch{i}" for i in range(len(wakeup.channels))]
        calls = ", ".join(f"pg_notify(:{name}, '')" for name in names)
        ctes.append(f"note AS (SELECT {calls} WHERE EXISTS (SELECT 1 FROM {made}))")
        binds += [
            sa.bindparam(name, value=channel)
            for name, channel in zip(names, sorted(wakeup.channels), strict=True)
        ]
        notified = "(SELECT count(*) FROM note)"
    answer = _ANSWER_ALL_NEW if all_new else _ANSWER
    sql = "WITH " + ",\n".join(ctes) + "\n" + answer.format(notified=notified)
    return sa.text(sql).bindparams(*binds)


@dataclass(frozen=True)
class NewTaskBatch:
    """One batch as :func:`create_tasks_statement` takes it."""

    ids: list[uuid.UUID]
    """The id each task gets if it is inserted, in input order."""
    keys: Sequence[str | None]
    """The tasks' dedupe keys, in input order."""
    params: dict[str, Any]


def _array(values: Iterable[str]) -> str:
    """A Postgres array literal of values that need no quoting (hex ids,
    integers, ISO timestamps)."""
    return "{" + ",".join(values) + "}"


_COLUMNS = operator.attrgetter("dedupe_key", "partitions", "input_versions")
# A job id's integer, not the UUID: a UUID hashes in Python, an int in C.
_KIND = operator.attrgetter("job_id.int", "max_attempts", "handicap_seconds")


def new_task_batch(
    tasks: Sequence[NewTask], *, now: datetime, wakeup: TaskWakeup | None
) -> NewTaskBatch:
    """The ids and parameters of ``tasks`` created at ``now``."""
    count = len(tasks)
    prefix = id_block()
    # Ordinals start at 1 (WITH ORDINALITY); the server appends them in hex.
    ids = consecutive_ids(int(prefix, 16) << 32, count)
    # The batch as columns, and each column encoded, by loops that run in C
    # (attrgetter, zip, map, join, count): per task, Python costs more than
    # the server's insert.
    columns = list(zip(*map(_COLUMNS, tasks), strict=True)) or [()] * 3
    keys, partitions, pinned = columns
    per_task = list(map(_KIND, tasks))
    kinds = {kind: str(n) for n, kind in enumerate(dict.fromkeys(per_task), start=1)}
    has_extras = partitions.count(None) < count or pinned.count(None) < count
    params: dict[str, Any] = {
        "id_prefix": prefix,
        "kinds": _array(map(kinds.__getitem__, per_task)),
        "job_ids": _array(f"{job:032x}" for job, _, _ in kinds),
        "max_attempts": _array(str(attempts) for _, attempts, _ in kinds),
        "queued_at": _array((now + timedelta(seconds=h)).isoformat() for _, _, h in kinds),
        "dedupe_keys": json.dumps(keys) if keys.count(None) < count else None,
        "extras": (
            records_param(
                [
                    {"partitions": None if p is None else list(p), "input_versions": v}
                    for p, v in zip(partitions, pinned, strict=True)
                ]
            )
            if has_extras
            else None
        ),
        "now": now,
    }
    if wakeup is not None and wakeup.outbox_kind is not None:
        params |= wakeup_params(wakeup, now)
    return NewTaskBatch(ids, keys, params)
