"""Buffered Postgres-table datasets as Query Service views: one org's rows, in Arrow.

:class:`TableViews` reads the table of a ``postgres_table:<table>`` input
(:mod:`trace_lite.buffered`: written by the sink into the *data* database)
through SQLAlchemy — a fixed Core ``SELECT``, never the query's text — into
a :class:`pyarrow.Table` that :class:`~trace_lite.query_service.SparkQueryService`
turns into the view's DataFrame. It runs in the query's worker thread, on a
synchronous engine of the data database's URL (no pool: one connection per
read; Postgres reads in a read-only transaction).

* **Rows**: only those whose ``org_id`` is the org of the querying task (its
  job's org in the state database, looked up by the verified token's
  ``task_id``), and at most ``max_rows`` of them: more is an error naming the
  view and the limit, never a silent truncation.
* **Columns**: every column of the table but ``org_id`` (constant in the
  view, so it is hidden: no query text can depend on it), with
  ``dedupe_key`` (the producer's record key) and ``created_at`` (when the
  sink wrote the row). Types: text as ``string``, integers as ``bigint``,
  floating point as ``double``, booleans as ``boolean``, JSON as its
  ``string`` text, timestamps as UTC ``timestamp``; a column of another type
  makes the table unattachable (fail closed), as does a table without
  ``org_id``.
* **The input's ``where``**: the top-level ``AND`` terms of the filter that
  SQL evaluates exactly as Spark does are added to the ``SELECT`` — a
  comparison, ``IN`` or ``BETWEEN`` of a text column with strings (Postgres
  compares them ``COLLATE "C"``: byte order, like Spark), of an integer
  column with integers or of a boolean column with ``TRUE``/``FALSE``,
  ``IS [NOT] NULL`` of any column, and ``NOT``/``AND``/``OR`` of those. The
  caller still applies the whole filter in Spark, so the view holds exactly
  the rows of the filter whatever was pushed; pushing only makes fewer rows
  loaded (and counted against ``max_rows``).
* **No rows yet**: a table that does not exist, or holds no row of the org,
  is the same error (``the dataset has no rows yet``), like a Parquet
  dataset without objects; the answer never depends on another org's rows.
"""

from __future__ import annotations

import operator
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import sqlalchemy as sa

from trace_core.dispatcher.bounded import BoundedMemo
from trace_core.errors import ConfigurationError, InvalidInput
from trace_core.storage.column_types import UTCDateTime
from trace_core.storage.protocol import Repository
from trace_core.storage.sql_errors import translate_errors
from trace_core.storage.url import create_sync_engine, parse_database_url
from trace_lite.buffered import DataDatabase, table_name_of
from trace_lite.pipeline.predicate import (
    And,
    Comparison,
    InList,
    IsNull,
    LiteralValue,
    Node,
    Not,
    Or,
    Predicate,
)

__all__ = ["DEFAULT_MAX_TABLE_ROWS", "TableViews"]

DEFAULT_MAX_TABLE_ROWS = 100_000
"""Rows of one org a Postgres-table view may load, by default."""

_ORG_COLUMN = "org_id"
_CHUNK_ROWS = 10_000  # rows fetched (and converted to Arrow) at a time
_ORG_CACHE = 4096  # tasks
_OPERATORS: Mapping[str, Callable[[Any, Any], Any]] = {
    "=": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}


@dataclass(frozen=True)
class _Kind:
    """How a column is read (SQLAlchemy type), typed in the view (Arrow), and
    which filter literals SQL compares with it exactly as Spark does."""

    read: sa.types.TypeEngine[Any]
    arrow: pa.DataType
    exact: Callable[[LiteralValue], bool]


@dataclass(frozen=True)
class _Column:
    """One view column: its ``SELECT`` expression and the expression a pushed
    filter compares."""

    name: str
    selected: sa.ColumnElement[Any]
    compared: sa.ColumnElement[Any]
    kind: _Kind


def _kind(name: str, reflected: Any) -> _Kind:
    """How a reflected column is read; ``InvalidInput`` for a type a view cannot hold."""
    if isinstance(reflected, sa.Boolean):
        return _Kind(sa.Boolean(), pa.bool_(), _is_bool)
    if isinstance(reflected, sa.Integer):
        return _Kind(sa.BigInteger(), pa.int64(), _is_int)
    if isinstance(reflected, sa.Float):
        return _Kind(sa.Float(), pa.float64(), _never)
    if isinstance(reflected, sa.DateTime):
        # UTCDateTime reads SQLite's naive UTC text and Postgres' TIMESTAMPTZ alike.
        return _Kind(UTCDateTime(), pa.timestamp("us", tz="UTC"), _never)
    if isinstance(reflected, sa.JSON):
        return _Kind(sa.JSON(), pa.string(), _never)  # selected as the document's text
    if isinstance(reflected, sa.String):
        return _Kind(sa.Text(), pa.string(), _is_text)
    raise InvalidInput(
        "sql", f"its column {name!r} is of type {reflected}, which a view cannot hold"
    )


def _column(column: sa.ColumnClause[Any], kind: _Kind, postgres: bool) -> _Column:
    """The view column of ``column`` (a column typed ``kind.read``)."""
    if isinstance(kind.read, sa.JSON):
        text = sa.cast(column, sa.Text())
        return _Column(column.name, text, text, kind)
    if isinstance(kind.read, sa.Text) and postgres:
        # Postgres orders text by the database's locale; "C" is byte order, like Spark.
        return _Column(column.name, column, column.collate("C"), kind)
    return _Column(column.name, column, column, kind)


def _never(value: LiteralValue) -> bool:
    return False


def _is_bool(value: LiteralValue) -> bool:
    return isinstance(value, bool)


def _is_int(value: LiteralValue) -> bool:
    return type(value) is int


def _is_text(value: LiteralValue) -> bool:
    return isinstance(value, str)


def _pushed(node: Node, columns: Mapping[str, _Column]) -> sa.ColumnElement[bool] | None:
    """``node`` as SQL, or ``None`` where SQL might not agree with Spark exactly."""
    if isinstance(node, And | Or):
        items = []
        for item in node.items:
            sub = _pushed(item, columns)
            if sub is None:
                return None
            items.append(sub)
        return sa.and_(*items) if isinstance(node, And) else sa.or_(*items)
    if isinstance(node, Not):
        inner = _pushed(node.item, columns)
        return None if inner is None else sa.not_(inner)
    column = columns.get(node.column)
    if column is None:
        return None
    if isinstance(node, IsNull):
        selected = column.selected
        return selected.is_not(None) if node.negated else selected.is_(None)
    compared = column.compared
    if isinstance(node, Comparison):
        values: Sequence[LiteralValue] = (node.value,)
    elif isinstance(node, InList):
        values = node.values
    else:
        values = (node.low, node.high)
    if not all(column.kind.exact(value) for value in values):
        return None
    kind = column.kind.read
    if isinstance(node, Comparison):
        pushed: sa.ColumnElement[bool] = _OPERATORS[node.op](compared, sa.literal(node.value, kind))
        return pushed
    if isinstance(node, InList):
        literals = [sa.literal(value, kind) for value in node.values]
        return compared.not_in(literals) if node.negated else compared.in_(literals)
    inside = compared.between(sa.literal(node.low, kind), sa.literal(node.high, kind))
    return sa.not_(inside) if node.negated else inside


def _pushdown(predicate: Predicate, columns: Mapping[str, _Column]) -> list[sa.ColumnElement[bool]]:
    """The top-level ``AND`` terms of ``predicate`` that SQL evaluates exactly."""
    root = predicate.root
    terms = root.items if isinstance(root, And) else (root,)
    return [pushed for pushed in (_pushed(term, columns) for term in terms) if pushed is not None]


class TableViews:
    """Reads one org's rows of buffered datasets' tables (see the module docstring).

    ``data`` is the data database (or its URL); ``state`` the state database,
    where a task's org is looked up.
    """

    def __init__(
        self,
        data: DataDatabase | str,
        state: Repository,
        *,
        max_rows: int = DEFAULT_MAX_TABLE_ROWS,
    ) -> None:
        if type(max_rows) is not int or max_rows < 1:
            raise ConfigurationError("TableViews: max_rows must be an integer >= 1")
        url = data.url if isinstance(data, DataDatabase) else parse_database_url(data)
        self._postgres = url.engine == "postgres"
        self._engine = create_sync_engine(url)
        if self._postgres:
            self._engine = self._engine.execution_options(postgresql_readonly=True)
        self._state = state
        self.max_rows = max_rows
        self._orgs: BoundedMemo[uuid.UUID, str] = BoundedMemo(_ORG_CACHE)

    async def org_of(self, task_id: uuid.UUID) -> str:
        """The org of ``task_id``'s job, as the tables' ``org_id`` holds it."""
        found = self._orgs.get(task_id)
        if found is None:
            async with self._state.read() as tx:
                org = await tx.status.org_of_task(task_id)
            if org is None:
                raise InvalidInput("sql", "the task is unknown: its org's rows cannot be read")
            found = self._orgs.put(task_id, str(org))
        return found

    def read(
        self,
        location: str,
        org_id: str,
        predicate: Predicate | None,
        *,
        field: str,
        check: Callable[[], None],
    ) -> pa.Table:
        """The org's rows of ``location``'s table that ``predicate``'s pushed terms
        keep (:class:`InvalidInput` naming ``sql`` with the reason otherwise;
        ``field`` names the filter in its errors). ``check`` runs between chunks
        and raises to stop the read."""
        name = table_name_of(location)
        # A data database that is down is a 503 (DatabaseUnavailable), not a 500.
        with translate_errors(f"read table {name}"):
            return self._read(name, org_id, predicate, field=field, check=check)

    def _read(
        self,
        name: str,
        org_id: str,
        predicate: Predicate | None,
        *,
        field: str,
        check: Callable[[], None],
    ) -> pa.Table:
        missing = InvalidInput("sql", "the dataset has no rows yet")
        with self._engine.connect() as conn:
            inspector = sa.inspect(conn)
            if not inspector.has_table(name):
                raise missing
            reflected = inspector.get_columns(name)
            if _ORG_COLUMN not in {c["name"] for c in reflected}:
                raise InvalidInput("sql", f"its table has no {_ORG_COLUMN} column")
            kinds = {
                c["name"]: _kind(c["name"], c["type"])
                for c in reflected
                if c["name"] != _ORG_COLUMN
            }
            table = sa.table(
                name,
                sa.column(_ORG_COLUMN, sa.Text()),
                *(sa.column(column, kind.read) for column, kind in kinds.items()),
            )
            columns = {
                column: _column(table.c[column], kind, self._postgres)
                for column, kind in kinds.items()
            }
            of_org = table.c[_ORG_COLUMN] == org_id
            kept = [of_org]
            if predicate is not None:
                predicate.check_columns(columns, field=field)
                kept += _pushdown(predicate, columns)
            arrow = pa.schema([pa.field(c.name, c.kind.arrow) for c in columns.values()])
            query = (
                sa.select(*(c.selected.label(c.name) for c in columns.values()))
                .select_from(table)
                .where(*kept)
                .limit(self.max_rows + 1)
            )
            # Closed on every exit: Postgres streams through a server-side cursor.
            with conn.execution_options(yield_per=_CHUNK_ROWS).execute(query) as result:
                batches = self._batches(result, arrow, check)
            # Nothing loaded: an empty view if the filter dropped the org's rows,
            # "no rows yet" if the org has none (whatever other orgs have).
            if not batches and (
                len(kept) == 1
                or conn.execute(
                    sa.select(sa.literal(1)).select_from(table).where(of_org).limit(1)
                ).first()
                is None
            ):
                raise missing
        return pa.Table.from_batches(batches, schema=arrow)

    def _batches(
        self, result: sa.CursorResult[Any], arrow: pa.Schema, check: Callable[[], None]
    ) -> list[pa.RecordBatch]:
        """``result``'s rows as Arrow record batches, one per fetched chunk (never
        more than ``max_rows`` rows: more is an error)."""
        batches = []
        loaded = 0
        for chunk in result.partitions():
            check()
            loaded += len(chunk)
            if loaded > self.max_rows:
                raise InvalidInput(
                    "sql",
                    f"more than {self.max_rows} rows of the task's org would be loaded "
                    f"(the limit per attached table is {self.max_rows} rows)",
                )
            arrays = [
                pa.array([row[i] for row in chunk], type=column.type)
                for i, column in enumerate(arrow)
            ]
            batches.append(pa.record_batch(arrays, schema=arrow))
        return batches
