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

from trace_core.errors import ConfigurationError, DuplicateItem
from trace_core.storage.ports.standalone import StandaloneJob
from trace_core.storage.protocol import Repository

__all__ = ["STANDALONE_DAG", "ensure_standalone_job"]

STANDALONE_DAG = "standalone"


def _stable_id(*parts: str) -> uuid.UUID:
    return uuid.uuid5(uuid.NAMESPACE_URL, "trace:" + "/".join(parts))


async def ensure_standalone_job(
    repo: Repository,
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
    job = StandaloneJob(
        job_id=job_id,
        org_id=org_id,
        name=name,
        dag_name=STANDALONE_DAG,
        dag_version_id=dag_id,
        operator=operator,
        config_hash=config_hash,
        max_attempts=max_attempts,
    )
    async with repo.transaction() as tx:
        await tx.registry.create_org_if_absent(org_id, org_slug, now=now)
        await tx.standalone.insert_current_version_if_absent(
            dag_id, org_id, STANDALONE_DAG, now=now
        )
        await tx.standalone.insert_job_if_absent(job, now=now)
        if not await tx.standalone.job_exists(job_id):
            # Another row holds the name under another id: nothing was written.
            raise DuplicateItem(
                f"standalone job {name!r} of org {org_slug!r} exists under another id"
            )
    return job_id
