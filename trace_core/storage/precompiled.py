"""Statements compiled once by SQLAlchemy, run on a DB-API driver directly.

The direct paths of the hot statements (Postgres:
:mod:`~trace_core.storage.pg_direct`; SQLite, the one-commit hand-off:
:mod:`~trace_core.storage.sqlite_direct`) skip SQLAlchemy's per-call
execution machinery but keep what it decides: the same SQL text, the same
bind processors (naive datetimes refused, UUIDs as hex on SQLite …) and the
same result processors, so a row reads back the same on either path.

Only statements that are built once and reused (``functools.cache``d
builders) belong here: callers cache the compiled form per statement object.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.compiler import SQLCompiler

from trace_core.errors import ConfigurationError

__all__ = ["Compiled", "Processor", "compile_statement"]

Processor = Callable[[Any], Any]


@dataclass(frozen=True)
class Compiled:
    """One statement as the driver runs it (named parameters)."""

    sql: str
    literals: Mapping[str, Any]
    """Values SQLAlchemy bound inside the statement (``attempt + 1`` …)."""
    binds: Mapping[str, Processor]
    """Bind processors of the caller's parameters (naive datetimes refused …)."""
    results: tuple[Processor | None, ...] | None
    """Result processors by column; ``None`` when no column has one."""

    def parameters(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """``params`` as the driver takes them, with the statement's literals."""
        out = dict(self.literals)
        for name, value in params.items():
            processor = self.binds.get(name)
            out[name] = value if processor is None else processor(value)
        return out

    def rows(self, raw: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """The driver's rows with each column's result processor applied."""
        procs = self.results
        if procs is None:
            return raw
        return [
            tuple(v if p is None else p(v) for p, v in zip(procs, row, strict=True)) for row in raw
        ]


def compile_statement(
    stmt: sa.Executable, dialect: Dialect, column_keys: Sequence[str] | None = None
) -> Compiled:
    """``stmt`` compiled for ``dialect`` (whose paramstyle must be a named one).

    ``column_keys``: for an INSERT without values, the columns its parameter
    sets give (as SQLAlchemy compiles it per execution from the first set).
    """
    compiled = (
        stmt.compile(dialect=dialect, column_keys=list(column_keys) if column_keys else None)
        if isinstance(stmt, sa.ClauseElement)
        else None
    )
    if not isinstance(compiled, SQLCompiler):
        raise ConfigurationError(f"not a SQL statement: {type(stmt).__name__}")
    if compiled.insert_prefetch or compiled.update_prefetch:
        # Python-side column defaults are computed per execution by SQLAlchemy.
        raise ConfigurationError("statement needs Python-side column defaults")
    literals: dict[str, Any] = {}
    binds: dict[str, Processor] = {}
    for bind, name in compiled.bind_names.items():
        if bind.expanding:
            # An expanding IN is rendered per call; such a statement is not fixed text.
            raise ConfigurationError(f"statement has an expanding parameter {name!r}")
        if not bind.required:
            literals[name] = bind.effective_value
        processor = bind.type.dialect_impl(dialect).bind_processor(dialect)
        if processor is not None:
            if name in literals:
                literals[name] = processor(literals[name])
            else:
                binds[name] = processor
    columns = getattr(stmt, "exported_columns", ())
    results = tuple(c.type.dialect_impl(dialect).result_processor(dialect, None) for c in columns)
    return Compiled(compiled.string, literals, binds, results if any(results) else None)
