"""Statements compiled once for a driver (:mod:`trace_core.storage.precompiled`):
refused when SQLAlchemy would do per-execution work the direct paths skip."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects.sqlite.pysqlite import SQLiteDialect_pysqlite

from trace_core.errors import ConfigurationError
from trace_core.storage import schema
from trace_core.storage.precompiled import compile_statement

DIALECT = SQLiteDialect_pysqlite(paramstyle="named")


def test_a_python_side_default_or_an_expanding_in_is_refused() -> None:
    # tasks.id has a Python default (uuid4): SQLAlchemy computes it per execution.
    with pytest.raises(ConfigurationError, match="Python-side column defaults"):
        compile_statement(sa.insert(schema.tasks), DIALECT, ("job_id", "queued_at"))
    expanding = sa.select(schema.tasks.c.id).where(
        schema.tasks.c.id.in_(sa.bindparam("ids", expanding=True))
    )
    with pytest.raises(ConfigurationError, match="expanding parameter 'ids'"):
        compile_statement(expanding, DIALECT)


def test_parameters_and_rows_go_through_the_column_types() -> None:
    t = schema.tasks
    stmt = sa.select(t.c.id, t.c.queued_at).where(
        t.c.id == sa.bindparam("id", type_=t.c.id.type),
        t.c.queued_at <= sa.bindparam("at", type_=t.c.queued_at.type),
    )
    compiled = compile_statement(stmt, DIALECT)
    assert ":id" in compiled.sql and ":at" in compiled.sql
    task_id, at = uuid.uuid4(), datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    bound = compiled.parameters({"id": task_id, "at": at})
    assert bound["id"] == task_id.hex  # SQLite stores a UUID as 32 hex digits
    assert isinstance(bound["at"], str)
    with pytest.raises(ValueError):  # a naive datetime is refused, as through SQLAlchemy
        compiled.parameters({"id": task_id, "at": at.replace(tzinfo=None)})
    assert compiled.rows([(bound["id"], bound["at"])]) == [(task_id, at)]
