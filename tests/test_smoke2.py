from __future__ import annotations

import pytest

from tests.factories import make_job
from trace_core.clock import ManualClock
from trace_core.idempotency import IdempotencyStore
from trace_core.outbox import OutboxRelay
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import TaskQueue

pytestmark = pytest.mark.anyio


async def test_relay(repo: SqlRepository, clock: ManualClock) -> None:
    job = await make_job(repo, clock.now())
    tq = TaskQueue(repo, clock=clock)
    await tq.create([NewTask(job, dedupe_key="a"), NewTask(job, dedupe_key="a")])
    seen = []

    async def h(p):
        seen.append(p)

    relay = OutboxRelay(repo, {"enqueue_task": h}, clock=clock)
    assert await relay.run_once() == 1
    assert len(seen) == 1
    idem = IdempotencyStore(repo, clock=clock)
    r = await idem.begin("s", "k", "h1")
    assert r.first
    await idem.complete("s", "k", "h1", {"job_id": 1})
    r = await idem.begin("s", "k", "h1")
    assert not r.first and r.response == {"job_id": 1}
    ids = await tq.requeue_due()
    assert ids == []
