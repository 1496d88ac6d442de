"""Task batches on both engines: the edges of creating many tasks in one call.

On Postgres a batch of any size is one statement (``sql_task_create``); on
SQLite one transaction of executemany. Both must answer alike: the same
``created`` flags and ids, the same rows, the same wake-up rows.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from tests.factories import make_job
from trace_core.clock import ManualClock
from trace_core.errors import DuplicateItem
from trace_core.storage import schema
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import ENQUEUE_TASK, WAKEUP_CHUNK, TaskQueue

pytestmark = pytest.mark.anyio


async def woken(repo: SqlRepository) -> list[list[str]]:
    """The task ids of every wake-up row, one list per row, in row order."""
    o = schema.outbox
    async with repo.read() as tx:
        rows = await tx.connection.execute(
            sa.select(o.c.payload).where(o.c.kind == ENQUEUE_TASK).order_by(o.c.id)
        )
        return [list(r.payload["task_ids"]) for r in rows]


async def stored(repo: SqlRepository) -> dict[uuid.UUID, Any]:
    t = schema.tasks
    cols = (t.c.id, t.c.job_id, t.c.dedupe_key, t.c.status, t.c.attempt, t.c.claim_version)
    more = (t.c.partitions, t.c.input_versions, t.c.max_attempts, t.c.created_at, t.c.queued_at)
    async with repo.read() as tx:
        rows = await tx.connection.execute(sa.select(*cols, *more))
        return {r.id: r for r in rows}


async def test_an_empty_batch_writes_nothing(repo: SqlRepository, clock: ManualClock) -> None:
    await make_job(repo, clock.now())
    assert await TaskQueue(repo, clock=clock).create([]) == []
    assert await stored(repo) == {}
    assert await woken(repo) == []


async def test_a_key_repeated_in_one_batch_is_one_task(
    repo: SqlRepository, clock: ManualClock
) -> None:
    job = await make_job(repo, clock.now())
    made = await TaskQueue(repo, clock=clock).create(
        [NewTask(job, dedupe_key="a"), NewTask(job, dedupe_key="b"), NewTask(job, dedupe_key="a")]
    )
    assert [c.created for c in made] == [True, True, False]
    assert [c.dedupe_key for c in made] == ["a", "b", "a"]
    assert made[2].task_id == made[0].task_id != made[1].task_id
    rows = await stored(repo)
    assert set(rows) == {made[0].task_id, made[1].task_id}
    assert rows[made[0].task_id].dedupe_key == "a"
    assert await woken(repo) == [[str(made[0].task_id), str(made[1].task_id)]]


async def test_a_batch_mixing_new_and_taken_keys(repo: SqlRepository, clock: ManualClock) -> None:
    job = await make_job(repo, clock.now())
    tq = TaskQueue(repo, clock=clock)
    (old,) = await tq.create([NewTask(job, dedupe_key="old")])
    made = await tq.create(
        [
            NewTask(job, dedupe_key="new"),
            NewTask(job, dedupe_key="old"),
            NewTask(job),
            NewTask(job),
        ]
    )
    assert [c.created for c in made] == [True, False, True, True]
    assert made[1].task_id == old.task_id
    assert len({c.task_id for c in made}) == 4
    assert len(await stored(repo)) == 4
    # the taken key's task is not woken again
    assert await woken(repo) == [
        [str(old.task_id)],
        [str(made[0].task_id), str(made[2].task_id), str(made[3].task_id)],
    ]


async def test_a_batch_with_only_taken_keys_writes_no_wakeup(
    repo: SqlRepository, clock: ManualClock
) -> None:
    job = await make_job(repo, clock.now())
    tq = TaskQueue(repo, clock=clock)
    first = await tq.create([NewTask(job, dedupe_key=k) for k in "xy"])
    again = await tq.create([NewTask(job, dedupe_key=k) for k in "yx"])
    assert [c.created for c in again] == [False, False]
    assert [c.task_id for c in again] == [first[1].task_id, first[0].task_id]
    assert len(await woken(repo)) == 1


async def test_a_large_batch_is_woken_in_chunks_in_input_order(
    repo: SqlRepository, clock: ManualClock
) -> None:
    job = await make_job(repo, clock.now())
    count = 2 * WAKEUP_CHUNK + 1
    made = await TaskQueue(repo, clock=clock).create(
        [NewTask(job, dedupe_key=f"k{i}") for i in range(count)]
    )
    ids = [str(c.task_id) for c in made]
    assert all(c.created for c in made) and len(set(ids)) == count
    assert await woken(repo) == [ids[:WAKEUP_CHUNK], ids[WAKEUP_CHUNK:-1], ids[-1:]]
    assert len(await stored(repo)) == count


async def test_every_column_of_a_mixed_batch_is_stored(
    repo: SqlRepository, clock: ManualClock
) -> None:
    a = await make_job(repo, clock.now(), name="a")
    b = await make_job(repo, clock.now(), name="b")
    now = clock.now()
    pinned = {"ds": {"version": str(uuid.UUID(int=7)), "partitions": ["p1"]}}
    tasks = [
        NewTask(a),
        NewTask(b, dedupe_key='q"uo,te\\{}', partitions=["p1", "p,2", ""], max_attempts=5),
        NewTask(a, input_versions=pinned, handicap_seconds=30.5),
        NewTask(b, partitions=[]),
    ]
    made = await TaskQueue(repo, clock=clock).create(tasks)
    rows = await stored(repo)
    got = [rows[c.task_id] for c in made]
    assert [r.job_id for r in got] == [a, b, a, b]
    assert [r.dedupe_key for r in got] == [None, 'q"uo,te\\{}', None, None]
    assert [r.partitions for r in got] == [None, ["p1", "p,2", ""], None, []]
    assert [r.input_versions for r in got] == [None, None, pinned, None]
    assert [r.max_attempts for r in got] == [3, 5, 3, 3]
    assert [(r.status, r.attempt, r.claim_version) for r in got] == [("Queued", 1, 0)] * 4
    assert all(r.created_at == now for r in got)
    assert [r.queued_at - now for r in got] == [
        timedelta(0),
        timedelta(0),
        timedelta(seconds=30.5),
        timedelta(0),
    ]


@pytest.mark.parametrize(
    ("size", "key"),
    [(1, "x"), (WAKEUP_CHUNK + 1, None)],
    ids=["one-keyed-task", "beyond-a-wakeup-chunk"],
)
async def test_a_batch_in_a_transaction_rolls_back_whole_with_its_wakeups(
    repo: SqlRepository, clock: ManualClock, size: int, key: str | None
) -> None:
    job = await make_job(repo, clock.now())
    tq = TaskQueue(repo, clock=clock)

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        async with repo.transaction() as tx:
            made = await tq.create([NewTask(job, dedupe_key=key) for _ in range(size)], tx=tx)
            assert len(made) == size
            raise Boom
    assert await stored(repo) == {}
    assert await woken(repo) == []


async def test_a_task_of_an_unknown_job_fails_the_whole_batch(
    repo: SqlRepository, clock: ManualClock
) -> None:
    job = await make_job(repo, clock.now())
    with pytest.raises(DuplicateItem, match="constraint violated"):
        await TaskQueue(repo, clock=clock).create(
            [NewTask(job) for _ in range(3)] + [NewTask(uuid.uuid4())]
        )
    assert await stored(repo) == {}
    assert await woken(repo) == []


async def test_taken_keys_are_found_once_the_statement_is_prepared(
    repo: SqlRepository, clock: ManualClock
) -> None:
    """psycopg prepares a statement after a few executions (then the server
    may plan it generically): the answer for taken keys must not change."""
    job = await make_job(repo, clock.now())
    tq = TaskQueue(repo, clock=clock)
    first = [await tq.create([NewTask(job, dedupe_key=f"k{i}"), NewTask(job)]) for i in range(8)]
    again = await tq.create(
        [
            NewTask(job, dedupe_key="k3"),
            NewTask(job, dedupe_key="new"),
            NewTask(job, dedupe_key="k3"),
        ]
    )
    assert [c.created for c in again] == [False, True, False]
    assert again[0].task_id == again[2].task_id == first[3][0].task_id
    assert len(await stored(repo)) == 17
    assert (await woken(repo))[-1] == [str(again[1].task_id)]
