"""Column types portable across SQLite and Postgres.

Postgres gets its native types (UUID, TIMESTAMPTZ, JSONB, TEXT[]); SQLite
stores the same values as text, and every value comes back as the same Python
type on both engines.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler

__all__ = ["EmptyArray", "JSONDoc", "StringArray", "UTCDateTime", "Uuid"]


_new_object = object.__new__
_set_slot = object.__setattr__
# Read once: an enum member looked up on its class is a slow descriptor call.
_UNKNOWN_SAFETY = uuid.SafeUUID.unknown


def _uuid_from_hex(value: str | None) -> uuid.UUID | None:
    if value is None:
        return None
    if len(value) == 32:
        # What ``uuid.UUID(int=…)`` ends with, without its argument checks, which
        # were half its cost (CPython 3.14's internal ``UUID._from_int`` does the
        # same): the slots are set from the 32 hex digits SQLAlchemy wrote.
        parsed = _new_object(uuid.UUID)
        _set_slot(parsed, "int", int(value, 16))
        _set_slot(parsed, "is_safe", _UNKNOWN_SAFETY)
        return parsed
    return uuid.UUID(value)


class Uuid(sa.Uuid[uuid.UUID]):
    """Native ``UUID`` on Postgres, 32-hex ``CHAR`` on SQLite; Python ``uuid.UUID`` on both.

    On SQLite every id read back is parsed from its hex text. ``uuid.UUID(hex)``
    re-validates the string it is given (strip, replace, length checks) and was
    the largest single cost of a SQLite batch claim; the column holds the 32
    hex digits SQLAlchemy wrote, so they are read as one integer instead.
    """

    cache_ok = True

    def result_processor(self, dialect: Dialect, coltype: object) -> Callable[[Any], Any] | None:
        if self.as_uuid and not (dialect.supports_native_uuid and self.native_uuid):
            return _uuid_from_hex
        processor: Callable[[Any], Any] | None = super().result_processor(  # type: ignore[no-untyped-call]
            dialect, coltype
        )
        return processor


JSONDoc = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")
"""``JSONB`` on Postgres, JSON text on SQLite. Python ``None`` is SQL ``NULL``
(not a JSON ``null``), so ``IS NULL`` means what it says."""


class UTCDateTime(sa.types.TypeDecorator[datetime]):
    """A timezone-aware UTC timestamp: ``TIMESTAMPTZ`` on Postgres.

    On SQLite the value is stored as naive UTC ISO text (fixed width, so text
    comparison orders correctly) and comes back aware. Naive inputs are
    refused: a naive timestamp is a bug waiting for a daylight-saving change.
    """

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given for a UTC timestamp column")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return _as_utc(value)

    def result_processor(self, dialect: Dialect, coltype: object) -> Callable[[Any], Any] | None:
        if dialect.name == "sqlite":
            # SQLite hands back the ISO text; ``fromisoformat`` parses it in C,
            # several times faster than the dialect's regular expression.
            return _utc_from_text
        return super().result_processor(dialect, coltype)


def _as_utc(value: datetime | None) -> datetime | None:
    if value is None:
        return None
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


def _utc_from_text(value: str | datetime | None) -> datetime | None:
    return _as_utc(datetime.fromisoformat(value) if isinstance(value, str) else value)


class StringArray(sa.types.TypeDecorator[list[str]]):
    """``TEXT[]`` on Postgres, a JSON array in text on SQLite."""

    impl = sa.Text
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> sa.types.TypeEngine[Any]:
        if dialect.name == "postgresql":
            return dialect.type_descriptor(postgresql.ARRAY(sa.Text()))
        return dialect.type_descriptor(sa.Text())

    def process_bind_param(self, value: list[str] | None, dialect: Dialect) -> Any:
        if value is None or dialect.name == "postgresql":
            return value
        return json.dumps(list(value))

    def process_result_value(self, value: Any, dialect: Dialect) -> list[str] | None:
        if value is None:
            return None
        if isinstance(value, str):
            loaded = json.loads(value)
            return [str(v) for v in loaded]
        return list(value)


class EmptyArray(sa.sql.expression.ColumnElement[list[str]]):
    """The server default of an empty :class:`StringArray` on either engine."""

    inherit_cache = True


@compiles(EmptyArray, "postgresql")
def _empty_array_pg(element: EmptyArray, compiler: SQLCompiler, **kw: Any) -> str:
    return "'{}'"


@compiles(EmptyArray)
def _empty_array_default(element: EmptyArray, compiler: SQLCompiler, **kw: Any) -> str:
    return "'[]'"
