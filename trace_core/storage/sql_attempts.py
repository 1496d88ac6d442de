"""The attempts area (:mod:`trace_core.storage.ports.attempts`) in SQL, for both engines.

Besides the port's reads and guarded writes, this module holds what the
ownership protocol (:class:`~trace_core.storage.sql.SqlTransaction`) uses to
open and close attempt rows together with the task row's change:

- on Postgres the claim and the fenced finishing writes run as ONE statement
  (a data-modifying CTE): they often run in autocommit (a ``statement()``
  scope), where a second statement would not be atomic with the first, and
  one statement also keeps the claim at one round trip;
- on SQLite every scope is a write transaction (``BEGIN IMMEDIATE``), so the
  attempt rows are written by a second statement in the same transaction,
  built here (:meth:`SqlAttemptOps.opening`, :meth:`SqlAttemptOps.closing`:
  the attempt ids are made by the client) and sent in the same thread hop as
  the claim's or the finishing statement.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from trace_core.model import Holder
from trace_core.storage import schema
from trace_core.storage.bulk import consecutive_ids, id_block
from trace_core.storage.ports.attempts import AttemptRecord
from trace_core.storage.sql_area import SqlArea

__all__ = [
    "SqlAttemptOps",
    "claim_opening_attempts",
    "finish_closing_attempts",
    "held_by",
    "holder_params",
]

_REOPENED = ("worker_id", "started_at", "status", "stream", "message_id", "ended_at")


def _columns() -> tuple[sa.ColumnElement[Any], ...]:
    a = schema.job_attempts
    return (
        a.c.attempt_id,
        a.c.task_id,
        a.c.attempt,
        a.c.worker_id,
        a.c.stream,
        a.c.message_id,
        a.c.status,
        a.c.started_at,
        a.c.ended_at,
        a.c.result,
        a.c.error,
    )


def _upsert(insert: Any) -> Any:
    """Open, or reopen, the row of ``(task_id, attempt)``.

    A task's attempt numbers grow with every claim, so a conflict means a
    claim that gave an attempt back (it spent none) and claims it again: the
    row describes the new execution, with a new ``attempt_id``.
    """
    a = schema.job_attempts
    fresh = {name: insert.excluded[name] for name in ("attempt_id", *_REOPENED)}
    fresh |= {"result": None, "error": None}
    return insert.on_conflict_do_update(index_elements=[a.c.task_id, a.c.attempt], set_=fresh)


@functools.cache
def claim_opening_attempts(claim: sa.Update | sa.Insert, *, fresh: bool = False) -> sa.Select[Any]:
    """Postgres: ``claim`` (a tasks claim ``UPDATE … RETURNING id, attempt, …``, or
    the insert of a task already claimed: :mod:`~trace_core.storage.sql_handoff`)
    that also opens each claimed attempt's row, in one statement; its rows are
    the claim's columns followed by the new ``attempt_id``. ``fresh``: the
    claimed tasks are new (inserted by ``claim``), so their rows are inserted
    plainly instead of upserted (no speculative insertion).

    Uses the claim's ``b_worker_id`` and ``now`` parameters.
    """
    a = schema.job_attempts
    claimed = claim.cte("claimed")
    opened_rows = sa.select(
        sa.func.gen_random_uuid(),
        claimed.c.id,
        claimed.c.attempt,
        sa.bindparam("b_worker_id", type_=sa.Text()),
        sa.bindparam("now", type_=a.c.started_at.type),
        sa.literal("Running", sa.Text()),
    )
    insert = postgresql.insert(a).from_select(
        ["attempt_id", "task_id", "attempt", "worker_id", "started_at", "status"], opened_rows
    )
    opening = insert if fresh else _upsert(insert)
    opened = opening.returning(a.c.attempt_id, a.c.task_id).cte("opened")
    return sa.select(*claimed.c, opened.c.attempt_id).select_from(
        claimed.outerjoin(opened, opened.c.task_id == claimed.c.id)
    )


@functools.cache
def _setting_transport() -> sa.Update:
    """Note the delivering message on a running attempt (one cached statement:
    every stream claim runs it, on the driver directly on Postgres)."""
    a = schema.job_attempts
    return (
        sa.update(a)
        .where(
            a.c.task_id == sa.bindparam("t_task", type_=a.c.task_id.type),
            a.c.attempt == sa.bindparam("t_attempt", type_=sa.Integer()),
            a.c.status == "Running",
        )
        .values(
            stream=sa.bindparam("t_stream", type_=sa.Text()),
            message_id=sa.bindparam("t_message", type_=sa.Text()),
        )
        .returning(a.c.attempt_id)
    )


@functools.cache
def _by_id() -> sa.Select[Any]:
    """One attempt record by its id (cached: every v1 report naming its
    attempt by id reads it, on the driver directly on Postgres)."""
    a = schema.job_attempts
    return sa.select(*_columns()).where(
        a.c.attempt_id == sa.bindparam("f_attempt_id", type_=a.c.attempt_id.type)
    )


@functools.cache
def _by_number() -> sa.Select[Any]:
    """One attempt record by task and number (cached: every v1 heartbeat and
    report reads it, on the driver directly on Postgres)."""
    a = schema.job_attempts
    return sa.select(*_columns()).where(
        a.c.task_id == sa.bindparam("f_task", type_=a.c.task_id.type),
        a.c.attempt == sa.bindparam("f_attempt", type_=sa.Integer()),
    )


@functools.cache
def held_by(write: sa.Update) -> sa.Update:
    """``write`` (a cached fenced write of one task: :meth:`LeaseStatements.fence
    <trace_core.storage.sql_leasing.LeaseStatements.fence>`'s parameters) that
    also requires what a :class:`~trace_core.model.Holder` says: no record of
    the fenced attempt names another worker than ``h_worker`` or, with
    ``h_stream`` given, another stream message than ``h_stream``/``h_message``
    (a record naming none is not checked, nor is an attempt without a record:
    as the v1 routes check them by reading the record first)."""
    a, t = schema.job_attempts, schema.tasks
    worker = sa.bindparam("h_worker", type_=sa.Text())
    stream = sa.bindparam("h_stream", type_=sa.Text())
    message = sa.bindparam("h_message", type_=sa.Text())
    contradicts = sa.exists().where(
        a.c.task_id == t.c.id,
        a.c.attempt == sa.bindparam("f_attempt", type_=sa.Integer()),
        sa.or_(
            a.c.worker_id != worker,
            sa.and_(
                stream.is_not(None),
                a.c.stream.is_not(None),
                a.c.message_id.is_not(None),
                sa.or_(a.c.stream != stream, a.c.message_id != sa.func.coalesce(message, "")),
            ),
        ),
    )
    return write.where(~contradicts)


def holder_params(holder: Holder) -> dict[str, Any]:
    """The parameters :func:`held_by` adds."""
    return {"h_worker": holder.worker_id, "h_stream": holder.stream, "h_message": holder.message_id}


def _closing_values() -> dict[str, Any]:
    a = schema.job_attempts
    return {
        "status": sa.bindparam("a_status", type_=sa.Text()),
        "ended_at": sa.bindparam("a_now", type_=a.c.ended_at.type),
        "error": sa.func.coalesce(sa.bindparam("a_error", type_=a.c.error.type), a.c.error),
        "result": sa.func.coalesce(sa.bindparam("a_result", type_=a.c.result.type), a.c.result),
    }


def finish_closing_attempts(finish: sa.Update) -> sa.Select[Any]:
    """Postgres: a fenced finishing ``UPDATE`` of tasks (with its ``RETURNING``)
    that also closes the attempts it ended, in one statement; its rows are
    those ``finish`` returns.

    Parameters: ``a_status`` (the attempts' final status), ``a_now`` (their end),
    ``a_error`` and ``a_result`` (their error and result documents, or ``None``
    to keep the ones they have). Not cached here: callers cache it when ``finish`` is cached.
    """
    a, t = schema.job_attempts, schema.tasks
    fin = finish.returning(t.c.id.label("f_id"), t.c.attempt.label("f_attempt")).cte("fin")
    closed = (
        sa.update(a)
        .where(a.c.task_id == fin.c.f_id, a.c.attempt == fin.c.f_attempt)
        .values(_closing_values())
        .returning(a.c.attempt_id)
        .cte("closed")
    )
    kept = [col for col in fin.c if col.key not in ("f_id", "f_attempt")]
    return sa.select(*kept).add_cte(closed)


def closing_params(
    status: str,
    now: datetime,
    error: Mapping[str, Any] | None,
    result: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The parameters of :func:`finish_closing_attempts` and of :meth:`SqlAttemptOps.close`."""
    return {
        "a_status": status,
        "a_now": now,
        "a_error": dict(error) if error else None,
        "a_result": None if result is None else dict(result),
    }


def _pairs(pairs: Sequence[tuple[uuid.UUID, int]]) -> str:
    """SQLite: ``(task_id, attempt)`` pairs as one JSON array of strings, each
    the attempt in 10 digits, then the task id's 32 hex digits (how the Uuid
    column stores it): fixed fields that ``substr`` cuts out."""
    return json.dumps([f"{attempt:010d}{task_id.hex}" for task_id, attempt in pairs])


_PAIR_TASK = "substr(f.value, 11)"
_PAIR_ATTEMPT = "CAST(substr(f.value, 1, 10) AS INTEGER)"


@functools.cache
def _opening_pairs(fresh: bool) -> sa.TextClause:
    """SQLite: open (``fresh``: insert; else open or reopen, as
    :func:`_upsert`) the rows of the pairs of ``k_pairs`` (:func:`_pairs`),
    the n-th (from 1) with the id ``id_prefix`` followed by n in 8 hex digits,
    which is what :func:`~trace_core.storage.bulk.consecutive_ids` makes."""
    reopen = ", ".join(f"{name} = excluded.{name}" for name in ("attempt_id", *_REOPENED))
    conflict = (
        ""
        if fresh
        else f"\nON CONFLICT (task_id, attempt) DO UPDATE SET {reopen}, result = NULL, error = NULL"
    )
    a = schema.job_attempts
    sql = f"""INSERT INTO job_attempts (attempt_id, task_id, attempt, worker_id, status, started_at)
SELECT :id_prefix || printf('%08x', f.key + 1), {_PAIR_TASK}, {_PAIR_ATTEMPT},
       :worker_id, 'Running', :now
FROM json_each(:k_pairs) AS f WHERE true{conflict}"""
    return sa.text(sql).bindparams(sa.bindparam("now", type_=a.c.started_at.type))


@functools.cache
def _closing_each() -> sa.Update:
    """Close the row of one ``(k_task, k_attempt)`` (sent once per row)."""
    a = schema.job_attempts
    return (
        sa.update(a)
        .where(
            a.c.task_id == sa.bindparam("k_task", type_=a.c.task_id.type),
            a.c.attempt == sa.bindparam("k_attempt", type_=sa.Integer()),
        )
        .values(_closing_values())
    )


@functools.cache
def _closing_pairs() -> sa.Update:
    """SQLite: close the rows of every pair of ``k_pairs`` (:func:`_pairs`),
    found through the ``(task_id, attempt)`` index."""
    a = schema.job_attempts
    keys = sa.text(
        f"SELECT {_PAIR_TASK} AS task_id, {_PAIR_ATTEMPT} AS attempt FROM json_each(:k_pairs) AS f"
    )
    pairs = keys.columns(sa.column("task_id"), sa.column("attempt")).subquery()
    return (
        sa.update(a)
        .where(sa.tuple_(a.c.task_id, a.c.attempt).in_(sa.select(pairs.c.task_id, pairs.c.attempt)))
        .values(_closing_values())
    )


class SqlAttemptOps(SqlArea):
    """:class:`~trace_core.storage.ports.attempts.AttemptOps` on a SQL transaction,
    plus the opening and closing the ownership protocol calls on SQLite."""

    async def of_tasks(
        self, task_ids: Collection[uuid.UUID]
    ) -> dict[uuid.UUID, list[AttemptRecord]]:
        if not task_ids:
            return {}
        a = schema.job_attempts
        stmt = (
            sa.select(*_columns())
            .where(a.c.task_id.in_(list(task_ids)))
            .order_by(a.c.task_id, a.c.attempt)
        )
        found: dict[uuid.UUID, list[AttemptRecord]] = {}
        for row in await self._rows("attempts of tasks", stmt):
            found.setdefault(row[1], []).append(AttemptRecord(*row))
        return found

    async def find(self, attempt_id: uuid.UUID) -> AttemptRecord | None:
        rows = await self._fixed_rows("attempt", _by_id(), {"f_attempt_id": attempt_id})
        return AttemptRecord(*rows[0]) if rows else None

    async def find_by_number(self, task_id: uuid.UUID, attempt: int) -> AttemptRecord | None:
        params = {"f_task": task_id, "f_attempt": attempt}
        rows = await self._fixed_rows("attempt by number", _by_number(), params)
        return AttemptRecord(*rows[0]) if rows else None

    async def set_transport_if_running(
        self, task_id: uuid.UUID, attempt: int, *, stream: str, message_id: str
    ) -> bool:
        params = {
            "t_task": task_id,
            "t_attempt": attempt,
            "t_stream": stream,
            "t_message": message_id,
        }
        return bool(await self._fixed_rows("attempt transport", _setting_transport(), params))

    async def set_result_if_ended(
        self, task_id: uuid.UUID, attempt: int, *, status: str, result: Mapping[str, Any]
    ) -> bool:
        a = schema.job_attempts
        stmt = (
            sa.update(a)
            .where(a.c.task_id == task_id, a.c.attempt == attempt, a.c.status == status)
            .values(result=dict(result))
        )
        return await self._count("attempt result", stmt) > 0

    async def set_error_if_ended(
        self,
        task_id: uuid.UUID,
        attempt: int,
        *,
        statuses: Collection[str],
        error: Mapping[str, Any],
    ) -> bool:
        a = schema.job_attempts
        stmt = (
            sa.update(a)
            .where(a.c.task_id == task_id, a.c.attempt == attempt, a.c.status.in_(list(statuses)))
            .values(error=dict(error))
        )
        return await self._count("attempt error", stmt) > 0

    # --- for the ownership protocol (not in the port) ------------------------

    def opening(
        self,
        claimed: Sequence[tuple[uuid.UUID, int]],
        *,
        worker_id: str,
        now: datetime,
        fresh: bool = False,
    ) -> tuple[sa.Executable, dict[str, Any], dict[uuid.UUID, uuid.UUID]]:
        """SQLite (Postgres opens them inside the claim: :func:`claim_opening_attempts`):
        the statement and parameters that open (or reopen) the rows of the
        claimed ``(task_id, attempt)`` pairs, and the new ``attempt_id`` of each
        task, made here: the caller sends the statement in the same step as the
        claim's (:meth:`~trace_core.storage.sql.SqlTransaction.claim`).
        ``fresh``: tasks created in this transaction (a plain insert).

        One statement for the batch (an executemany of one INSERT per row
        doubled a batch claim), its time-ordered ids made by SQLite from the
        client's id block, so that a batch's primary-key entries are appended
        to the index's right edge instead of costing a page per row."""
        prefix = id_block()
        ids = consecutive_ids(int(prefix, 16) << 32, len(claimed))
        opened = {task_id: made for (task_id, _), made in zip(claimed, ids, strict=True)}
        params = {
            "k_pairs": _pairs(claimed),
            "id_prefix": prefix,
            "worker_id": worker_id,
            "now": now,
        }
        return _opening_pairs(fresh), params, opened

    def closing(
        self,
        ended: Sequence[tuple[uuid.UUID, int]],
        *,
        status: str,
        now: datetime,
        error: Mapping[str, Any] | None = None,
        result: Mapping[str, Any] | None = None,
    ) -> tuple[sa.Executable, dict[str, Any] | list[dict[str, Any]]]:
        """The statement and parameters that close the rows of the ended
        ``(task_id, attempt)`` pairs (see :meth:`close`; ``result``, when given,
        is kept on them), for a caller that sends it in the same step as the
        statement that ended them."""
        base = closing_params(status, now, error, result)
        if self.engine_name == "sqlite":
            # One statement for the whole batch: an executemany of one UPDATE
            # per row tripled the cost of a SQLite batch completion.
            return _closing_pairs(), base | {"k_pairs": _pairs(ended)}
        params = [base | {"k_task": task_id, "k_attempt": attempt} for task_id, attempt in ended]
        return _closing_each(), params

    async def close(
        self,
        ended: Sequence[tuple[uuid.UUID, int]],
        *,
        status: str,
        now: datetime,
        error: Mapping[str, Any] | None = None,
    ) -> None:
        """Close the rows of the ended ``(task_id, attempt)`` pairs with ``status``
        (and ``error``, when given)."""
        if not ended:
            return
        stmt, params = self.closing(ended, status=status, now=now, error=error)
        await self._run("close attempts", stmt, params)

    async def close_running(
        self,
        task_ids: Collection[uuid.UUID],
        *,
        status: str,
        now: datetime,
        error: Mapping[str, Any] | None = None,
    ) -> None:
        """Close the ``Running`` attempts of ``task_ids`` (an administrative end:
        cancellation, a forced dead letter)."""
        if not task_ids:
            return
        a = schema.job_attempts
        stmt = (
            sa.update(a)
            .where(a.c.task_id.in_(list(task_ids)), a.c.status == "Running")
            .values(_closing_values())
        )
        await self._run("close running attempts", stmt, closing_params(status, now, error))
