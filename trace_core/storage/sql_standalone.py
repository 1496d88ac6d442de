"""The standalone area (:mod:`trace_core.storage.ports.standalone`) in SQL, for both engines."""

from __future__ import annotations

import uuid
from datetime import datetime

import sqlalchemy as sa

from trace_core.storage import schema
from trace_core.storage.ports.standalone import StandaloneJob
from trace_core.storage.sql_area import SqlArea

__all__ = ["SqlStandaloneOps"]

STANDALONE_YAML_HASH = "standalone"
"""The ``yaml_hash`` of a standalone DAG version (it has no YAML)."""


class SqlStandaloneOps(SqlArea):
    """:class:`~trace_core.storage.ports.standalone.StandaloneOps` on a SQL transaction."""

    async def insert_current_version_if_absent(
        self, version_id: uuid.UUID, org_id: uuid.UUID, dag_name: str, *, now: datetime
    ) -> None:
        stmt = (
            self._tx.insert(schema.dag_versions)
            .values(
                id=version_id,
                org_id=org_id,
                dag_name=dag_name,
                yaml_hash=STANDALONE_YAML_HASH,
                status="current",
                activated_at=now,
                created_at=now,
            )
            .on_conflict_do_nothing()
        )
        await self._run("create standalone dag version", stmt)

    async def insert_job_if_absent(self, job: StandaloneJob, *, now: datetime) -> None:
        stmt = (
            self._tx.insert(schema.jobs)
            .values(
                id=job.job_id,
                org_id=job.org_id,
                name=job.name,
                dag_name=job.dag_name,
                dag_version_id=job.dag_version_id,
                activation="reactive",
                runtime="dispatcher",
                operator=job.operator,
                config={},
                config_hash=job.config_hash,
                update_strategy="replace",
                max_attempts=job.max_attempts,
                created_at=now,
                updated_at=now,
            )
            .on_conflict_do_nothing()
        )
        await self._run("create standalone job", stmt)

    async def job_exists(self, job_id: uuid.UUID) -> bool:
        j = schema.jobs
        return bool(await self._rows("find job", sa.select(j.c.id).where(j.c.id == job_id)))
