"""The read scope chosen by engine (:mod:`trace_core.storage.scopes`), on both engines."""

from __future__ import annotations

import anyio
import pytest

from tests.test_storage_tasks import jobs
from trace_core.clock import ManualClock
from trace_core.storage.scopes import per_statement_reads
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio


async def test_per_statement_reads_let_a_writer_in_and_see_its_commit(
    repo: SqlRepository, clock: ManualClock
) -> None:
    (job_id,) = await jobs(repo, clock, ("spark", "x"))
    async with per_statement_reads(repo) as reads:
        assert await reads.job_states.pause_state(job_id) == (False, None)
        # Neither an open transaction on Postgres nor SQLite's write lock: a
        # writer gets in at once (bounded: a held write lock would time out).
        with anyio.fail_after(10):
            async with repo.transaction() as tx:
                await tx.job_states.update_if_matches(
                    job_id, {"paused": True, "pause_reason": "ops"}, now=clock.now()
                )
        if repo.engine_name == "postgres":
            # Autocommit: each statement sees what was committed before it.
            assert await reads.job_states.pause_state(job_id) == (True, "ops")
    async with per_statement_reads(repo) as reads:
        assert await reads.job_states.pause_state(job_id) == (True, "ops")
