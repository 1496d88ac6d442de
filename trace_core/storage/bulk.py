"""Bulk writes on Postgres: many rows as ONE statement with ONE parameter.

A multi-row ``VALUES`` page or an ``executemany`` costs Python per row and
per parameter (psycopg re-parses every large statement text: it only caches
statements under 4 KB), which made routing client-bound. Here the rows travel
as one JSON document, unpacked on the server by ``jsonb_to_recordset`` with a
typed column list, so the statement text is small, constant and cached, and
the per-row work happens in C on both sides. SQLite keeps ``executemany``
(in-process, it has no round trips to save).
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import AsyncConnection

from trace_core.storage.ports.routing import Wakeup
from trace_core.storage.protocol import NewOutboxRow

__all__ = [
    "bulk_insert",
    "id_block",
    "json_records",
    "records_param",
    "unprepared",
    "uuid_array",
    "wakeup_params",
    "wakeup_rows_sql",
]


def _default(value: object) -> object:
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError("naive datetime given for a UTC timestamp column")
        return value.isoformat()
    raise TypeError(f"cannot send {type(value).__name__} in a bulk row")


def records_param(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows as the JSON text a :func:`json_records` parameter expects.

    UUIDs and aware datetimes are converted; callers on a hot path pass them
    preformatted (``uuid.hex``, ``isoformat()``) to skip the per-value hook.
    """
    return json.dumps(list(rows), default=_default, separators=(",", ":"))


def uuid_array(ids: Iterable[uuid.UUID]) -> str:
    """``ids`` as a Postgres array literal, for a ``CAST(:param AS uuid[])`` parameter.

    psycopg dumps a list parameter in Python, element by element (a regex
    each, to decide on quoting): a few milliseconds per batch of event ids.
    Hex UUIDs need no quoting, so one join builds the same literal.
    """
    return "{" + ",".join(i.hex for i in ids) + "}"


def json_records(
    columns: Sequence[sa.Column[Any]], *, param: str = "rows", name: str = "r"
) -> sa.TableValuedAlias:
    """``jsonb_to_recordset(CAST(:param AS JSONB)) AS name(col type, …)``.

    ``columns`` are table columns whose names and types the records take; the
    parameter is bound with :func:`records_param`.
    """
    recordset = sa.func.jsonb_to_recordset(
        sa.cast(sa.bindparam(param, type_=sa.Text()), postgresql.JSONB)
    )
    return recordset.table_valued(*[sa.column(c.name, c.type) for c in columns]).render_derived(
        name=name, with_types=True
    )


def bulk_insert(table: sa.Table, names: Sequence[str], *, param: str = "rows") -> Any:
    """``INSERT INTO table (names) SELECT names FROM json_records(...)`` (Postgres).

    Every column the rows carry is named, so no Python-side column default is
    added as an extra parameter; add ``on_conflict_*``/``returning`` as needed.
    """
    records = json_records([table.c[n] for n in names], param=param)
    select = sa.select(*[records.c[n] for n in names])
    return postgresql.insert(table).from_select(list(names), select)


def id_block() -> str:
    """The first 24 hex digits of a block of time-ordered ids (UUIDv7 layout).

    A set-based statement appends an 8-hex-digit row counter
    (``CAST(:prefix || lpad(to_hex(n), 8, '0') AS uuid)``): 48 bits of Unix
    milliseconds, version 7, 42 random bits per block, then the counter (RFC
    9562's dedicated counter). Ids made together are consecutive, so their
    primary-key entries land at the right edge of the index instead of on
    random pages.
    """
    millis = time.time_ns() // 1_000_000
    rand = secrets.randbits(42)
    rand_a, rand_b = rand >> 30, rand & (2**30 - 1)
    # version 7 nibble, then the variant bits 0b10 ahead of rand_b's top 30 bits
    return f"{millis:012x}7{rand_a:03x}{(0b10 << 30) | rand_b:08x}"


_new = object.__new__
_set = object.__setattr__
_SAFE = uuid.SafeUUID.unknown


def consecutive_ids(base: int, count: int) -> list[uuid.UUID]:
    """``UUID(int=base + n)`` for n in 1..count, made the way ``uuid.UUID``
    stores itself (its two slots) without its argument parsing: a batch makes
    thousands, and ``UUID(int=...)`` cost as much as the rest of the batch's
    encoding."""
    ids = []
    for value in range(base + 1, base + count + 1):
        made = _new(uuid.UUID)
        _set(made, "int", value)
        _set(made, "is_safe", _SAFE)
        ids.append(made)
    return ids


@asynccontextmanager
async def unprepared(conn: AsyncConnection) -> AsyncIterator[None]:
    """Run the statements inside without server-side preparation (psycopg).

    psycopg prepares a statement after a few executions; the server may then
    reuse a generic plan made without the parameters' values. For a
    set-based statement whose row counts come from an array or JSON
    parameter that plan assumes a handful of rows, whatever the batch size.
    Unprepared, every execution is planned for its own parameters.
    """
    driver = (await conn.get_raw_connection()).driver_connection
    threshold = driver.prepare_threshold  # type: ignore[union-attr]
    driver.prepare_threshold = None  # type: ignore[union-attr]
    try:
        yield
    finally:
        driver.prepare_threshold = threshold  # type: ignore[union-attr]


def wakeup_rows_sql(source: str, id_column: str) -> str:
    """``INSERT INTO outbox`` of the wake-up rows for the task ids in ``source``.

    ``:wake_chunk`` ids per ``{"task_ids": [...]}`` row, of kind ``:wake_kind``
    (no rows when it is NULL), with ``:wake_attempts`` attempts, created at
    ``:now`` — for a CTE of a statement that creates the tasks itself, so no
    task id makes a round trip. ``source`` and ``id_column`` are SQL names of
    the calling statement, never input. Rows and the ids in each follow
    ``id_column``'s order (the input order, for time-ordered ids), as
    :meth:`~trace_core.storage.protocol.Transaction.wake_tasks` writes them.
    """
    # One sorted array, sliced per row: a third of the time of numbering the
    # ids (a window), grouping them and sorting each group again.
    return f"""INSERT INTO outbox (kind, payload, status, available_at, attempts, claim_version,
                    max_attempts, created_at)
SELECT CAST(:wake_kind AS text),
       jsonb_build_object(
           'task_ids', to_jsonb(woken.ids[g * :wake_chunk + 1 : (g + 1) * :wake_chunk])),
       'Pending', :now, 0, 0, :wake_attempts, :now
FROM (SELECT array_agg({id_column} ORDER BY {id_column}) AS ids FROM {source}) AS woken,
     generate_series(0, (cardinality(woken.ids) - 1) / :wake_chunk) AS g
WHERE CAST(:wake_kind AS text) IS NOT NULL
ORDER BY g"""


def wakeup_params(wakeup: Wakeup, now: datetime) -> dict[str, Any]:
    """The parameters of :func:`wakeup_rows_sql`'s statement for ``wakeup`` at
    ``now``: the one place both statements that create tasks and their
    wake-ups (task creation, set-based routing) take them from."""
    return {
        "now": now,
        "wake_kind": wakeup.outbox_kind,
        "wake_chunk": wakeup.chunk,
        "wake_attempts": NewOutboxRow.max_attempts,
    }
