"""Postgres: the protocol's hot single statements, run on the driver directly.

A claim, a heartbeat, a batch completion or an enqueue is one atomic
statement in autocommit. Through SQLAlchemy's async layer each also paid a
pool checkout, an isolation-level switch there and back, greenlet hops and
per-call parameter handling: ~0.65 ms of client time on top of a statement
that itself takes ~0.25 ms (``benchmarks/queue.py --mode latency`` reports
the per-call figures). Here each statement is compiled ONCE by SQLAlchemy —
the same SQL text, the same bind and result processors, so the same fences —
and executed on a small pool of dedicated autocommit psycopg connections.

Only statements that are built once and reused (the ``functools.cache``d
builders of :mod:`~trace_core.storage.sql_leasing` and
:mod:`~trace_core.storage.sql`) may run here: they are compiled per object.
Driver errors are wrapped the way SQLAlchemy wraps them, so
:func:`~trace_core.storage.sql_errors.translate_errors` treats both paths alike.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import psycopg
import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Dialect

from trace_core.errors import ConfigurationError
from trace_core.storage.precompiled import Compiled, compile_statement
from trace_core.storage.url import DatabaseURL

__all__ = ["DirectPool"]

_MAX_STATEMENTS = 256
"""Compiled statements kept; the cached builders make a few dozen."""


class DirectPool:
    """Dedicated autocommit connections for the hot statements of one repository.

    Connections are made on demand and at most ``max_idle`` are kept between
    calls. A connection that is not cleanly idle after a call (an error, a
    cancellation mid-statement) is closed, never reused.
    """

    def __init__(self, url: DatabaseURL, dialect: Dialect, *, max_idle: int) -> None:
        self._conninfo = url.conninfo()
        self._dialect = dialect
        self._max_idle = max_idle
        self._idle: list[psycopg.AsyncConnection[Any]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._compiled = functools.lru_cache(maxsize=_MAX_STATEMENTS)(self._compile)

    def _compile(self, stmt: sa.Executable) -> Compiled:
        return compile_statement(stmt, self._dialect)

    async def fetch(
        self, stmt: sa.Executable, params: Mapping[str, Any]
    ) -> Sequence[tuple[Any, ...]]:
        """Run ``stmt`` (built once, reused) with ``params``; its rows, processed."""
        compiled = self._compiled(stmt)
        try:
            bound = compiled.parameters(params)
        except (TypeError, ValueError) as exc:
            # What SQLAlchemy raises for a value its bind processor refuses.
            raise sa_exc.StatementError(str(exc), compiled.sql, None, exc) from exc
        conn = await self._acquire(compiled.sql)
        clean = False
        try:
            cursor = await conn.execute(compiled.sql, bound)
            raw = await cursor.fetchall() if cursor.description is not None else []
            clean = True
        except psycopg.Error as exc:
            raise _wrapped(compiled.sql, exc, conn) from exc
        finally:
            await self._release(conn, clean)
        return compiled.rows(raw)

    async def fetch_many(
        self, calls: Sequence[tuple[sa.Executable, Mapping[str, Any]]]
    ) -> list[Sequence[tuple[Any, ...]]]:
        """Run several statements (each built once, reused) in ONE round trip
        (psycopg's pipeline mode); the rows of each, processed, in order.

        For reads that need no snapshot across statements: each statement
        takes its own (READ COMMITTED), as separate :meth:`fetch` calls would.
        A failing statement fails the call; the ones after it do not run.
        """
        compiled = [self._compiled(stmt) for stmt, _ in calls]
        bound = []
        for one, (_, params) in zip(compiled, calls, strict=True):
            try:
                bound.append(one.parameters(params))
            except (TypeError, ValueError) as exc:
                raise sa_exc.StatementError(str(exc), one.sql, None, exc) from exc
        # A pipeline's error surfaces when it syncs, not at its statement.
        sql = ";\n".join(one.sql for one in compiled)
        conn = await self._acquire(sql)
        clean = False
        raw: list[list[tuple[Any, ...]]] = []
        try:
            async with conn.pipeline():
                cursors = []
                for one, params in zip(compiled, bound, strict=True):
                    cursors.append(await conn.execute(one.sql, params))
            # Leaving the block synced the pipeline: every result is here.
            for cursor in cursors:
                raw.append(await cursor.fetchall() if cursor.description is not None else [])
            clean = True
        except psycopg.Error as exc:
            raise _wrapped(sql, exc, conn) from exc
        finally:
            await self._release(conn, clean)
        return [one.rows(rows) for one, rows in zip(compiled, raw, strict=True)]

    @property
    def idle(self) -> int:
        """Connections kept open for the next call."""
        with self._lock:
            return len(self._idle)

    async def _acquire(self, sql: str) -> psycopg.AsyncConnection[Any]:
        with self._lock:
            if self._closed:
                raise ConfigurationError("the repository is closed")
            if self._idle:
                return self._idle.pop()
        try:
            return await psycopg.AsyncConnection.connect(self._conninfo, autocommit=True)
        except psycopg.Error as exc:
            raise _wrapped(sql, exc, None) from exc

    async def _release(self, conn: psycopg.AsyncConnection[Any], clean: bool) -> None:
        reusable = (
            clean
            and not conn.closed
            and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        )
        stale: list[psycopg.AsyncConnection[Any]] = [conn]
        with self._lock:
            if reusable and not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(conn)
                return
            if conn.broken:
                # The server went away (a restart, a failover): the idle
                # connections opened before are as dead as this one. Dropped
                # now, they do not fail one call each after it is back.
                stale += self._idle
                self._idle = []
        with anyio.CancelScope(shield=True):
            for dead in stale:
                await dead.close()

    async def close(self) -> None:
        """Close every idle connection; calls after this are refused."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        with anyio.CancelScope(shield=True):
            for conn in idle:
                await conn.close()


def _wrapped(
    sql: str, exc: psycopg.Error, conn: psycopg.AsyncConnection[Any] | None
) -> sa_exc.StatementError:
    """``exc`` as the SQLAlchemy error SQLAlchemy would have raised (parameters hidden)."""
    invalidated = conn is None or conn.broken
    return sa_exc.DBAPIError.instance(
        sql,
        None,
        exc,
        psycopg.Error,
        hide_parameters=True,
        connection_invalidated=invalidated,
        dialect=None,
    )
