"""The catalog area (:mod:`trace_core.storage.ports.catalog`) in SQL, for both engines.

Every statement carries the org in its ``WHERE`` (tasks through their job's
``org_id``), so the org scope is a property of the SQL.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from typing import Any

import sqlalchemy as sa

from trace_core.storage import schema
from trace_core.storage.ports.catalog import (
    CatalogDag,
    CatalogDagVersion,
    CatalogDataset,
    CatalogDatasetVersion,
    CatalogJob,
    CatalogTask,
)
from trace_core.storage.sql_area import SqlArea

__all__ = ["SqlCatalogOps"]

_V = schema.dag_versions
_C = schema.dag_current_versions
_P = schema.dag_version_datasets
_D = schema.datasets
_DV = schema.dataset_versions
_G = schema.dataset_version_progress
_J = schema.jobs
_T = schema.tasks
_TASK = (
    _T.c.id,
    _T.c.job_id,
    _T.c.status,
    _T.c.attempt,
    _T.c.max_attempts,
    _T.c.partitions,
    _T.c.queued_at,
    _T.c.started_at,
    _T.c.completed_at,
    _T.c.next_retry_at,
    _T.c.error_message,
)
_CHUNK = 500  # job ids per IN list: SQLite caps bound parameters


def _uuids(values: Any) -> tuple[uuid.UUID, ...]:
    return tuple(uuid.UUID(str(v)) for v in values or ())


def _task(row: Any) -> CatalogTask:
    return CatalogTask(
        task_id=row[0],
        job_id=row[1],
        status=str(row[2]),
        attempt=int(row[3]),
        max_attempts=int(row[4]),
        partitions=tuple(str(p) for p in row[5] or ()),
        queued_at=row[6],
        started_at=row[7],
        completed_at=row[8],
        next_retry_at=row[9],
        error_message=row[10],
    )


class SqlCatalogOps(SqlArea):
    """:class:`~trace_core.storage.ports.catalog.CatalogOps` on a SQL transaction."""

    async def dags(self, org_id: uuid.UUID) -> list[CatalogDag]:
        stmt = (
            sa.select(
                _V.c.dag_name,
                _C.c.dag_version_id,
                sa.func.count(_V.c.id),
                sa.func.max(_V.c.created_at),
            )
            .select_from(_V)
            .outerjoin(_C, sa.and_(_C.c.org_id == _V.c.org_id, _C.c.dag_name == _V.c.dag_name))
            .where(_V.c.org_id == org_id)
            .group_by(_V.c.dag_name, _C.c.dag_version_id)
            .order_by(_V.c.dag_name)
        )
        rows = await self._rows("catalog dags", stmt)
        return [CatalogDag(str(r[0]), r[1], int(r[2]), r[3]) for r in rows]

    async def live_dag_yaml(self, org_id: uuid.UUID, dag_name: str) -> str | None:
        stmt = (
            sa.select(_V.c.yaml_text)
            .where(
                _V.c.org_id == org_id,
                _V.c.dag_name == dag_name,
                _V.c.status.in_(["building", "current"]),
            )
            .order_by(_V.c.created_at.desc(), _V.c.id.desc())
            .limit(1)
        )
        rows = await self._rows("live dag yaml", stmt)
        return None if not rows or rows[0][0] is None else str(rows[0][0])

    async def dag_versions(self, org_id: uuid.UUID, dag_name: str) -> list[CatalogDagVersion]:
        stmt = (
            sa.select(
                _V.c.id,
                _V.c.status,
                _V.c.yaml_hash,
                _V.c.created_at,
                _V.c.activated_at,
            )
            .where(_V.c.org_id == org_id, _V.c.dag_name == dag_name)
            .order_by(_V.c.created_at.desc(), _V.c.id.desc())
        )
        versions = await self._rows("catalog dag versions", stmt)
        pointed: dict[uuid.UUID, list[uuid.UUID]] = {}
        if versions:
            pointers = (
                sa.select(_P.c.dag_version_id, _P.c.dataset_uuid)
                .join(_V, _V.c.id == _P.c.dag_version_id)
                .where(_V.c.org_id == org_id, _V.c.dag_name == dag_name)
                .order_by(_P.c.dataset_uuid)
            )
            for version_id, dataset in await self._rows("catalog dag pointers", pointers):
                pointed.setdefault(version_id, []).append(dataset)
        return [
            CatalogDagVersion(
                version_id=r[0],
                dag_name=dag_name,
                status=str(r[1]),
                yaml_hash=str(r[2]),
                created_at=r[3],
                activated_at=r[4],
                datasets=tuple(pointed.get(r[0], ())),
            )
            for r in versions
        ]

    async def datasets(self, org_id: uuid.UUID) -> list[CatalogDataset]:
        # The live version: what the producer DAG's current version points at.
        live = (
            sa.select(_P.c.dataset_uuid, _DV.c.id.label("version"), _DV.c.storage_location)
            .select_from(_P)
            .join(_C, _C.c.dag_version_id == _P.c.dag_version_id)
            .join(_DV, _DV.c.id == _P.c.dataset_version)
            .join(
                _D,
                sa.and_(
                    _D.c.id == _P.c.dataset_uuid,
                    _D.c.producer_dag_name == _C.c.dag_name,
                    _D.c.org_id == _C.c.org_id,
                ),
            )
            .where(_C.c.org_id == org_id)
            .subquery()
        )
        stmt = (
            sa.select(
                _D.c.id,
                _D.c.name,
                _D.c.producer_dag_name,
                _D.c.producer_job_name,
                _D.c.read_roles,
                _D.c.created_at,
                live.c.version,
                live.c.storage_location,
            )
            .outerjoin(live, live.c.dataset_uuid == _D.c.id)
            .where(_D.c.org_id == org_id)
            .order_by(_D.c.name)
        )
        rows = await self._rows("catalog datasets", stmt)
        return [
            CatalogDataset(
                dataset_uuid=r[0],
                name=str(r[1]),
                producer_dag_name=str(r[2]),
                producer_job_name=str(r[3]),
                read_roles=tuple(sorted(r[4] or ())),
                created_at=r[5],
                current_version=r[6],
                location=r[7],
            )
            for r in rows
        ]

    async def dataset_versions(
        self, org_id: uuid.UUID, dataset: uuid.UUID
    ) -> list[CatalogDatasetVersion]:
        stmt = (
            sa.select(
                _DV.c.id,
                _DV.c.config_hash,
                _DV.c.storage_location,
                _DV.c.range_start,
                _DV.c.range_end,
                _DV.c.created_at,
                _G.c.ranges,
                _G.c.max_cursor,
                _G.c.events,
            )
            .select_from(_DV)
            .join(_D, _D.c.id == _DV.c.dataset_uuid)
            .outerjoin(_G, _G.c.dataset_version == _DV.c.id)
            .where(_D.c.org_id == org_id, _DV.c.dataset_uuid == dataset)
            .order_by(_DV.c.created_at.desc(), _DV.c.id.desc())
        )
        rows = await self._rows("catalog dataset versions", stmt)
        return [
            CatalogDatasetVersion(
                version_id=r[0],
                config_hash=str(r[1]),
                location=str(r[2]),
                range_start=r[3],
                range_end=r[4],
                created_at=r[5],
                ranges=list(r[6] or []),
                max_cursor=r[7],
                events=int(r[8] or 0),
            )
            for r in rows
        ]

    async def jobs(self, org_id: uuid.UUID) -> list[CatalogJob]:
        stmt = (
            sa.select(
                _J.c.id,
                _J.c.name,
                _J.c.dag_name,
                _J.c.dag_version_id,
                _V.c.status,
                _J.c.input_datasets,
                _J.c.output_datasets,
            )
            .join(_V, _V.c.id == _J.c.dag_version_id)
            .where(_J.c.org_id == org_id)
            .order_by(_J.c.dag_name, _J.c.name, _J.c.id)
        )
        rows = await self._rows("catalog jobs", stmt)
        return [
            CatalogJob(r[0], str(r[1]), str(r[2]), r[3], str(r[4]), _uuids(r[5]), _uuids(r[6]))
            for r in rows
        ]

    async def tasks(
        self,
        org_id: uuid.UUID,
        job_ids: Collection[uuid.UUID],
        *,
        status: str | None,
        limit: int,
    ) -> list[CatalogTask]:
        wanted = sorted(set(job_ids))
        found: list[CatalogTask] = []
        for start in range(0, len(wanted), _CHUNK):
            stmt = (
                sa.select(*_TASK)
                .join(_J, _J.c.id == _T.c.job_id)
                .where(_J.c.org_id == org_id, _T.c.job_id.in_(wanted[start : start + _CHUNK]))
                .order_by(_T.c.queued_at.desc(), _T.c.id.desc())
                .limit(limit)
            )
            if status is not None:
                stmt = stmt.where(_T.c.status == status)
            found += [_task(r) for r in await self._rows("catalog tasks", stmt)]
        # Each chunk is ordered and limited; merged, the first ``limit`` are the answer.
        found.sort(key=lambda t: (t.queued_at, t.task_id), reverse=True)
        return found[:limit]

    async def task(self, org_id: uuid.UUID, task_id: uuid.UUID) -> CatalogTask | None:
        stmt = sa.select(*_TASK).join(_J, _J.c.id == _T.c.job_id)
        stmt = stmt.where(_J.c.org_id == org_id, _T.c.id == task_id)
        rows = await self._rows("catalog task", stmt)
        return _task(rows[0]) if rows else None
