"""SQLite: a statement scope's write transaction on a sync connection, one thread hop per step.

Through SQLAlchemy's async layer on aiosqlite every small step of a scope is
a round trip to aiosqlite's connection thread: the cursor, the execute, the
fetch, the ``BEGIN`` of the begin hook, the ``COMMIT``, the pool's
reset-on-return. A one-task enqueue made ~14 of them, each an idle thread
woken on a small machine. Here a :meth:`SqlRepository.statement()
<trace_core.storage.sql.SqlRepository.statement>` scope checks out a
connection of a *sync* pysqlite engine on the same file (same PRAGMAs, same
``BEGIN IMMEDIATE``: :func:`~trace_core.storage.engine.configure_sqlite`) and
runs on an anyio worker thread, in one hop each:

- checkout, ``BEGIN IMMEDIATE`` and the first statement, its rows fetched;
- every later statement, its rows fetched;
- ``COMMIT`` (or ``ROLLBACK``) and the return to the pool.

A claim or a completion of tasks is two hops: the attempt records (which
Postgres writes in the claim's own statement) are a second statement sent in
the claim's or the completion's hop (:meth:`DirectScope.execute_then`); a
one-task enqueue with its wake-up row is three. The one-commit hand-off is
one hop on the raw ``sqlite3`` connection (:meth:`DirectScope.execute_then_commit`):
``BEGIN IMMEDIATE``, its statements compiled once
(:mod:`~trace_core.storage.precompiled`), ``COMMIT``; or no hop at all: with
``synchronous`` NORMAL or OFF (a commit that writes the WAL without an fsync)
it runs on the event loop itself, on a connection that never waits and never
checkpoints (:meth:`RawWriter.try_inline`), and falls back to the hop when it
would have to wait.
Every other statement runs through the sync :meth:`sqlalchemy.engine.Connection.execute`,
so ad hoc statements, executemany and ``RETURNING`` behave, and fail, exactly
as through the async path: the same compiled SQL, bind and result processors,
and SQLAlchemy's own error wrapping for
:func:`~trace_core.storage.sql_errors.translate_errors`.
"""

from __future__ import annotations

import contextlib
import functools
import sqlite3
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import anyio
import anyio.to_thread
import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects.sqlite.pysqlite import SQLiteDialect_pysqlite
from sqlalchemy.engine import Dialect

from trace_core.errors import ConfigurationError
from trace_core.storage.engine import EngineSettings, create_sqlite_sync_engine
from trace_core.storage.precompiled import Compiled, compile_statement
from trace_core.storage.url import DatabaseURL

__all__ = ["BufferedResult", "DirectScope", "FollowUp", "RawWriter", "SqliteDirect"]

FollowUp = Callable[[Sequence[Any]], tuple[sa.Executable, Any] | None]
"""Builds, from a statement's fetched rows, the statement (and its parameters)
to send right after it in the same step, or ``None`` for none."""

Compiler = Callable[[sa.Executable, tuple[str, ...] | None], Compiled]
"""A statement (and, for an INSERT without values, its parameters' column
names) compiled once for the raw driver."""

_MAX_STATEMENTS = 64
"""Statements kept compiled for the raw driver (the hand-off uses two)."""

_INLINE_SYNCHRONOUS = frozenset({"OFF", "NORMAL"})
"""``synchronous`` settings whose WAL commit calls no fsync: only then may a
transaction run on the event loop (:meth:`RawWriter.try_inline`)."""

INLINE_CHECKPOINT_EVERY = 64
"""Every this many transactions, one goes through the thread hop instead of
the event loop. Its connection checkpoints on commit as SQLite does by default
(past 1,000 WAL pages), which the event loop's never does: so the WAL stays
bounded (a hand-off writes about ten pages) even when hand-offs are the only
writes, and no checkpoint ever runs on the loop."""


class BufferedResult:
    """A statement's outcome with its rows already fetched (on the worker thread).

    Offers the parts of :class:`sqlalchemy.engine.Result` the repository uses:
    ``all()``, ``first()``, ``one()``, ``scalar()``, ``scalars()`` and ``rowcount``.
    """

    __slots__ = ("_rows", "rowcount")

    def __init__(self, result: sa.CursorResult[Any]) -> None:
        self.rowcount: int = result.rowcount
        """As the cursor reported it (``-1`` for a SELECT, as on the async path)."""
        self._rows: list[sa.Row[Any]] | None = list(result.all()) if result.returns_rows else None

    def _fetched(self) -> list[sa.Row[Any]]:
        if self._rows is None:
            # What SQLAlchemy raises when asked for rows of a statement with none.
            raise sa_exc.ResourceClosedError("This result object does not return rows.")
        return self._rows

    def __iter__(self) -> Iterator[sa.Row[Any]]:
        return iter(self._fetched())

    def all(self) -> Sequence[sa.Row[Any]]:
        """Every row."""
        return list(self._fetched())

    def first(self) -> sa.Row[Any] | None:
        """The first row, or ``None``."""
        rows = self._fetched()
        return rows[0] if rows else None

    def one(self) -> sa.Row[Any]:
        """The only row; :class:`~sqlalchemy.exc.NoResultFound` or
        :class:`~sqlalchemy.exc.MultipleResultsFound` otherwise."""
        rows = self._fetched()
        if not rows:
            raise sa_exc.NoResultFound("No row was found when one was required")
        if len(rows) > 1:
            raise sa_exc.MultipleResultsFound(
                "Multiple rows were found when exactly one was required"
            )
        return rows[0]

    def scalar(self) -> Any:
        """The first column of the first row, or ``None``."""
        row = self.first()
        return row[0] if row is not None else None

    def scalars(self) -> BufferedScalars:
        """The first column of every row."""
        return BufferedScalars([row[0] for row in self._fetched()])


class BufferedScalars:
    """The first column of a :class:`BufferedResult`'s rows."""

    __slots__ = ("_values",)

    def __init__(self, values: list[Any]) -> None:
        self._values = values

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values)

    def all(self) -> Sequence[Any]:
        """Every value."""
        return list(self._values)

    def first(self) -> Any:
        """The first value, or ``None``."""
        return self._values[0] if self._values else None


class DirectScope:
    """One write transaction on a connection of the sync engine.

    Opened by its first statement; ended by :meth:`finish`, which the owner
    must always call (it is a no-op when no statement ran). Each step runs on a
    worker thread while the caller awaits it; an anyio cancellation still waits
    for the step to end (the thread is not abandoned).
    """

    def __init__(self, engine: sa.Engine, limiter: anyio.CapacityLimiter, raw: RawWriter) -> None:
        self._engine = engine
        self._limiter = limiter
        self._raw = raw
        self._conn: sa.Connection | None = None
        """Set on the worker thread as soon as it is checked out, so that
        :meth:`finish` releases it even if the step that opened it failed or
        its caller was cancelled meanwhile."""
        self._lock = threading.Lock()
        """Held by each step for its whole run. Uncontended unless a plain
        asyncio cancellation (``task.cancel()``, which anyio's shield does not
        stop) abandoned a step still running: the next step then waits for it,
        so no two threads ever use the connection at once and the rollback
        comes after the abandoned statement, never before it."""
        self._started = False
        self._finished = False

    async def execute(self, stmt: sa.Executable, params: Any = None) -> BufferedResult:
        """Run ``stmt`` (any statement; a list of parameter sets is an
        executemany) in the transaction; its rows, fetched."""
        self._started = True
        return await anyio.to_thread.run_sync(self._execute, stmt, params, limiter=self._limiter)

    def _execute(self, stmt: sa.Executable, params: Any) -> BufferedResult:
        with self._lock:
            return self._statement(stmt, params)

    def _statement(self, stmt: sa.Executable, params: Any) -> BufferedResult:
        """One statement on the scope's connection; the caller holds ``_lock``."""
        if self._finished:
            # Only an abandoned step that ran after the scope ended gets here.
            raise ConfigurationError("the statement scope has ended")
        conn = self._conn
        if conn is None:
            conn = self._conn = self._engine.connect()
        # The first execute begins the transaction: the engine's begin hook
        # issues BEGIN IMMEDIATE, in this same hop.
        return BufferedResult(conn.execute(stmt, params))

    async def execute_then(
        self, stmt: sa.Executable, params: Any, then: FollowUp
    ) -> BufferedResult:
        """Run ``stmt``, then the statement ``then`` builds from its fetched
        rows (if any), in ONE thread hop; ``stmt``'s result. ``then`` runs on
        the worker thread: it must only compute (no I/O, no awaiting)."""
        self._started = True
        return await anyio.to_thread.run_sync(
            self._execute_then, stmt, params, then, limiter=self._limiter
        )

    def _execute_then(self, stmt: sa.Executable, params: Any, then: FollowUp) -> BufferedResult:
        with self._lock:
            first = self._statement(stmt, params)
            follow = then(first.all())
            if follow is not None:
                self._statement(*follow)
            return first

    async def execute_then_commit(
        self, stmt: sa.Executable, params: Mapping[str, Any], then: FollowUp
    ) -> list[tuple[Any, ...]]:
        """:meth:`execute_then`, then the commit and the return of the
        connection, all in ONE hop, or in none when it can run on the event
        loop without waiting (:meth:`RawWriter.try_inline`) (the scope's last
        step: :meth:`finish` has nothing left to do); ``stmt``'s rows, processed.

        For a scope of one statement whose floor is a single commit (the
        one-commit hand-off): both statements run on the raw ``sqlite3``
        connection, compiled once (:mod:`~trace_core.storage.precompiled`,
        same SQL and processors as through SQLAlchemy), so they must be
        built once and reused. ``then``'s parameters are a mapping or a
        list of them (executemany). Driver errors come out raw (``sqlite3``'s);
        :func:`~trace_core.storage.sql_errors.translate_errors` takes them."""
        self._started = True
        inline = self._inline_then_commit(stmt, params, then)
        if inline is not None:
            return inline
        with anyio.CancelScope(shield=True):
            done = await anyio.to_thread.run_sync(
                self._execute_then_commit, stmt, params, then, limiter=self._limiter
            )
        return done

    def _inline_then_commit(
        self, stmt: sa.Executable, params: Mapping[str, Any], then: FollowUp
    ) -> list[tuple[Any, ...]] | None:
        """:meth:`execute_then_commit` on the calling (event loop) thread, if
        :meth:`RawWriter.try_inline` can; ``None`` otherwise (nothing was written)."""
        # Never block the loop: a step still holding the lock (only an
        # abandoned one) sends this one to the thread path, which waits.
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._conn is not None or self._finished:
                raise ConfigurationError("execute_then_commit must be the scope's only step")
            try:
                rows = self._raw.try_inline(stmt, params, then)
            except BaseException:
                self._finished = True  # rolled back already: nothing left to finish
                raise
            if rows is not None:
                self._finished = True
            return rows
        finally:
            self._lock.release()

    def _execute_then_commit(
        self, stmt: sa.Executable, params: Mapping[str, Any], then: FollowUp
    ) -> list[tuple[Any, ...]]:
        with self._lock:
            if self._conn is not None or self._finished:
                # Raw and SQLAlchemy steps do not share one transaction.
                raise ConfigurationError("execute_then_commit must be the scope's only step")
            self._finished = True
            return self._raw.run(stmt, params, then)

    async def finish(self, *, commit: bool) -> None:
        """Commit (or roll back) and return the connection to the pool, in one
        hop that a cancellation does not interrupt. A failed commit rolls back."""
        if not self._started or self._finished:
            return
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._finish, commit, limiter=self._limiter)

    def _finish(self, commit: bool) -> None:
        with self._lock:
            self._end(commit)

    def _end(self, commit: bool) -> None:
        """Commit or roll back, and release the connection; the caller holds ``_lock``."""
        self._finished = True
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            if commit and conn.in_transaction():
                conn.commit()
        finally:
            # Rolls back whatever is still open (an error, a failed commit)
            # before the pool takes it back; should that fail too, the pool's
            # own reset invalidates the connection: none is pooled mid-transaction.
            conn.close()


class RawWriter:
    """One-hop write transactions on a raw ``sqlite3`` connection kept open
    (the one-commit hand-off: :meth:`DirectScope.execute_then_commit`).

    Its statements are compiled once with SQLAlchemy's SQLite dialect and
    named parameters (:mod:`~trace_core.storage.precompiled`): the same SQL,
    bind and result processors as through SQLAlchemy. The connection comes
    from the sync engine (its PRAGMAs) and is kept out of its pool: checking
    it out and resetting it on return was a quarter of the hop's work. One
    that failed is closed, never reused. :meth:`run` runs on worker threads;
    :meth:`try_inline` on the event loop, on a second kept connection.
    """

    def __init__(self, engine: sa.Engine, *, inline: bool = False) -> None:
        self._engine = engine
        self._inline = inline
        """Whether :meth:`try_inline` may run transactions at all (the
        commit must not fsync: ``synchronous`` NORMAL or OFF)."""
        self._inline_kept: sa.PoolProxiedConnection | None = None
        self._inline_lock = threading.Lock()
        self._inline_runs = 0
        # SQLAlchemy's dialect for sqlite3 with ``:name`` parameters (sqlite3
        # takes them from a mapping), else the same as the engine's.
        self._dialect: Dialect = SQLiteDialect_pysqlite(paramstyle="named")
        self._compiled: Compiler = functools.lru_cache(maxsize=_MAX_STATEMENTS)(self._compile)
        self._lock = threading.Lock()
        """Held for a whole transaction: one at a time on the kept connection."""
        self._kept: sa.PoolProxiedConnection | None = None
        self._closed = False

    def _compile(self, stmt: sa.Executable, column_keys: tuple[str, ...] | None) -> Compiled:
        return compile_statement(stmt, self._dialect, column_keys)

    def run(
        self, stmt: sa.Executable, params: Mapping[str, Any], then: FollowUp
    ) -> list[tuple[Any, ...]]:
        """``BEGIN IMMEDIATE``, ``stmt`` (its rows fetched and processed), the
        statement ``then`` builds from them (a mapping of parameters, or a
        list of them for an executemany), ``COMMIT``; ``stmt``'s rows.
        Driver errors come out raw (``sqlite3``'s), after a rollback."""
        first = self._compiled(stmt, None)
        bound = _bound(first, params)
        with self._lock:
            if self._closed:
                raise ConfigurationError("the repository is closed")
            kept = self._kept
            if kept is None:
                kept = self._engine.raw_connection()  # the connect hook's PRAGMAs
                kept.detach()  # ours until close(): not the pool's to reset or count
                self._kept = kept
            done = False
            try:
                rows = self._transaction(kept.dbapi_connection, first, bound, then)
                done = True
            finally:
                if not done:
                    self._kept = None
                    with contextlib.suppress(sqlite3.Error):
                        kept.close()
        if self._inline:
            # After the commit: a failure to open it must not fail the
            # transaction (the next hand-off then takes the thread again).
            with contextlib.suppress(sqlite3.Error, sa_exc.DBAPIError):
                self._open_inline()
        return rows

    def try_inline(
        self, stmt: sa.Executable, params: Mapping[str, Any], then: FollowUp
    ) -> list[tuple[Any, ...]] | None:
        """:meth:`run` on the calling thread (the event loop: no thread hop),
        or ``None`` if that could block, in which case nothing was written
        and the caller takes the thread path (:meth:`run`).

        What bounds the time it holds the loop: its connection has
        ``busy_timeout`` 0, so a write lock held elsewhere (another process,
        another repository on the file) makes ``BEGIN IMMEDIATE`` fail at
        once instead of waiting (the connection is opened by :meth:`run`, on
        its thread: until then, and after a failure closed it, hand-offs take
        the thread path); ``wal_autocheckpoint`` 0, so its commit never
        checkpoints (every :data:`INLINE_CHECKPOINT_EVERY`-th transaction
        goes through the thread path, whose commit does); and it is used only
        when the commit writes the WAL without an fsync. What remains on the
        loop is the statements' own work and the WAL write into the OS page
        cache: 0.15 ms on a warm machine, ~0.6 ms after 20 ms idle under load
        (measured); only a kernel stalling that write (dirty-page writeback
        throttling) could hold the loop longer."""
        if not self._inline:
            return None
        self._inline_runs += 1
        if self._inline_runs % INLINE_CHECKPOINT_EVERY == 0:
            return None
        first = self._compiled(stmt, None)
        bound = _bound(first, params)
        if not self._inline_lock.acquire(blocking=False):
            return None  # another thread's loop is in it: not worth waiting for
        try:
            if self._closed:
                raise ConfigurationError("the repository is closed")
            kept = self._inline_kept
            if kept is None:
                return None  # opening one may wait: run() does it, on its thread
            db: Any = kept.dbapi_connection
            try:
                return self._transaction(db, first, bound, then)
            except sqlite3.OperationalError as exc:
                # SQLITE_BUSY (the write lock is held elsewhere: in practice
                # only at BEGIN), rolled back: nothing was written, and the
                # thread path, which may wait, runs the transaction again.
                if exc.sqlite_errorcode & 0xFF == sqlite3.SQLITE_BUSY and not db.in_transaction:
                    return None
                self._drop_inline(kept)
                raise
            except BaseException:
                self._drop_inline(kept)
                raise
        finally:
            self._inline_lock.release()

    def _open_inline(self) -> None:
        """Open the event loop's connection if there is none (on a worker
        thread: connecting runs the connect hook's PRAGMAs, which may wait)."""
        with self._inline_lock:
            if self._inline_kept is not None or self._closed:
                return
            kept = self._engine.raw_connection()
            kept.detach()
            db: Any = kept.dbapi_connection
            # Never wait for the write lock; never checkpoint (see try_inline).
            db.execute("PRAGMA busy_timeout=0")
            db.execute("PRAGMA wal_autocheckpoint=0")
            self._inline_kept = kept

    def _drop_inline(self, kept: sa.PoolProxiedConnection) -> None:
        """Close the loop's connection after a failure (never reused)."""
        self._inline_kept = None
        with contextlib.suppress(sqlite3.Error):
            kept.close()

    def _transaction(
        self, db: Any, first: Compiled, bound: Mapping[str, Any], then: FollowUp
    ) -> list[tuple[Any, ...]]:
        assert isinstance(db, sqlite3.Connection)
        db.execute("BEGIN IMMEDIATE")
        try:
            rows = first.rows(db.execute(first.sql, bound).fetchall())
            follow = then(rows)
            if follow is not None:
                stmt2, params2 = follow
                sets: list[Mapping[str, Any]] = params2 if isinstance(params2, list) else [params2]
                second = self._compiled(stmt2, tuple(sets[0]))
                db.executemany(second.sql, [_bound(second, p) for p in sets])
            db.execute("COMMIT")
        except BaseException:
            # A failed COMMIT may have ended the transaction already.
            if db.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
            raise
        return rows

    def close(self) -> None:
        """Close the kept connection; transactions after this are refused."""
        with self._lock:
            self._closed = True
            kept, self._kept = self._kept, None
        with self._inline_lock:
            inline, self._inline_kept = self._inline_kept, None
        for conn in (kept, inline):
            if conn is not None:
                conn.close()


def _bound(compiled: Compiled, params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` through the statement's bind processors; a value they
    refuse raises what SQLAlchemy raises for it (a ``StatementError``)."""
    try:
        return compiled.parameters(params)
    except (TypeError, ValueError) as exc:
        raise sa_exc.StatementError(str(exc), compiled.sql, None, exc) from exc


class SqliteDirect:
    """The sync engine of one repository's statement scopes (SQLite)."""

    def __init__(self, url: DatabaseURL, settings: EngineSettings) -> None:
        self._engine = create_sqlite_sync_engine(url, settings)
        # Threads of our own: behind anyio's default limiter, shared with
        # whatever else the process runs in threads (sync operators), a
        # heartbeat could wait for a token while holding the write lock.
        self._limiter = anyio.CapacityLimiter(settings.pool_size + settings.max_overflow)
        self._closed = False
        inline = settings.sqlite_synchronous.upper() in _INLINE_SYNCHRONOUS
        self._raw = RawWriter(self._engine, inline=inline)

    def scope(self) -> DirectScope:
        """A new transaction scope; refused once :meth:`close` was called."""
        if self._closed:
            raise ConfigurationError("the repository is closed")
        return DirectScope(self._engine, self._limiter, self._raw)

    @property
    def checked_out(self) -> int:
        """Connections in use by scopes right now."""
        pool = self._engine.pool
        assert isinstance(pool, sa.pool.QueuePool)
        return pool.checkedout()

    async def close(self) -> None:
        """Close the pooled connections; scopes after this are refused."""
        self._closed = True
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._dispose, limiter=self._limiter)

    def _dispose(self) -> None:
        try:
            self._raw.close()
        finally:
            self._engine.dispose()
