"""``job_states``: the one per-job row every Dispatcher service writes.

Helpers shared by the services that keep per-job state there (sources, cron,
the manual trigger, the idle scaler, the concurrency gate, backpressure):
creating the row on first use, locking rows, the upsert with an optional
compare-and-set, and :class:`RaceLost` for a compare-and-set that lost.

**Lock order (Postgres).** A transaction that locks several ``job_states``
rows takes them in job id order (:func:`by_job_id`), and ``job_states`` rows
before task rows, as the concurrency gate and the backpressure monitor do; so
none of them deadlock. SQLite has a single writer and needs no row locks.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from trace_core.storage import schema
from trace_core.storage.sql import SqlTransaction

__all__ = [
    "RaceLost",
    "by_job_id",
    "ensure_job_states",
    "lock_job_states",
    "read_pause",
    "same_as",
    "upsert_job_state",
]


class RaceLost(Exception):
    """Raised inside a transaction whose compare-and-set on ``job_states`` lost
    to another Dispatcher: the caller rolls back and does nothing."""


def by_job_id(job_ids: Iterable[uuid.UUID]) -> list[uuid.UUID]:
    """``job_ids`` deduplicated, in the lock order (Postgres ``uuid`` order)."""
    return sorted(set(job_ids), key=lambda j: j.int)


async def ensure_job_states(
    st: SqlTransaction, job_ids: Iterable[uuid.UUID], *, now: datetime
) -> None:
    """Create the missing ``job_states`` rows (defaults) for ``job_ids``."""
    ordered = by_job_id(job_ids)
    if not ordered:
        return
    stmt = st.insert(schema.job_states).on_conflict_do_nothing()
    await st.connection.execute(stmt, [{"job_id": j, "updated_at": now} for j in ordered])


async def lock_job_states(st: SqlTransaction, job_ids: Iterable[uuid.UUID]) -> None:
    """Lock the existing ``job_states`` rows of ``job_ids`` until commit, in
    lock order (Postgres; SQLite's single writer needs no row locks)."""
    ordered = by_job_id(job_ids)
    if not ordered or st.engine_name != "postgres":
        return
    s = schema.job_states
    # FOR UPDATE above ORDER BY takes the locks in the sorted order.
    await st.connection.execute(
        sa.select(s.c.job_id).where(s.c.job_id.in_(ordered)).order_by(s.c.job_id).with_for_update()
    )


async def upsert_job_state(
    st: SqlTransaction,
    job_id: uuid.UUID,
    values: Mapping[str, Any],
    *,
    now: datetime,
    where: Sequence[sa.ColumnElement[bool]] = (),
) -> bool:
    """Set ``values`` on the job's ``job_states`` row, creating it first.

    ``where`` makes the update a compare-and-set (False when it matched
    nothing). The update also locks the row until commit, which serializes
    services deciding about the same job (on Postgres; SQLite has one writer).
    """
    await ensure_job_states(st, [job_id], now=now)
    s = schema.job_states
    result = await st.connection.execute(
        sa.update(s).where(s.c.job_id == job_id, *where).values({**values, "updated_at": now})
    )
    return bool(result.rowcount)


def same_as(column: sa.ColumnElement[Any], value: object) -> sa.ColumnElement[bool]:
    """``column = value``, or ``column IS NULL`` for ``None`` (compare-and-set guards)."""
    return column.is_(None) if value is None else column == value


async def read_pause(conn: AsyncConnection, job_id: uuid.UUID) -> tuple[bool, str | None]:
    """Whether the job is paused (backpressure or by hand) and why; not paused
    when it has no ``job_states`` row yet."""
    s = schema.job_states
    row = (
        await conn.execute(sa.select(s.c.paused, s.c.pause_reason).where(s.c.job_id == job_id))
    ).first()
    return (False, None) if row is None else (bool(row[0]), row[1])
