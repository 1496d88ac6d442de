"""Jobs outside any deployed DAG, for using the task queue on its own.

Every task belongs to a job (``tasks.job_id``). Embedders that want only the
queue (the demo, benchmarks, tests of the protocol) get a job here without
deploying a DAG: an org, a DAG version named ``standalone`` and the job, all
created idempotently.
"""

from __future__ import annotations

import hashlib
import uuid
from datetime import datetime

import sqlalchemy as sa

from trace_core.errors import ConfigurationError
from trace_core.storage import schema
from trace_core.storage.sql import SqlRepository

__all__ = ["STANDALONE_DAG", "ensure_standalone_job"]

STANDALONE_DAG = "standalone"


def _stable_id(*parts: str) -> uuid.UUID:
    return uuid.uuid5(uuid.NAMESPACE_URL, "trace:" + "/".join(parts))


async def ensure_standalone_job(
    repo: SqlRepository,
    name: str,
    *,
    now: datetime,
    org_slug: str = "default",
    operator: str = "noop",
    max_attempts: int = 3,
) -> uuid.UUID:
    """Return the id of job ``name`` in the standalone DAG, creating what is missing.

    Ids are derived from the names, so concurrent callers agree without a race.
    """
    if not name.strip():
        raise ConfigurationError("standalone job name must not be blank")
    if max_attempts < 1:
        raise ConfigurationError("max_attempts must be >= 1")
    org_id = _stable_id("org", org_slug)
    dag_id = _stable_id("dag", org_slug, STANDALONE_DAG)
    job_id = _stable_id("job", org_slug, STANDALONE_DAG, name)
    config_hash = hashlib.sha256(f"{operator}:{max_attempts}".encode()).hexdigest()
    async with repo.transaction() as tx:
        ins = tx.insert
        conn = tx.connection
        await conn.execute(
            ins(schema.orgs)
            .values(id=org_id, name=org_slug, slug=org_slug, settings={}, created_at=now)
            .on_conflict_do_nothing()
        )
        await conn.execute(
            ins(schema.dag_versions)
            .values(
                id=dag_id,
                org_id=org_id,
                dag_name=STANDALONE_DAG,
                yaml_hash="standalone",
                status="current",
                activated_at=now,
                created_at=now,
            )
            .on_conflict_do_nothing()
        )
        await conn.execute(
            ins(schema.jobs)
            .values(
                id=job_id,
                org_id=org_id,
                name=name,
                dag_name=STANDALONE_DAG,
                dag_version_id=dag_id,
                activation="reactive",
                runtime="dispatcher",
                operator=operator,
                config={},
                config_hash=config_hash,
                update_strategy="replace",
                max_attempts=max_attempts,
                created_at=now,
                updated_at=now,
            )
            .on_conflict_do_nothing()
        )
        row = (
            await conn.execute(sa.select(schema.jobs.c.id).where(schema.jobs.c.id == job_id))
        ).scalar_one()
    return uuid.UUID(str(row))
