from __future__ import annotations

import pytest

from tests.factories import make_job
from trace_core.clock import ManualClock
from trace_core.leasing import LeaseConfig, LeaseQueue
from trace_core.model import TASKS
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio


async def test_claim_complete(repo: SqlRepository, clock: ManualClock) -> None:
    job = await make_job(repo, clock.now())
    async with repo.transaction() as tx:
        created = await tx.create_tasks(
            [NewTask(job, dedupe_key="a"), NewTask(job)], now=clock.now()
        )
    assert all(c.created for c in created)
    q = LeaseQueue(repo, TASKS, clock=clock, config=LeaseConfig(lease_seconds=10))
    leases = await q.claim_batch("w1", 10)
    assert len(leases) == 2
    assert {le.attempt for le in leases} == {1}
    await q.heartbeat(leases[0].fence)
    await q.complete(leases[0].fence)
    done = await q.complete_many([leases[1].fence])
    assert done == {leases[1].item_id}
