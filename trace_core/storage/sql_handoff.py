"""A task created already claimed (the one-commit hand-off), for both engines.

:meth:`~trace_core.tasks.TaskQueue.create` hands a new task straight to a
consumer of this process that waits for work
(:meth:`~trace_core.tasks.TaskQueue.claim_wait`): one statement inserts the
row as the claim would leave it, so the enqueue's commit is also the claim's.
The row is what a claim of a ``Queued`` task makes of it: ``Running``, the
claimant's ``worker_id``, a fresh random ``lease_token``, ``claim_version``
1, the first attempt (``attempt`` 1, kept by a first claim), ``started_at``
and ``last_heartbeat`` at ``now``, the lease expiry from the same ``now``.
The caller runs it through the claim's own path, which opens the attempt's
``job_attempts`` row with it (one statement on Postgres, the same thread hop
on SQLite). No wake-up is written: a claimed task has nobody to wake.

The insert happens only if no ``Queued`` task would be claimed before it
(``queued_at`` no later than its own): a hand-off never jumps the queue. It
returns no row then, nor for a dedupe key that already has a task; the
caller creates the task the normal way. The task's insert has ``ON CONFLICT
DO NOTHING`` only when it has a dedupe key; its attempt row, new as the task,
is a plain insert.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from trace_core.errors import ConfigurationError
from trace_core.model import TASKS
from trace_core.storage import schema
from trace_core.storage.protocol import NewTask
from trace_core.storage.queue_tables import QUEUE_TABLES
from trace_core.storage.sql_leasing import random_token, returned_by_claim, status_in

__all__ = ["handoff_insert"]

# The task's own values, bound per call (prefixed: an INSERT reserves column names).
_GIVEN = (
    "id",
    "job_id",
    "dedupe_key",
    "partitions",
    "input_versions",
    "max_attempts",
    "created_at",
    "queued_at",
)


@functools.cache
def _insert(engine_name: str, keyed: bool) -> sa.Insert:
    t = schema.tasks
    qt = QUEUE_TABLES[TASKS.name]

    def given(name: str) -> sa.ColumnElement[Any]:
        param = sa.bindparam(f"h_{name}", type_=t.c[name].type)
        # Postgres types a SELECT list's parameters only from a cast.
        return sa.cast(param, t.c[name].type) if engine_name == "postgres" else param

    now = sa.bindparam("now", type_=t.c.started_at.type)
    claimed: dict[str, sa.ColumnElement[Any]] = {
        "status": sa.literal_column(f"'{TASKS.claimed}'", sa.Text()),
        "attempt": sa.literal(1, sa.Integer()),
        "claim_version": sa.literal(1, sa.BigInteger()),
        "worker_id": sa.bindparam("b_worker_id", type_=sa.Text()),
        "lease_token": random_token(engine_name),
        "lease_expires_at": sa.bindparam("expires_at", type_=t.c.lease_expires_at.type),
        "last_heartbeat": now,
        "started_at": now,
    }
    older = sa.select(sa.literal(1)).where(
        status_in(t.c.status, TASKS.ready), t.c.queued_at <= given("queued_at")
    )
    values = sa.select(*(given(n) for n in _GIVEN), *claimed.values()).where(~sa.exists(older))
    dialect = postgresql if engine_name == "postgres" else sqlite
    insert = dialect.insert(t).from_select([*_GIVEN, *claimed], values)
    if keyed:
        # The key may have its task already: no row then. A keyless task's
        # only unique column is its fresh random id, so it needs no
        # speculative insertion (ON CONFLICT costs index probes and WAL).
        insert = insert.on_conflict_do_nothing()
    stmt: sa.Insert = insert.returning(*returned_by_claim(qt))
    return stmt


def handoff_insert(
    engine_name: str, tasks: Sequence[NewTask], *, now: datetime, expires_at: datetime
) -> tuple[sa.Insert, dict[str, Any]]:
    """The insert of ``tasks`` (one task) already claimed, and its parameters
    but the claimant's (``b_worker_id``); rows as a claim's statement returns them."""
    if len(tasks) != 1:
        raise ConfigurationError(f"a hand-off creates one task, got {len(tasks)}")
    task = tasks[0]
    params: dict[str, Any] = {
        "h_id": uuid.uuid4(),
        "h_job_id": task.job_id,
        "h_dedupe_key": task.dedupe_key,
        "h_partitions": list(task.partitions) if task.partitions is not None else None,
        "h_input_versions": dict(task.input_versions) if task.input_versions is not None else None,
        "h_max_attempts": task.max_attempts,
        "h_created_at": now,
        "h_queued_at": now + timedelta(seconds=task.handicap_seconds),
        "now": now,
        "expires_at": expires_at,
    }
    return _insert(engine_name, task.dedupe_key is not None), params
