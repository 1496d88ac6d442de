"""The standalone area of the port (``tx.standalone``) and ``ensure_standalone_job``,
on both engines."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from trace_core.clock import ManualClock
from trace_core.standalone import STANDALONE_DAG, ensure_standalone_job
from trace_core.storage import schema
from trace_core.storage.ports import StandaloneJob
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio


async def test_writes_are_idempotent_and_leave_existing_rows_alone(
    repo: SqlRepository, clock: ManualClock
) -> None:
    org_id, version_id, job_id = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    job = StandaloneJob(job_id, org_id, "j", STANDALONE_DAG, version_id, "noop", "h", 3)
    later = clock.now().replace(year=2030)
    async with repo.transaction() as tx:
        assert await tx.standalone.job_exists(job_id) is False
        await tx.registry.create_org_if_absent(org_id, "acme", now=clock.now())
        for now in (clock.now(), later):
            await tx.standalone.insert_current_version_if_absent(
                version_id, org_id, STANDALONE_DAG, now=now
            )
        await tx.standalone.insert_job_if_absent(job, now=clock.now())
        changed = StandaloneJob(job_id, org_id, "j", STANDALONE_DAG, version_id, "other", "x", 9)
        await tx.standalone.insert_job_if_absent(changed, now=later)
        assert await tx.standalone.job_exists(job_id) is True
        assert await tx.standalone.job_exists(uuid.uuid4()) is False
        v, j = schema.dag_versions, schema.jobs
        versions = (
            await tx.connection.execute(
                sa.select(v.c.status, v.c.activated_at, v.c.yaml_text).where(v.c.org_id == org_id)
            )
        ).all()
        jobs = (
            await tx.connection.execute(
                sa.select(
                    j.c.operator, j.c.max_attempts, j.c.activation, j.c.runtime, j.c.config
                ).where(j.c.org_id == org_id)
            )
        ).all()
    assert [(s, a.replace(tzinfo=None), y) for s, a, y in versions] == [
        ("current", clock.now().replace(tzinfo=None), None)
    ]
    assert [tuple(r) for r in jobs] == [("noop", 3, "reactive", "dispatcher", {})]


async def test_ensure_standalone_job_returns_the_same_id(
    repo: SqlRepository, clock: ManualClock
) -> None:
    first = await ensure_standalone_job(repo, "q", now=clock.now())
    again = await ensure_standalone_job(repo, "q", now=clock.now(), operator="other")
    other = await ensure_standalone_job(repo, "r", now=clock.now())
    assert first == again != other
    async with repo.read() as tx:
        assert await tx.standalone.job_exists(first)
