"""What the SQL implementation of a port area needs of its transaction.

Each area of the port (:mod:`trace_core.storage.ports`) has one SQL module,
``sql_<area>.py``, with a class built on :class:`SqlArea`. The transaction
(:class:`~trace_core.storage.sql.SqlTransaction`) creates it once, on first
use of ``tx.<area>``, and the area runs its statements through the
transaction, so they take part in it whatever its scope.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from trace_core.storage.sql_errors import translate_errors

__all__ = ["SqlArea", "SqlStatements", "in_list"]


def in_list(column: sa.ColumnElement[Any], name: str, engine: str) -> sa.ColumnElement[bool]:
    """``column`` among the values of the list parameter ``name``.

    Postgres: ``column = ANY(CAST(:name AS <type>[]))``, one array parameter,
    so that the statement text is the same for every list (compiled once, and
    run on the direct path in a statement scope, see
    :meth:`SqlArea._fixed_rows`); SQLite: an expanding ``IN``.
    """
    if engine == "postgres":
        return column == sa.any_(sa.cast(sa.bindparam(name), postgresql.ARRAY(column.type)))
    return column.in_(sa.bindparam(name, expanding=True))


class SqlStatements(Protocol):
    """The part of a SQL transaction an area uses (``SqlTransaction`` is one)."""

    engine_name: str

    def insert(self, table: sa.Table) -> Any:
        """A dialect INSERT (with ``on_conflict_do_nothing``) for ``table``."""
        ...

    async def _execute(self, stmt: sa.Executable, params: Any = None) -> Any:
        """Run ``stmt`` in the transaction; a result with ``all``, ``first``,
        ``scalars`` and ``rowcount``."""
        ...

    async def _fetch(self, stmt: sa.Executable, params: Mapping[str, Any]) -> Sequence[Any]:
        """Rows of ``stmt``, a statement built once and reused (on Postgres in a
        statement scope it runs on the driver directly)."""
        ...


class SqlArea:
    """Base of an area's SQL implementation: statements run in ``tx``, and
    driver errors leave as :class:`~trace_core.errors.TraceError`s naming the
    operation."""

    def __init__(self, tx: SqlStatements) -> None:
        self._tx = tx

    @property
    def engine_name(self) -> str:
        """``sqlite`` or ``postgres``: the only place where a dialect branch may look."""
        return self._tx.engine_name

    async def _run(self, what: str, stmt: sa.Executable, params: Any = None) -> Any:
        """``stmt``'s result; ``what`` names the operation in a translated error."""
        with translate_errors(what):
            return await self._tx._execute(stmt, params)

    async def _rows(self, what: str, stmt: sa.Executable, params: Any = None) -> list[Any]:
        """Every row of ``stmt``, fetched."""
        with translate_errors(what):
            return list((await self._tx._execute(stmt, params)).all())

    async def _fixed_rows(
        self, what: str, stmt: sa.Executable, params: Mapping[str, Any]
    ) -> Sequence[Any]:
        """Every row of ``stmt``, a module-level statement built once (no
        expanding parameter): on Postgres in a statement scope it skips
        SQLAlchemy's connection and execution layers. Rows are positional."""
        with translate_errors(what):
            return await self._tx._fetch(stmt, params)

    async def _count(self, what: str, stmt: sa.Executable, params: Any = None) -> int:
        """How many rows an UPDATE or DELETE changed (not an INSERT: psycopg
        reports -1 for those; use RETURNING)."""
        with translate_errors(what):
            return int((await self._tx._execute(stmt, params)).rowcount)
