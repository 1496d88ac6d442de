"""Buffered Postgres-data datasets in the lite profile: buffer and sink.

interface-contracts.md "Buffered Postgres Datasets": producers publish
records to a dataset buffer; a platform-managed sink drains it, writes the
dataset's table idempotently (``UNIQUE (org_id, dedupe_key)``) and emits the
dataset event after the commit. Producers never hold credentials of the
data database.

In the aws profile the buffer is an SQS queue. Here it is a table of the
*data* database (never the state database): :class:`SqlDatasetBuffer`
appends one row per published batch, so a batch survives a crash of the
process that published it. :class:`BufferSink` drains it in two steps that
each survive a crash between them:

1. one data-database transaction per batch inserts its records with
   ``ON CONFLICT (org_id, dedupe_key) DO NOTHING`` and marks the batch
   written — a batch published twice (a retry, a duplicate wake-up) adds no
   row, and a crash before the commit leaves the batch to do again;
2. for every written batch that added rows, a cursor event (the batch id)
   for the producer's dataset version is accepted by the state database,
   then the batch row is deleted — a crash in between emits the event again,
   which the gateway deduplicates by its unit key.

``org_id`` is the producing job's org, filled in by the sink: a record that
names another org is refused, so one org's producer cannot write another
org's rows. Records must match a :class:`RecordSchema` the sink knows (by
``schema_hash``); a batch that does not is kept with its error (a dead
letter) and never blocks the batches after it.

One sink drains a data database at a time (the lite platform runs one).
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from trace_core.authoring.events import DatasetEvent
from trace_core.clock import Clock, SystemClock
from trace_core.dispatcher.events import EventGateway
from trace_core.dispatcher.periodic import PeriodicService, require_positive
from trace_core.errors import ConfigurationError, InvalidInput
from trace_core.storage.column_types import UTCDateTime, Uuid
from trace_core.storage.engine import create_engine
from trace_core.storage.ports.status import OutputVersion
from trace_core.storage.sql import SqlRepository
from trace_core.storage.url import parse_database_url

__all__ = [
    "BufferSink",
    "CheckedBatch",
    "DataDatabase",
    "RecordSchema",
    "RecordWriter",
    "SinkConfig",
    "SinkReport",
    "SqlDatasetBuffer",
    "table_name_of",
]

log = logging.getLogger(__name__)

ColumnType = Literal["text", "int", "float", "bool", "json"]
_SA_TYPES: dict[str, Any] = {
    "text": sa.Text,
    "int": sa.BigInteger,
    "float": sa.Float,
    "bool": sa.Boolean,
    "json": sa.JSON,
}
_PYTHON_TYPES: dict[str, tuple[type, ...]] = {
    "text": (str,),
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "json": (dict, list, str, int, float, bool),
}
_TABLE_PREFIX = "postgres_table:"
_KEY_COLUMNS = ("org_id", "dedupe_key")

_metadata = sa.MetaData()
buffer_batches = sa.Table(
    "trace_buffer_batches",
    _metadata,
    # INTEGER PRIMARY KEY is SQLite's rowid alias; BIGINT identity elsewhere.
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
    sa.Column("dataset_uuid", Uuid(), nullable=False),
    sa.Column("schema_hash", sa.Text(), nullable=False),
    sa.Column("records", sa.JSON(), nullable=False),
    sa.Column("producer_task_id", Uuid(), nullable=False),
    sa.Column("attempt", sa.Integer(), nullable=False),
    sa.Column("published_at", UTCDateTime(), nullable=False),
    sa.Column("written_at", UTCDateTime()),
    sa.Column("rows_written", sa.Integer()),
    sa.Column("error", sa.Text()),
    sa.Index("idx_trace_buffer_batches_pending", "written_at", "id"),
    # Batch ids are the cursors of the dataset's events: never reused, or a
    # new batch after the newest was deleted would repeat a cursor (and its
    # event be taken for a redelivery). SQLite reuses rowids without this.
    sqlite_autoincrement=True,
)
"""The buffer: one row per published batch, deleted once its event is out."""


def table_name_of(location: str) -> str:
    """The table of a ``postgres_table:<table>`` dataset location."""
    if not location.startswith(_TABLE_PREFIX):
        raise InvalidInput("location", f"{location!r} is not a postgres_table location")
    name = location[len(_TABLE_PREFIX) :]
    if not name.isidentifier() or not name.isascii():
        raise InvalidInput("location", f"{name!r} is not a table name")
    return name


@dataclass(frozen=True)
class RecordSchema:
    """The columns of a buffered dataset's records (besides ``org_id`` and
    ``dedupe_key``, which every record has)."""

    name: str
    columns: Mapping[str, ColumnType]

    def __post_init__(self) -> None:
        for column, kind in self.columns.items():
            if column in _KEY_COLUMNS or not column.isidentifier():
                raise ConfigurationError(f"RecordSchema {self.name}: bad column name {column!r}")
            if kind not in _SA_TYPES:
                raise ConfigurationError(f"RecordSchema {self.name}.{column}: unknown type {kind}")

    @property
    def schema_hash(self) -> str:
        """``sha256:<hex>`` of the canonical column list (what producers send)."""
        canonical = json.dumps(sorted(self.columns.items()), separators=(",", ":"))
        return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()

    def table(self, name: str) -> sa.Table:
        """The dataset's table: the key columns, the record columns, ``created_at``."""
        return sa.Table(
            name,
            sa.MetaData(),
            sa.Column("org_id", sa.Text(), nullable=False),
            sa.Column("dedupe_key", sa.Text(), nullable=False),
            *(sa.Column(c, _SA_TYPES[k]()) for c, k in self.columns.items()),
            sa.Column("created_at", UTCDateTime(), nullable=False),
            sa.UniqueConstraint("org_id", "dedupe_key", name=f"uq_{name}_dedupe"[:63]),
        )

    def check(self, record: object, org_id: str, field_name: str) -> dict[str, Any]:
        """The record as a row of the table; :class:`InvalidInput` naming the field."""
        if not isinstance(record, Mapping):
            raise InvalidInput(field_name, "must be an object")
        key = record.get("dedupe_key")
        if not isinstance(key, str) or not 0 < len(key) <= 512:
            raise InvalidInput(f"{field_name}.dedupe_key", "must be a string of 1..512 characters")
        if record.get("org_id", org_id) != org_id:
            raise InvalidInput(f"{field_name}.org_id", "is not the producing job's org")
        row: dict[str, Any] = {"org_id": org_id, "dedupe_key": key}
        for name, value in record.items():
            if name in _KEY_COLUMNS:
                continue
            kind = self.columns.get(name)
            if kind is None:
                raise InvalidInput(f"{field_name}.{name}", f"is not a column of {self.name}")
            allowed = _PYTHON_TYPES[kind]
            if value is not None and (
                not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed)
            ):
                raise InvalidInput(f"{field_name}.{name}", f"must be {kind}")
            row[name] = value
        return row


class DataDatabase:
    """The data database (separate from the state database): an engine and
    the buffer table, created on :meth:`open`."""

    def __init__(self, url: str) -> None:
        self.url = parse_database_url(url)
        self.engine: AsyncEngine = create_engine(self.url)

    async def open(self) -> None:
        """Create the buffer table if it does not exist."""
        async with self.engine.begin() as conn:
            await conn.run_sync(_metadata.create_all)

    async def close(self) -> None:
        """Dispose of the engine's connections."""
        await self.engine.dispose()

    async def ensure_table(self, conn: AsyncConnection, table: sa.Table) -> None:
        """Create ``table`` (with its unique key) if it does not exist."""
        await conn.run_sync(lambda sync: table.create(sync, checkfirst=True))

    def insert_ignoring_duplicates(self, table: sa.Table) -> Any:
        """``INSERT … ON CONFLICT (org_id, dedupe_key) DO NOTHING`` for this engine."""
        dialect = postgresql if self.url.engine == "postgres" else sqlite
        return dialect.insert(table).on_conflict_do_nothing(index_elements=list(_KEY_COLUMNS))


class SqlDatasetBuffer:
    """A :class:`~trace_core.dispatcher.buffer.DatasetBuffer` on the data database."""

    def __init__(self, data: DataDatabase, *, clock: Clock | None = None) -> None:
        self.data = data
        self.clock = clock or SystemClock()

    async def publish(
        self,
        dataset_uuid: uuid.UUID,
        records: Sequence[Mapping[str, Any]],
        *,
        producer_task_id: uuid.UUID,
        attempt: int,
        schema_hash: str,
    ) -> None:
        """Append the batch durably (one row); the sink does the rest."""
        async with self.data.engine.begin() as conn:
            await conn.execute(
                sa.insert(buffer_batches).values(
                    dataset_uuid=dataset_uuid,
                    schema_hash=schema_hash,
                    records=[dict(r) for r in records],
                    producer_task_id=producer_task_id,
                    attempt=attempt,
                    published_at=self.clock.now(),
                )
            )

    async def pending(self) -> int:
        """Batches not yet through the sink (dead letters excluded)."""
        async with self.data.engine.connect() as conn:
            count = await conn.scalar(
                sa.select(sa.func.count()).where(buffer_batches.c.error.is_(None))
            )
        return int(count or 0)

    async def dead_letters(self) -> list[tuple[int, str]]:
        """``(batch id, error)`` of every batch the sink refused."""
        b = buffer_batches
        async with self.data.engine.connect() as conn:
            rows = await conn.execute(
                sa.select(b.c.id, b.c.error).where(b.c.error.is_not(None)).order_by(b.c.id)
            )
            return [(int(i), str(e)) for i, e in rows]


@dataclass(frozen=True)
class SinkConfig:
    """Sink settings."""

    interval_seconds: float = 0.5
    batch_size: int = 100
    """Batches per pass."""

    def __post_init__(self) -> None:
        require_positive("SinkConfig.interval_seconds", self.interval_seconds)
        if not 1 <= self.batch_size <= 10_000:
            raise ConfigurationError("SinkConfig.batch_size must be within 1..10000")


@dataclass
class SinkReport:
    """What one sink pass did."""

    batches: int = 0
    rows_written: int = 0
    duplicates: int = 0
    events: int = 0
    dead: int = 0


@dataclass
class _Pending:
    id: int
    dataset_uuid: uuid.UUID
    schema_hash: str
    records: Any
    producer_task_id: uuid.UUID
    rows_written: int | None = None
    producer: OutputVersion | None = field(default=None)


@dataclass(frozen=True)
class CheckedBatch:
    """A published batch that passed :meth:`RecordWriter.check`: its rows, ready to insert."""

    producer: OutputVersion
    table: sa.Table
    values: list[dict[str, Any]]


class RecordWriter:
    """Checks a published batch and writes its records into the dataset's table.

    What every sink of buffered datasets does with one batch, whatever its
    buffer (the table here, an SQS queue in the aws profile): the producer's
    org and dataset version come from the state database, the records must
    match a known :class:`RecordSchema`, and the insert ignores rows whose
    ``(org_id, dedupe_key)`` is already there, so a batch written twice adds
    nothing.
    """

    def __init__(
        self,
        data: DataDatabase,
        state: SqlRepository,
        schemas: Sequence[RecordSchema],
        *,
        clock: Clock | None = None,
    ) -> None:
        self.data = data
        self.state = state
        self.clock = clock or SystemClock()
        self.schemas = {s.schema_hash: s for s in schemas}
        self._producers: dict[tuple[uuid.UUID, uuid.UUID], OutputVersion | None] = {}

    async def check(
        self,
        dataset_uuid: uuid.UUID,
        schema_hash: str,
        records: object,
        producer_task_id: uuid.UUID,
    ) -> CheckedBatch:
        """The batch's rows; :class:`InvalidInput` naming the field that is wrong."""
        producer = await self.producer(producer_task_id, dataset_uuid)
        schema_ = self.schemas.get(schema_hash)
        if schema_ is None:
            raise InvalidInput("schema_hash", f"{schema_hash!r} is not a known schema")
        if not isinstance(records, list):
            raise InvalidInput("records", "must be a list")
        org = str(producer.org_id)
        now = self.clock.now()
        values = [
            {**schema_.check(r, org, f"records[{i}]"), "created_at": now}
            for i, r in enumerate(records)
        ]
        return CheckedBatch(producer, schema_.table(table_name_of(producer.location)), values)

    async def insert(self, conn: AsyncConnection, batch: CheckedBatch) -> int:
        """Insert the batch's rows in ``conn``'s transaction (creating the table
        if needed); how many were new."""
        await self.data.ensure_table(conn, batch.table)
        if not batch.values:
            return 0
        # RETURNING counts what was inserted on both engines (an executemany
        # rowcount is not reliable across drivers).
        stmt = self.data.insert_ignoring_duplicates(batch.table).returning(batch.table.c.dedupe_key)
        return len((await conn.execute(stmt, batch.values)).all())

    async def producer(self, task_id: uuid.UUID, dataset: uuid.UUID) -> OutputVersion:
        """The producing job's org and its DAG version's pointer to ``dataset``;
        :class:`InvalidInput` if the task does not produce ``dataset``."""
        key = (task_id, dataset)
        if key not in self._producers:
            async with self.state.read() as tx:
                self._producers[key] = await tx.status.output_version(task_id, dataset)
        found = self._producers[key]
        if found is None:
            raise InvalidInput("dataset_uuid", f"{dataset} is not an output of task {task_id}")
        return found


class BufferSink(PeriodicService):
    """Drains :class:`SqlDatasetBuffer` into the datasets' tables (module docstring)."""

    def __init__(
        self,
        data: DataDatabase,
        state: SqlRepository,
        schemas: Sequence[RecordSchema],
        *,
        gateway: EventGateway | None = None,
        clock: Clock | None = None,
        config: SinkConfig | None = None,
    ) -> None:
        self.config = config or SinkConfig()
        super().__init__(self.config.interval_seconds)
        self.data = data
        self.state = state
        self.clock = clock or SystemClock()
        self.gateway = gateway or EventGateway(state, clock=self.clock)
        self.writer = RecordWriter(data, state, schemas, clock=self.clock)

    async def run_once(self) -> SinkReport:
        """Write pending batches, then emit the events of written ones."""
        report = SinkReport()
        b = buffer_batches
        async with self.data.engine.connect() as conn:
            rows = (
                await conn.execute(
                    sa.select(
                        b.c.id,
                        b.c.dataset_uuid,
                        b.c.schema_hash,
                        b.c.records,
                        b.c.producer_task_id,
                        b.c.rows_written,
                    )
                    .where(b.c.error.is_(None))
                    .order_by(b.c.id)
                    .limit(self.config.batch_size)
                )
            ).all()
        for row in rows:
            batch = _Pending(*row)
            if batch.rows_written is None:
                await self._write(batch, report)
            if batch.rows_written is not None:
                await self._emit(batch, report)
        return report

    async def _write(self, batch: _Pending, report: SinkReport) -> None:
        b = buffer_batches
        try:
            checked = await self.writer.check(
                batch.dataset_uuid, batch.schema_hash, batch.records, batch.producer_task_id
            )
        except InvalidInput as exc:
            async with self.data.engine.begin() as conn:
                await conn.execute(sa.update(b).where(b.c.id == batch.id).values(error=str(exc)))
            log.warning("buffer batch %s refused: %s", batch.id, exc)
            report.dead += 1
            return
        async with self.data.engine.begin() as conn:
            inserted = await self.writer.insert(conn, checked)
            await conn.execute(
                sa.update(b)
                .where(b.c.id == batch.id)
                .values(written_at=self.clock.now(), rows_written=inserted)
            )
        batch.rows_written, batch.producer = inserted, checked.producer
        report.batches += 1
        report.rows_written += inserted
        report.duplicates += len(checked.values) - inserted

    async def _emit(self, batch: _Pending, report: SinkReport) -> None:
        if batch.rows_written:
            producer = batch.producer or await self.writer.producer(
                batch.producer_task_id, batch.dataset_uuid
            )
            event = DatasetEvent(batch.dataset_uuid, producer.dataset_version, cursor=batch.id)
            await self.gateway.accept([event], producer=None)
            report.events += 1
        async with self.data.engine.begin() as conn:
            await conn.execute(sa.delete(buffer_batches).where(buffer_batches.c.id == batch.id))
