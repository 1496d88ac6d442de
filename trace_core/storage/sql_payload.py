"""The payload area (:mod:`trace_core.storage.ports.payload`) in SQL, for both engines."""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from typing import Any

import sqlalchemy as sa

from trace_core.storage import schema
from trace_core.storage.ports.payload import ClaimedView, VersionPointer
from trace_core.storage.sql_area import SqlArea, in_list
from trace_core.storage.sql_registry import progress_of

__all__ = ["SqlPayloadOps"]


def _task_rows_statement(engine: str) -> sa.Select[Any]:
    t, j = schema.tasks, schema.jobs
    return (
        sa.select(
            t.c.id,
            t.c.attempt,
            t.c.status,
            t.c.partitions,
            t.c.input_versions,
            j.c.id.label("job_id"),
            j.c.org_id,
            j.c.name,
            j.c.dag_name,
            j.c.dag_version_id,
            j.c.operator,
            j.c.runtime,
            j.c.config,
            j.c.output_datasets,
            j.c.activation,
            j.c.scaling,
            j.c.heartbeat_timeout_seconds,
            j.c.source,
        )
        .join(j, j.c.id == t.c.job_id)
        .where(in_list(t.c.id, "ids", engine))
    )


def _pointer_columns() -> tuple[sa.ColumnElement[Any], ...]:
    """A pointer's columns: its DAG version and dataset, the version pointed to
    (id, location, range) and the dataset's name."""
    p, v, d = schema.dag_version_datasets, schema.dataset_versions, schema.datasets
    return (
        p.c.dag_version_id,
        p.c.dataset_uuid,
        v.c.id,
        v.c.storage_location,
        v.c.range_start,
        v.c.range_end,
        d.c.name,
    )


def _pointers_statement(engine: str) -> sa.Select[Any]:
    p, v, d = schema.dag_version_datasets, schema.dataset_versions, schema.datasets
    return (
        sa.select(*_pointer_columns())
        .join(v, v.c.id == p.c.dataset_version)
        .join(d, d.c.id == p.c.dataset_uuid)
        .where(in_list(p.c.dag_version_id, "dag_versions", engine))
    )


def _claimed_statement() -> sa.Select[Any]:
    """The task's status and attempt joined to its DAG version's pointers, each
    with its version's recorded progress (``NULL`` when it has none): one row
    per pointer, one row of ``NULL`` pointer columns when the version has
    none, no row when the task is gone. Everything a claim reads after its
    lease, in one statement."""
    t, p, v = schema.tasks, schema.dag_version_datasets, schema.dataset_versions
    d, g = schema.datasets, schema.dataset_version_progress
    pointers = (
        sa.select(
            *_pointer_columns(),
            g.c.dataset_version.label("progress_version"),
            g.c.ranges,
            g.c.max_cursor,
        )
        .join(v, v.c.id == p.c.dataset_version)
        .join(d, d.c.id == p.c.dataset_uuid)
        .outerjoin(g, g.c.dataset_version == p.c.dataset_version)
        .where(p.c.dag_version_id == sa.bindparam("dag_version", type_=p.c.dag_version_id.type))
        .subquery("pointers")
    )
    return (
        sa.select(t.c.status, t.c.attempt, *pointers.c)
        .select_from(t.outerjoin(pointers, sa.true()))
        .where(t.c.id == sa.bindparam("task_id", type_=t.c.id.type))
    )


# Built once per engine: every claim runs them, and building a statement (and
# its cache key) costs more than SQLAlchemy's compiled-cache lookup of a ready
# one; on Postgres they are fixed text, which the direct path runs as it is.
_ENGINES = ("postgres", "sqlite")
_TASK_ROWS = {engine: _task_rows_statement(engine) for engine in _ENGINES}
_TASK_ROW_KEYS = tuple(_TASK_ROWS["postgres"].selected_columns.keys())
_POINTERS = {engine: _pointers_statement(engine) for engine in _ENGINES}
_CLAIMED = _claimed_statement()


class SqlPayloadOps(SqlArea):
    """:class:`~trace_core.storage.ports.payload.PayloadOps` on a SQL transaction."""

    async def task_rows(self, task_ids: Sequence[uuid.UUID]) -> list[dict[str, Any]]:
        if not task_ids:
            return []
        stmt = _TASK_ROWS[self.engine_name]
        rows = await self._fixed_rows("task payload rows", stmt, {"ids": list(task_ids)})
        return [dict(zip(_TASK_ROW_KEYS, row, strict=True)) for row in rows]

    async def version_pointers(self, dag_versions: Collection[uuid.UUID]) -> list[VersionPointer]:
        if not dag_versions:
            return []
        stmt = _POINTERS[self.engine_name]
        rows = await self._fixed_rows(
            "payload pointers", stmt, {"dag_versions": list(dag_versions)}
        )
        return [VersionPointer(*row) for row in rows]

    async def storage_locations(self, versions: Collection[uuid.UUID]) -> dict[uuid.UUID, str]:
        if not versions:
            return {}
        v = schema.dataset_versions
        stmt = sa.select(v.c.id, v.c.storage_location).where(v.c.id.in_(sorted(versions)))
        return {row[0]: row[1] for row in await self._rows("dataset version locations", stmt)}

    async def claimed_view(
        self, task_id: uuid.UUID, dag_version_id: uuid.UUID, *, progress: bool
    ) -> ClaimedView:
        rows = await self._fixed_rows(
            "claimed task read", _CLAIMED, {"task_id": task_id, "dag_version": dag_version_id}
        )
        # A version without pointers is one row whose pointer columns are NULL.
        pointed = [row for row in rows if row[2] is not None]
        return ClaimedView(
            status=rows[0][0] if rows else None,
            attempt=rows[0][1] if rows else 0,
            pointers=[VersionPointer(*row[2:9]) for row in pointed],
            progress=(
                {row[9]: progress_of(row[9:]) for row in pointed if row[9] is not None}
                if progress
                else {}
            ),
        )
