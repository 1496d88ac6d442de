"""Tasks on both engines: dedupe keys, wake-up outbox rows, transactions."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import sqlalchemy as sa

from tests.factories import make_job
from trace_core.clock import ManualClock
from trace_core.errors import ConfigurationError
from trace_core.leasing import LeaseConfig
from trace_core.retry import Backoff, RetryPolicy
from trace_core.storage import schema
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import ENQUEUE_TASK, TaskQueue

pytestmark = pytest.mark.anyio


async def outbox_payloads(repo: SqlRepository) -> list[dict[str, Any]]:
    async with repo.read() as tx:
        rows = await tx.connection.execute(
            sa.select(schema.outbox.c.kind, schema.outbox.c.payload).order_by(schema.outbox.c.id)
        )
        return [dict(r.payload) for r in rows if r.kind == ENQUEUE_TASK]


async def task_count(repo: SqlRepository) -> int:
    async with repo.read() as tx:
        return int(
            (
                await tx.connection.execute(sa.select(sa.func.count()).select_from(schema.tasks))
            ).scalar_one()
        )


async def test_one_task_per_dedupe_key(repo: SqlRepository, clock: ManualClock) -> None:
    job = await make_job(repo, clock.now())
    tq = TaskQueue(repo, clock=clock)
    first = await tq.create([NewTask(job, dedupe_key="partition:d:v:0-9")])
    again = await tq.create(
        [NewTask(job, dedupe_key="partition:d:v:0-9"), NewTask(job, dedupe_key="partition:d:v:0-9")]
    )
    assert first[0].created
    assert [c.created for c in again] == [False, False]
    assert {c.task_id for c in again} == {first[0].task_id}
    assert await task_count(repo) == 1
    assert await outbox_payloads(repo) == [{"task_ids": [str(first[0].task_id)]}]


async def test_a_taken_key_in_a_batch_after_new_ones_answers_the_holder(
    repo: SqlRepository, clock: ManualClock
) -> None:
    # On Postgres a batch after one whose keys were all new is first tried as a
    # plain insert; a taken key makes it fail whole, and the ON CONFLICT form
    # answers instead. Either way: the same answer, and nothing of the failed
    # attempt is left.
    job = await make_job(repo, clock.now())
    tq = TaskQueue(repo, clock=clock)
    first = await tq.create([NewTask(job, dedupe_key=k) for k in ("a", "b", "c")])
    assert all(c.created for c in first) and repo.keys_were_new
    mixed = await tq.create([NewTask(job, dedupe_key=k) for k in ("d", "b", "e")])
    assert [c.created for c in mixed] == [True, False, True]
    assert mixed[1].task_id == first[1].task_id
    if repo.engine_name == "postgres":
        assert not repo.keys_were_new  # the next keyed batch takes the ON CONFLICT form
    repeat = await tq.create([NewTask(job, dedupe_key=k) for k in ("f", "a")])
    assert [c.created for c in repeat] == [True, False]
    assert repo.keys_were_new is (repo.engine_name == "sqlite")  # Postgres: still repeats
    fresh = await tq.create([NewTask(job, dedupe_key=k) for k in ("g", "h")])
    assert all(c.created for c in fresh) and repo.keys_were_new
    created = [c.task_id for c in first + mixed + repeat + fresh if c.created]
    assert await task_count(repo) == len(created) == 8
    woken = [t for p in await outbox_payloads(repo) for t in p["task_ids"]]
    assert sorted(woken) == sorted(map(str, created))


async def test_same_key_in_another_job_is_another_task(
    repo: SqlRepository, clock: ManualClock
) -> None:
    a = await make_job(repo, clock.now(), name="a")
    b = await make_job(repo, clock.now(), name="b")
    tq = TaskQueue(repo, clock=clock)
    created = await tq.create([NewTask(a, dedupe_key="k"), NewTask(b, dedupe_key="k")])
    assert all(c.created for c in created)
    assert created[0].task_id != created[1].task_id


async def test_concurrent_creators_race_safely(
    database_url: str, repo: SqlRepository, clock: ManualClock
) -> None:
    """Many connections create the same keys at once: one task per key."""
    job = await make_job(repo, clock.now())
    repos = [SqlRepository(database_url) for _ in range(4)]
    results: list[list[object]] = []

    async def creator(r: SqlRepository) -> None:
        tq = TaskQueue(r, clock=clock)
        created = await tq.create([NewTask(job, dedupe_key=f"k{i}") for i in range(25)])
        results.append([c.task_id for c in created])

    try:
        async with anyio.create_task_group() as tg:
            for r in repos:
                tg.start_soon(creator, r)
    finally:
        for r in repos:
            await r.close()
    assert all(ids == results[0] for ids in results)
    assert await task_count(repo) == 25
    # exactly one wake-up per task, written by whichever creator inserted it
    woken = [t for p in await outbox_payloads(repo) for t in p["task_ids"]]
    assert sorted(woken) == sorted(str(t) for t in results[0])


async def test_retry_requeue_writes_a_wakeup(repo: SqlRepository, clock: ManualClock) -> None:
    job = await make_job(repo, clock.now())
    retry = RetryPolicy(normal=Backoff(base_seconds=5, cap_seconds=5, jitter=0))
    tq = TaskQueue(repo, clock=clock, retry=retry, config=LeaseConfig(lease_seconds=10))
    [created] = await tq.create([NewTask(job, max_attempts=3)])
    [lease] = await tq.claim_batch("w1", 1)
    await tq.fail(lease.fence, "transient")
    assert await tq.requeue_due() == []
    clock.advance(5)
    assert await tq.requeue_due() == [created.task_id]
    assert await outbox_payloads(repo) == [{"task_ids": [str(created.task_id)]}] * 2


async def test_completion_stores_outputs(repo: SqlRepository, clock: ManualClock) -> None:
    job = await make_job(repo, clock.now())
    tq = TaskQueue(repo, clock=clock)
    await tq.create([NewTask(job, partitions=["0-9"], input_versions={"d": "v1"})])
    [lease] = await tq.claim_batch("w1", 1)
    assert lease.data["partitions"] == ["0-9"]
    assert lease.data["input_versions"] == {"d": "v1"}
    outputs = [{"output_index": 0, "row_count": 10}]
    await tq.complete(lease.fence, outputs=outputs)
    async with repo.read() as tx:
        row = (await tx.connection.execute(sa.select(schema.tasks))).one()
    assert row.status == "Completed"
    assert row.outputs == outputs
    assert row.completed_at == clock.now()


@pytest.mark.parametrize(
    ("task", "field"),
    [
        (dict(max_attempts=0), "max_attempts"),
        (dict(dedupe_key="  "), "dedupe_key"),
    ],
)
async def test_bad_new_tasks_are_refused_with_the_field(
    repo: SqlRepository, clock: ManualClock, task: dict[str, object], field: str
) -> None:
    job = await make_job(repo, clock.now())
    tq = TaskQueue(repo, clock=clock)
    with pytest.raises(ConfigurationError, match=rf"tasks\[1\]\.{field}"):
        await tq.create([NewTask(job), NewTask(job, **task)])  # type: ignore[arg-type]
    assert await task_count(repo) == 0


async def test_absent_json_is_sql_null(repo: SqlRepository, clock: ManualClock) -> None:
    job = await make_job(repo, clock.now())
    await TaskQueue(repo, clock=clock).create([NewTask(job)])
    t = schema.tasks
    async with repo.read() as tx:
        nulls = await tx.connection.execute(
            sa.select(sa.func.count()).where(t.c.input_versions.is_(None), t.c.outputs.is_(None))
        )
        assert nulls.scalar_one() == 1


async def test_leases_read_the_same_through_statement_and_transaction(
    repo: SqlRepository, clock: ManualClock
) -> None:
    """A statement() scope runs closer to the driver (Postgres: pg_direct;
    SQLite: sqlite_direct); its leases have the same types, UTC instants and data."""
    job = await make_job(repo, clock.now())
    tq = TaskQueue(repo, clock=clock)
    await tq.create([NewTask(job, input_versions={"n": 1}), NewTask(job, input_versions={"n": 2})])
    direct = await tq.leases.claim_batch("w", 1)
    async with repo.transaction() as tx:
        through_sa = await tq.leases.claim_batch("w", 1, tx=tx)
    assert len(direct) == len(through_sa) == 1
    a, b = direct[0], through_sa[0]
    for field in ("item_id", "attempt", "claim_version", "lease_token", "expires_at"):
        assert type(getattr(a, field)) is type(getattr(b, field)), field
    for key in a.data:
        assert type(a.data[key]) is type(b.data[key]), key
    assert a.expires_at == b.expires_at
    assert a.expires_at.utcoffset() is not None
    assert {a.data["input_versions"]["n"], b.data["input_versions"]["n"]} == {1, 2}


async def test_a_statement_scope_offers_protocol_operations_only(repo: SqlRepository) -> None:
    async with repo.statement() as tx:
        with pytest.raises(ConfigurationError, match=r"autocommit\(\)"):
            _ = tx.connection
    async with repo.autocommit() as tx:
        assert (await tx.connection.execute(sa.select(sa.literal(1)))).scalar() == 1
