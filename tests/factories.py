"""Rows the protocol tests need around a task: an org, a DAG version, a job."""

from __future__ import annotations

import uuid
from datetime import datetime

import sqlalchemy as sa

from trace_core.storage import schema
from trace_core.storage.sql import SqlRepository


async def make_job(repo: SqlRepository, now: datetime, *, max_attempts: int = 3) -> uuid.UUID:
    """Insert an org, a DAG version and one reactive job; return the job id."""
    org_id, dag_id, job_id = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    async with repo.transaction() as tx:
        conn = tx.connection
        await conn.execute(
            sa.insert(schema.orgs).values(id=org_id, name="Acme", slug=f"acme-{org_id.hex[:8]}",
                                          settings={}, created_at=now)
        )
        await conn.execute(
            sa.insert(schema.dag_versions).values(
                id=dag_id, org_id=org_id, dag_name="demo", yaml_hash="h", created_at=now
            )
        )
        await conn.execute(
            sa.insert(schema.jobs).values(
                id=job_id, org_id=org_id, name="noop", dag_name="demo", dag_version_id=dag_id,
                activation="reactive", runtime="dispatcher", operator="noop", config={},
                config_hash="c", update_strategy="replace", max_attempts=max_attempts,
                created_at=now, updated_at=now,
            )
        )
    return job_id
