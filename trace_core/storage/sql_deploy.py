"""The deploy area (:mod:`trace_core.storage.ports.deploy`) in SQL, for both engines.

The DAG lock is the one dialect difference: Postgres takes a
transaction-scoped advisory lock keyed by the DAG; SQLite needs none, since
its write transactions are serialized by ``BEGIN IMMEDIATE``.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from trace_core.storage import schema
from trace_core.storage.ports.deploy import (
    DagVersionRef,
    DagVersionRow,
    JobOutputs,
    JobRecord,
    LiveVersion,
    LiveVersionJob,
    NewDagVersion,
    Pointers,
)
from trace_core.storage.sql_area import SqlArea

__all__ = ["SqlDeployOps", "dag_lock_key"]

_LIVE = ("current", "building")


def dag_lock_key(org_id: uuid.UUID, dag_name: str) -> int:
    """The Postgres advisory lock key of one DAG (a signed 64-bit integer)."""
    digest = hashlib.sha256(f"trace:dag/{org_id}/{dag_name}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def _uuids(values: Sequence[str] | None) -> tuple[uuid.UUID, ...]:
    return tuple(uuid.UUID(s) for s in values or ())


def _job_record(row: Any) -> JobRecord:
    m = row._mapping
    return JobRecord(
        job_id=m["id"],
        org_id=m["org_id"],
        name=m["name"],
        dag_name=m["dag_name"],
        dag_version_id=m["dag_version_id"],
        activation=m["activation"],
        runtime=m["runtime"],
        operator=m["operator"],
        config_hash=m["config_hash"],
        update_strategy=m["update_strategy"],
        input_datasets=_uuids(m["input_datasets"]),
        output_datasets=_uuids(m["output_datasets"]),
        config=dict(m["config"] or {}),
        source=m["source"],
        bootstrap=m["bootstrap"],
        execution_strategy=m["execution_strategy"],
        idle_timeout=m["idle_timeout"],
        unique_key=tuple(m["unique_key"]) if m["unique_key"] is not None else None,
        scaling=m["scaling"],
        timeout_seconds=m["timeout_seconds"],
        heartbeat_timeout_seconds=m["heartbeat_timeout_seconds"],
        max_attempts=m["max_attempts"],
        backpressure=m["backpressure"],
        priority_tier=m["priority_tier"],
    )


def _job_values(job: JobRecord, now: datetime) -> dict[str, Any]:
    return {
        "id": job.job_id,
        "org_id": job.org_id,
        "name": job.name,
        "dag_name": job.dag_name,
        "dag_version_id": job.dag_version_id,
        "activation": job.activation,
        "runtime": job.runtime,
        "operator": job.operator,
        "source": dict(job.source) if job.source is not None else None,
        "bootstrap": dict(job.bootstrap) if job.bootstrap is not None else None,
        "execution_strategy": job.execution_strategy,
        "idle_timeout": job.idle_timeout,
        "config": dict(job.config),
        "config_hash": job.config_hash,
        "input_datasets": [str(ds) for ds in job.input_datasets],
        "output_datasets": [str(ds) for ds in job.output_datasets],
        "update_strategy": job.update_strategy,
        "unique_key": list(job.unique_key) if job.unique_key is not None else None,
        "scaling": dict(job.scaling) if job.scaling is not None else None,
        "timeout_seconds": job.timeout_seconds,
        "heartbeat_timeout_seconds": job.heartbeat_timeout_seconds,
        "max_attempts": job.max_attempts,
        "created_at": now,
        "updated_at": now,
        "backpressure": dict(job.backpressure) if job.backpressure is not None else None,
        "priority_tier": job.priority_tier,
    }


class SqlDeployOps(SqlArea):
    """:class:`~trace_core.storage.ports.deploy.DeployOps` on a SQL transaction."""

    async def lock_dag_versions(self, org_id: uuid.UUID, dag_name: str) -> None:
        if self.engine_name != "postgres":
            return  # SQLite write transactions are serialized by BEGIN IMMEDIATE
        key = dag_lock_key(org_id, dag_name)
        await self._run("lock dag", sa.select(sa.func.pg_advisory_xact_lock(key)))

    # --- versions ------------------------------------------------------------

    async def version(self, version_id: uuid.UUID) -> DagVersionRow | None:
        dv = schema.dag_versions
        stmt = sa.select(dv.c.org_id, dv.c.dag_name, dv.c.status).where(dv.c.id == version_id)
        rows = await self._rows("dag version", stmt)
        if not rows:
            return None
        return DagVersionRow(version_id, rows[0][0], str(rows[0][1]), str(rows[0][2]))

    async def versions_with_yaml_hash(
        self, org_id: uuid.UUID, dag_name: str, yaml_hash: str
    ) -> list[DagVersionRef]:
        dv = schema.dag_versions
        stmt = (
            sa.select(dv.c.id, dv.c.status)
            .where(
                dv.c.org_id == org_id,
                dv.c.dag_name == dag_name,
                sa.or_(dv.c.yaml_hash == yaml_hash, dv.c.yaml_hash.like(f"{yaml_hash}+%")),
            )
            .order_by(dv.c.created_at.desc())
        )
        return [
            DagVersionRef(row[0], str(row[1])) for row in await self._rows("dag versions", stmt)
        ]

    async def version_ids_with_status(
        self, org_id: uuid.UUID, dag_name: str, status: str
    ) -> list[uuid.UUID]:
        dv = schema.dag_versions
        stmt = sa.select(dv.c.id).where(
            dv.c.org_id == org_id, dv.c.dag_name == dag_name, dv.c.status == status
        )
        return [row[0] for row in await self._rows("dag versions", stmt)]

    async def building_versions(self) -> list[DagVersionRow]:
        dv = schema.dag_versions
        stmt = (
            sa.select(dv.c.id, dv.c.org_id, dv.c.dag_name)
            .where(dv.c.status == "building")
            .order_by(dv.c.created_at, dv.c.id)
        )
        return [
            DagVersionRow(row[0], row[1], str(row[2]), "building")
            for row in await self._rows("building versions", stmt)
        ]

    async def latest_superseded_version(self, org_id: uuid.UUID, dag_name: str) -> uuid.UUID | None:
        dv = schema.dag_versions
        stmt = (
            sa.select(dv.c.id)
            .where(dv.c.org_id == org_id, dv.c.dag_name == dag_name, dv.c.status == "superseded")
            .order_by(sa.nulls_last(dv.c.activated_at.desc()), dv.c.created_at.desc())
            .limit(1)
        )
        rows = await self._rows("superseded dag version", stmt)
        return rows[0][0] if rows else None

    async def insert_version(self, version: NewDagVersion) -> None:
        stmt = sa.insert(schema.dag_versions).values(
            id=version.version_id,
            org_id=version.org_id,
            dag_name=version.dag_name,
            yaml_hash=version.yaml_hash,
            created_at=version.created_at,
            status="building",
            yaml_text=version.yaml_text,
        )
        await self._run("insert dag version", stmt)

    async def _set_status(self, what: str, where: sa.ColumnElement[bool], **values: Any) -> int:
        dv = schema.dag_versions
        return await self._count(what, sa.update(dv).where(where).values(**values))

    async def mark_version_building(self, version_id: uuid.UUID) -> None:
        dv = schema.dag_versions
        await self._set_status(
            "mark dag version building", dv.c.id == version_id, status="building"
        )

    async def mark_version_current(self, version_id: uuid.UUID, *, now: datetime) -> None:
        dv = schema.dag_versions
        await self._set_status(
            "mark dag version current", dv.c.id == version_id, status="current", activated_at=now
        )

    async def mark_version_superseded_if_current(self, version_id: uuid.UUID) -> bool:
        dv = schema.dag_versions
        changed = await self._set_status(
            "supersede dag version",
            sa.and_(dv.c.id == version_id, dv.c.status == "current"),
            status="superseded",
        )
        return changed > 0

    async def mark_versions_abandoned(self, version_ids: Collection[uuid.UUID]) -> None:
        if not version_ids:
            return
        dv = schema.dag_versions
        await self._set_status(
            "abandon dag versions", dv.c.id.in_(list(version_ids)), status="abandoned"
        )

    # --- the current version -------------------------------------------------

    async def current_version_id(self, org_id: uuid.UUID, dag_name: str) -> uuid.UUID | None:
        c = schema.dag_current_versions
        stmt = sa.select(c.c.dag_version_id).where(c.c.org_id == org_id, c.c.dag_name == dag_name)
        rows = await self._rows("current dag version", stmt)
        return rows[0][0] if rows else None

    async def set_current_version(
        self, org_id: uuid.UUID, dag_name: str, version_id: uuid.UUID, *, now: datetime
    ) -> None:
        cur = schema.dag_current_versions
        stmt = (
            self._tx.insert(cur)
            .values(org_id=org_id, dag_name=dag_name, dag_version_id=version_id, updated_at=now)
            .on_conflict_do_update(
                index_elements=[cur.c.org_id, cur.c.dag_name],
                set_={"dag_version_id": version_id, "updated_at": now},
            )
        )
        await self._run("set current dag version", stmt)

    # --- pointer sets --------------------------------------------------------

    async def pointers(self, version_id: uuid.UUID) -> Pointers:
        return (await self.pointers_of_versions([version_id])).get(version_id, {})

    async def pointers_of_versions(
        self, version_ids: Collection[uuid.UUID]
    ) -> dict[uuid.UUID, Pointers]:
        if not version_ids:
            return {}
        p = schema.dag_version_datasets
        stmt = sa.select(p.c.dag_version_id, p.c.dataset_uuid, p.c.dataset_version).where(
            p.c.dag_version_id.in_(list(version_ids))
        )
        found: dict[uuid.UUID, Pointers] = {}
        for version_id, dataset_uuid, dataset_version in await self._rows("pointers", stmt):
            found.setdefault(version_id, {})[dataset_uuid] = dataset_version
        return found

    async def produced_pointers(self, version_id: uuid.UUID, dag_name: str) -> Pointers:
        p, d = schema.dag_version_datasets, schema.datasets
        stmt = (
            sa.select(p.c.dataset_uuid, p.c.dataset_version)
            .join(d, d.c.id == p.c.dataset_uuid)
            .where(p.c.dag_version_id == version_id, d.c.producer_dag_name == dag_name)
        )
        return {row[0]: row[1] for row in await self._rows("produced pointers", stmt)}

    async def producers_current_pointers(
        self, org_id: uuid.UUID, dataset_uuids: Collection[uuid.UUID]
    ) -> Pointers:
        if not dataset_uuids:
            return {}
        d, p, c = schema.datasets, schema.dag_version_datasets, schema.dag_current_versions
        stmt = (
            sa.select(p.c.dataset_uuid, p.c.dataset_version)
            .select_from(
                d.join(
                    c,
                    sa.and_(c.c.org_id == d.c.org_id, c.c.dag_name == d.c.producer_dag_name),
                ).join(
                    p,
                    sa.and_(p.c.dag_version_id == c.c.dag_version_id, p.c.dataset_uuid == d.c.id),
                )
            )
            .where(d.c.org_id == org_id, d.c.id.in_(list(dataset_uuids)))
        )
        return {row[0]: row[1] for row in await self._rows("producers' current pointers", stmt)}

    async def live_dataset_versions(self) -> set[uuid.UUID]:
        p, v = schema.dag_version_datasets, schema.dag_versions
        stmt = (
            sa.select(p.c.dataset_version)
            .join(v, v.c.id == p.c.dag_version_id)
            .where(v.c.status.in_(_LIVE))
            .distinct()
        )
        return {row[0] for row in await self._rows("live dataset versions", stmt)}

    async def insert_pointers(
        self, version_id: uuid.UUID, pointers: Mapping[uuid.UUID, uuid.UUID]
    ) -> None:
        if not pointers:
            return
        rows = [
            {"dag_version_id": version_id, "dataset_uuid": ds, "dataset_version": v}
            for ds, v in pointers.items()
        ]
        await self._run("insert pointers", sa.insert(schema.dag_version_datasets), rows)

    async def update_pointers(
        self, version_id: uuid.UUID, pointers: Mapping[uuid.UUID, uuid.UUID]
    ) -> None:
        p = schema.dag_version_datasets
        for dataset_uuid, dataset_version in pointers.items():
            stmt = (
                sa.update(p)
                .where(p.c.dag_version_id == version_id, p.c.dataset_uuid == dataset_uuid)
                .values(dataset_version=dataset_version)
            )
            await self._run("update pointers", stmt)

    async def repoint_live_consumers(
        self, org_id: uuid.UUID, producer_dag: str, pointers: Mapping[uuid.UUID, uuid.UUID]
    ) -> None:
        dv, p = schema.dag_versions, schema.dag_version_datasets
        consumers = sa.select(dv.c.id).where(
            dv.c.org_id == org_id,
            dv.c.dag_name != producer_dag,
            dv.c.status.in_(_LIVE),
        )
        for dataset_uuid, dataset_version in pointers.items():
            stmt = (
                sa.update(p)
                .where(
                    p.c.dataset_uuid == dataset_uuid,
                    p.c.dag_version_id.in_(consumers),
                    p.c.dataset_version != dataset_version,
                )
                .values(dataset_version=dataset_version)
            )
            await self._run("repoint consumers", stmt)

    # --- jobs ----------------------------------------------------------------

    async def insert_jobs(self, jobs: Sequence[JobRecord], *, now: datetime) -> None:
        if not jobs:
            return
        rows = [_job_values(job, now) for job in jobs]
        await self._run("insert jobs", sa.insert(schema.jobs), rows)

    async def job_ids_by_name(self, version_id: uuid.UUID) -> dict[str, uuid.UUID]:
        j = schema.jobs
        stmt = sa.select(j.c.name, j.c.id).where(j.c.dag_version_id == version_id)
        return {row[0]: row[1] for row in await self._rows("jobs of version", stmt)}

    async def job_outputs(self, version_ids: Collection[uuid.UUID]) -> list[JobOutputs]:
        if not version_ids:
            return []
        j = schema.jobs
        stmt = sa.select(j.c.id, j.c.dag_version_id, j.c.output_datasets).where(
            j.c.dag_version_id.in_(list(version_ids))
        )
        return [
            JobOutputs(row[0], row[1], _uuids(row[2]))
            for row in await self._rows("job outputs", stmt)
        ]

    async def live_versions(self) -> list[LiveVersion]:
        dv, p = schema.dag_versions, schema.dag_version_datasets
        stmt = (
            sa.select(
                dv.c.id,
                dv.c.org_id,
                dv.c.dag_name,
                dv.c.status,
                p.c.dataset_uuid,
                p.c.dataset_version,
            )
            .select_from(dv.outerjoin(p, p.c.dag_version_id == dv.c.id))
            .where(dv.c.status.in_(_LIVE))
        )
        versions: dict[uuid.UUID, LiveVersion] = {}
        for version_id, org_id, dag_name, status, dataset_uuid, dataset_version in await self._rows(
            "live versions", stmt
        ):
            version = versions.get(version_id)
            if version is None:
                version = versions[version_id] = LiveVersion(
                    version_id, org_id, str(dag_name), str(status), {}
                )
            if dataset_uuid is not None:  # a version without pointers (outer join)
                version.pointers[dataset_uuid] = dataset_version
        return list(versions.values())

    async def live_version_jobs(self) -> list[LiveVersionJob]:
        dv, j = schema.dag_versions, schema.jobs
        stmt = (
            sa.select(j, dv.c.status.label("version_status"))
            .join(dv, dv.c.id == j.c.dag_version_id)
            .where(dv.c.status.in_(_LIVE))
            .order_by(j.c.org_id, j.c.dag_name, dv.c.status.desc(), j.c.name)
        )
        return [
            LiveVersionJob(_job_record(row), str(row._mapping["version_status"]))
            for row in await self._rows("live jobs", stmt)
        ]
