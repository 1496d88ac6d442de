"""The read scope chosen by engine (:mod:`trace_core.storage.scopes`), on both engines."""

from __future__ import annotations

import uuid

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


async def test_a_claims_reads_take_no_pooled_connection_on_postgres(repo: SqlRepository) -> None:
    # The reads of every claim (the task with its job, the version pointers,
    # the coverage) are fixed statements: on Postgres they run on the direct
    # path, never through a pooled SQLAlchemy connection.
    unknown = [uuid.uuid4(), uuid.uuid4()]
    async with per_statement_reads(repo) as reads:
        assert await reads.payload.task_rows(unknown) == []
        assert await reads.payload.version_pointers(unknown) == []
        assert await reads.registry.dataset_version_progress(unknown) == {}
        if repo.engine_name == "postgres":
            assert repo.engine.pool.checkedout() == 0
