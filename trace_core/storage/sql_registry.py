"""The registry area (:mod:`trace_core.storage.ports.registry`) in SQL, for both engines."""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from trace_core.storage import schema
from trace_core.storage.ports.registry import (
    NewDataset,
    NewDatasetVersion,
    RegisteredDataset,
    VersionProgress,
)
from trace_core.storage.sql_area import SqlArea, in_list

__all__ = ["SqlRegistryOps", "progress_of"]


def _same(column: sa.ColumnElement[int], value: int | None) -> sa.ColumnElement[bool]:
    # The UNIQUE constraint treats NULLs as distinct, so an open bound is
    # compared here with IS NULL.
    return column.is_(None) if value is None else column == value


def _progress_statement(engine: str) -> sa.Select[Any]:
    g = schema.dataset_version_progress
    return sa.select(g.c.dataset_version, g.c.ranges, g.c.max_cursor).where(
        in_list(g.c.dataset_version, "versions", engine)
    )


# Built once per engine: every claim of a source task reads it.
_PROGRESS = {engine: _progress_statement(engine) for engine in ("postgres", "sqlite")}


def progress_of(row: Sequence[Any]) -> VersionProgress:
    """A ``(dataset_version, ranges, max_cursor)`` row as recorded progress."""
    return VersionProgress(tuple((int(r[0]), int(r[1])) for r in row[1] or ()), row[2])


class SqlRegistryOps(SqlArea):
    """:class:`~trace_core.storage.ports.registry.RegistryOps` on a SQL transaction."""

    async def find_org(self, slug: str) -> uuid.UUID | None:
        o = schema.orgs
        rows = await self._rows("find org", sa.select(o.c.id).where(o.c.slug == slug))
        return rows[0][0] if rows else None

    async def org_slug_of_job(self, job_id: uuid.UUID) -> str | None:
        j, o = schema.jobs, schema.orgs
        stmt = sa.select(o.c.slug).join(j, j.c.org_id == o.c.id).where(j.c.id == job_id)
        rows = await self._rows("org of job", stmt)
        return str(rows[0][0]) if rows else None

    async def create_org_if_absent(self, org_id: uuid.UUID, slug: str, *, now: datetime) -> None:
        stmt = (
            self._tx.insert(schema.orgs)
            .values(id=org_id, name=slug, slug=slug, settings={}, created_at=now)
            .on_conflict_do_nothing()
        )
        await self._run("create org", stmt)

    async def dataset_names(self, org_id: uuid.UUID) -> set[str]:
        d = schema.datasets
        rows = await self._rows("dataset names", sa.select(d.c.name).where(d.c.org_id == org_id))
        return {row[0] for row in rows}

    async def dataset_names_by_id(
        self, dataset_uuids: Collection[uuid.UUID]
    ) -> dict[uuid.UUID, str]:
        if not dataset_uuids:
            return {}
        d = schema.datasets
        stmt = sa.select(d.c.id, d.c.name).where(d.c.id.in_(list(dataset_uuids)))
        return {row[0]: row[1] for row in await self._rows("dataset names", stmt)}

    async def datasets_named_or_produced_by(
        self,
        org_id: uuid.UUID,
        *,
        names: Collection[str] = (),
        producer_dag: str | None = None,
    ) -> list[RegisteredDataset]:
        d = schema.datasets
        wanted: list[sa.ColumnElement[bool]] = []
        if names:
            wanted.append(d.c.name.in_(sorted(names)))
        if producer_dag is not None:
            wanted.append(d.c.producer_dag_name == producer_dag)
        if not wanted:
            return []
        stmt = sa.select(
            d.c.id,
            d.c.name,
            d.c.producer_dag_name,
            d.c.producer_job_name,
            d.c.producer_output_index,
        ).where(d.c.org_id == org_id, sa.or_(*wanted))
        return [
            RegisteredDataset(row[0], row[1], row[2], row[3], int(row[4]))
            for row in await self._rows("registered datasets", stmt)
        ]

    async def register_datasets_if_absent(self, datasets: Sequence[NewDataset]) -> None:
        if not datasets:
            return
        rows = [
            {
                "id": ds.dataset_uuid,
                "org_id": ds.org_id,
                "name": ds.name,
                "producer_dag_name": ds.producer_dag_name,
                "producer_job_name": ds.producer_job_name,
                "producer_output_index": ds.producer_output_index,
                "storage": dict(ds.storage),
                "read_roles": [],
                "created_at": ds.created_at,
                "updated_at": ds.created_at,
            }
            for ds in datasets
        ]
        await self._run(
            "register datasets", self._tx.insert(schema.datasets).on_conflict_do_nothing(), rows
        )

    async def find_dataset_version(
        self,
        dataset_uuid: uuid.UUID,
        *,
        config_hash: str,
        range_start: int | None,
        range_end: int | None,
    ) -> uuid.UUID | None:
        v = schema.dataset_versions
        stmt = sa.select(v.c.id).where(
            v.c.dataset_uuid == dataset_uuid,
            v.c.config_hash == config_hash,
            _same(v.c.range_start, range_start),
            _same(v.c.range_end, range_end),
        )
        rows = await self._rows("find dataset version", stmt)
        return rows[0][0] if rows else None

    async def insert_dataset_version_if_absent(self, version: NewDatasetVersion) -> bool:
        v = schema.dataset_versions
        # RETURNING, not rowcount: psycopg reports -1 for an INSERT here.
        stmt = (
            self._tx.insert(v)
            .values(
                id=version.version_id,
                dataset_uuid=version.dataset_uuid,
                created_at=version.created_at,
                storage_location=version.storage_location,
                config_hash=version.config_hash,
                range_start=version.range_start,
                range_end=version.range_end,
            )
            .on_conflict_do_nothing()
            .returning(v.c.id)
        )
        return bool(await self._rows("insert dataset version", stmt))

    async def dataset_version_progress(
        self, versions: Collection[uuid.UUID]
    ) -> dict[uuid.UUID, VersionProgress]:
        if not versions:
            return {}
        stmt = _PROGRESS[self.engine_name]
        rows = await self._fixed_rows(
            "dataset version progress", stmt, {"versions": list(versions)}
        )
        return {row[0]: progress_of(row) for row in rows}
