"""The lite buffer and sink of buffered Postgres-data datasets, on both engines.

The sink writes each published batch into the dataset's table once
(``UNIQUE (org_id, dedupe_key)``), emits the dataset event only after the
commit, survives a crash between the two, fills in the producer's org, and
keeps bad batches as dead letters without blocking the ones behind them.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from trace_core.authoring.events import AcceptResult, DatasetEvent
from trace_core.authoring.operators import OperatorRegistry, OperatorSpec
from trace_core.clock import ManualClock
from trace_core.dag import DeployResult, parse_dag
from trace_core.dag.registry import storage_location
from trace_core.dispatcher.service import Dispatcher
from trace_core.storage import schema
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository
from trace_lite.buffered import (
    BufferSink,
    DataDatabase,
    RecordSchema,
    SqlDatasetBuffer,
    table_name_of,
)

pytestmark = pytest.mark.anyio

NOTES = RecordSchema("notes", {"text": "text", "level": "int"})
DAG = """
dag: sinks
jobs:
  - name: produce
    activation: source
    runtime: dispatcher
    operator: noop
    source: { kind: manual }
    outputs:
      - { dataset: notes, kind: postgres_table }
    update_strategy: append
    unique_key: [org_id, dedupe_key]
  - name: other
    activation: source
    runtime: dispatcher
    operator: noop
    source: { kind: manual }
    outputs:
      - { dataset: other_notes, kind: postgres_table }
    update_strategy: append
    unique_key: [org_id, dedupe_key]
"""


@dataclass
class Kit:
    repo: SqlRepository
    dispatcher: Dispatcher
    deployed: DeployResult
    data: DataDatabase
    buffer: SqlDatasetBuffer
    producer: uuid.UUID
    org_id: uuid.UUID

    def sink(self, gateway: Any = None) -> BufferSink:
        return BufferSink(
            self.data,
            self.repo,
            [NOTES],
            gateway=gateway or self.dispatcher.gateway,
            clock=self.dispatcher.clock,
        )

    @property
    def notes(self) -> uuid.UUID:
        return self.deployed.datasets["notes"].dataset_uuid

    async def publish(self, records: Sequence[dict[str, Any]], **kw: Any) -> None:
        await self.buffer.publish(
            kw.get("dataset", self.notes),
            records,
            producer_task_id=kw.get("producer", self.producer),
            attempt=1,
            schema_hash=kw.get("schema_hash", NOTES.schema_hash),
        )

    async def rows(self) -> list[tuple[str, str, str, int]]:
        notes = self.deployed.datasets["notes"]
        location = storage_location(
            "postgres_table",
            storage_root="",
            org_slug="",
            dataset_uuid=notes.dataset_uuid,
            dataset_version=notes.dataset_version,
        )
        table = sa.table(
            table_name_of(location), *map(sa.column, ["org_id", "dedupe_key", "text", "level"])
        )
        async with self.data.engine.connect() as conn:
            result = await conn.execute(
                sa.select(table.c.org_id, table.c.dedupe_key, table.c.text, table.c.level).order_by(
                    table.c.dedupe_key
                )
            )
            return [tuple(r) for r in result]

    async def events(self) -> list[str | None]:
        e = schema.events
        async with self.repo.read() as tx:
            rows = await tx.connection.execute(
                sa.select(e.c.cursor)
                .where(e.c.dataset_uuid == self.notes)
                .order_by(e.c.received_at)
            )
            return [r[0] for r in rows]


@pytest.fixture
async def kit(
    repo: SqlRepository, clock: ManualClock, tmp_path: Path, engine: str
) -> AsyncIterator[Kit]:
    operators = OperatorRegistry([OperatorSpec("noop", lambda ctx: None, source=True)])
    dispatcher = Dispatcher(repo, operators=operators, clock=clock)
    deployed = await dispatcher.deploy(parse_dag(DAG, operators=operators.names()))
    [created] = await dispatcher.tasks.create(
        [NewTask(deployed.jobs["produce"], dedupe_key="run-1")]
    )
    # The data database is another database: a SQLite file, or the test's
    # Postgres database (the sink's statements are the Postgres dialect's there).
    data_url = (
        f"sqlite:///{tmp_path / 'data.db'}"
        if engine == "sqlite"
        else str(repo.url.sync_url.render_as_string(hide_password=False))
    )
    data = DataDatabase(data_url)
    await data.open()
    j = schema.jobs
    async with repo.read() as tx:
        org = (
            await tx.connection.execute(
                sa.select(j.c.org_id).where(j.c.id == deployed.jobs["produce"])
            )
        ).scalar_one()
    try:
        yield Kit(
            repo,
            dispatcher,
            deployed,
            data,
            SqlDatasetBuffer(data, clock=clock),
            created.task_id,
            org,
        )
    finally:
        await data.close()


NOTE_A = {"dedupe_key": "a", "text": "first", "level": 1}
NOTE_B = {"dedupe_key": "b", "text": "second", "level": 2}


async def test_a_republished_batch_adds_no_rows_and_no_event(kit: Kit) -> None:
    await kit.publish([NOTE_A, NOTE_B])
    await kit.publish([NOTE_A, NOTE_B])  # a retry of the producer
    report = await kit.sink().run_once()

    assert (report.batches, report.rows_written, report.duplicates) == (2, 2, 2)
    assert report.events == 1  # only the batch that changed the table
    org = str(kit.org_id)
    assert await kit.rows() == [(org, "a", "first", 1), (org, "b", "second", 2)]
    assert len(await kit.events()) == 1
    assert await kit.buffer.pending() == 0


async def test_a_crash_between_write_and_event_emits_the_event_once_later(kit: Kit) -> None:
    class Down:
        async def accept(self, events: Sequence[DatasetEvent], **kw: Any) -> AcceptResult:
            raise ConnectionError("state database unreachable")

    await kit.publish([NOTE_A])
    with pytest.raises(ConnectionError):
        await kit.sink(gateway=Down()).run_once()
    assert len(await kit.rows()) == 1  # written and committed...
    assert await kit.events() == []  # ...but no event yet
    assert await kit.buffer.pending() == 1

    report = await kit.sink().run_once()  # the restarted sink
    assert (report.rows_written, report.events) == (0, 1)
    assert len(await kit.rows()) == 1
    assert len(await kit.events()) == 1
    assert await kit.buffer.pending() == 0


async def test_bad_batches_become_dead_letters_without_blocking_others(kit: Kit) -> None:
    other_org = str(uuid.uuid4())
    await kit.publish([NOTE_A], schema_hash="sha256:" + "0" * 64)
    await kit.publish([{**NOTE_A, "org_id": other_org}])
    await kit.publish([{**NOTE_A, "colour": "red"}])
    await kit.publish([{"text": "no key"}])
    await kit.publish([NOTE_A], dataset=kit.deployed.datasets["other_notes"].dataset_uuid)
    await kit.publish([{**NOTE_B, "level": "high"}])
    await kit.publish([NOTE_B])  # a good batch behind them

    report = await kit.sink().run_once()
    assert (report.dead, report.rows_written) == (6, 1)
    errors = [error for _, error in await kit.buffer.dead_letters()]
    assert "schema_hash" in errors[0] and "not a known schema" in errors[0]
    assert "records[0].org_id" in errors[1] and "org" in errors[1]
    assert "records[0].colour" in errors[2]
    assert "records[0].dedupe_key" in errors[3]
    assert "dataset_uuid" in errors[4] and "not an output" in errors[4]
    assert "records[0].level" in errors[5] and "int" in errors[5]
    assert [key for _, key, _, _ in await kit.rows()] == ["b"]
    assert await kit.buffer.pending() == 0  # dead letters are not pending


async def test_each_batch_that_adds_rows_gets_its_own_event(kit: Kit) -> None:
    """Batch ids are event cursors: a batch published after the previous one
    was drained (and deleted) must not reuse its id."""
    sink = kit.sink()
    for note in (NOTE_A, NOTE_B, {**NOTE_A, "dedupe_key": "c"}):
        await kit.publish([note])
        assert (await sink.run_once()).events == 1
    cursors = await kit.events()
    assert len(cursors) == 3 and len(set(cursors)) == 3
