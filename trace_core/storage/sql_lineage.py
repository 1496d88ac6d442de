"""The lineage area (:mod:`trace_core.storage.ports.lineage`) in SQL, for both engines.

A transitive read walks one level per statement (breadth first, at most
``max_depth`` statements): lineage graphs are small and shallow, and this
avoids a recursive CTE whose dialects differ. Each statement keeps, for
every output dataset it reaches, only its current version's rows (a
correlated subquery: the producer's current pointer, else the newest
version with recorded lineage).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from trace_core.errors import NotFound
from trace_core.storage import schema
from trace_core.storage.ports.lineage import LineageRow, NewLineageEdge, TaskOutputs
from trace_core.storage.sql_area import SqlArea

__all__ = ["SqlLineageOps"]

_WIDE = "*"


def _pointer(dataset_id: sa.ColumnElement[Any]) -> sa.ScalarSelect[Any]:
    """The dataset version ``dataset_id``'s producer DAG's current version points at."""
    d, c, p = (
        schema.datasets.alias("ptr_ds"),
        schema.dag_current_versions,
        schema.dag_version_datasets,
    )
    return (
        sa.select(p.c.dataset_version)
        .select_from(
            d.join(
                c, sa.and_(c.c.org_id == d.c.org_id, c.c.dag_name == d.c.producer_dag_name)
            ).join(p, sa.and_(p.c.dag_version_id == c.c.dag_version_id, p.c.dataset_uuid == d.c.id))
        )
        .where(d.c.id == dataset_id)
        .scalar_subquery()
    )


def _current_lineage_version(dataset_id: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
    """The version of ``dataset_id`` whose lineage reads answer."""
    cl, v = schema.column_lineage.alias("newest_cl"), schema.dataset_versions
    newest = (
        sa.select(cl.c.dataset_version)
        .join(v, v.c.id == cl.c.dataset_version)
        .where(cl.c.output_dataset_uuid == dataset_id)
        .order_by(v.c.created_at.desc(), v.c.id.desc())
        .limit(1)
        .scalar_subquery()
    )
    return sa.func.coalesce(_pointer(dataset_id), newest)


def _select() -> sa.Select[Any]:
    cl = schema.column_lineage
    out_ds = schema.datasets.alias("out_ds")
    in_ds = schema.datasets.alias("in_ds")
    return (
        sa.select(
            out_ds.c.name,
            cl.c.output_column,
            in_ds.c.name,
            cl.c.input_column,
            cl.c.output_dataset_uuid,
            cl.c.input_dataset_uuid,
            cl.c.job_id,
            cl.c.kind,
            cl.c.dataset_version,
        )
        .join(out_ds, out_ds.c.id == cl.c.output_dataset_uuid)
        .join(in_ds, in_ds.c.id == cl.c.input_dataset_uuid)
    )


class SqlLineageOps(SqlArea):
    """Column lineage rows in ``column_lineage``."""

    async def record(
        self,
        output_dataset: uuid.UUID,
        job_id: uuid.UUID | None,
        edges: Sequence[NewLineageEdge],
        *,
        dataset_version: uuid.UUID | None = None,
    ) -> None:
        """See :meth:`~trace_core.storage.ports.lineage.LineageOps.record`."""
        cl = schema.column_lineage
        version = dataset_version or await self._version_to_record(output_dataset)
        wanted = {(e.output_column, e.input_dataset, e.input_column, e.kind, job_id) for e in edges}
        # Every partition of a version reports the same lineage: an unchanged
        # set is only read, so repeated completions do not rewrite the rows.
        mine = sa.and_(cl.c.output_dataset_uuid == output_dataset, cl.c.dataset_version == version)
        have = await self._rows(
            "read column lineage",
            sa.select(
                cl.c.output_column,
                cl.c.input_dataset_uuid,
                cl.c.input_column,
                cl.c.kind,
                cl.c.job_id,
            ).where(mine),
        )
        if {tuple(r) for r in have} == wanted:
            return
        await self._run("replace column lineage", sa.delete(cl).where(mine))
        rows = [
            {
                "output_dataset_uuid": output_dataset,
                "dataset_version": version,
                "output_column": e.output_column,
                "input_dataset_uuid": e.input_dataset,
                "input_column": e.input_column,
                "kind": e.kind,
                "job_id": job_id,
            }
            for e in sorted(set(edges))
        ]
        if rows:
            await self._run("record column lineage", sa.insert(cl), rows)

    async def _version_to_record(self, dataset: uuid.UUID) -> uuid.UUID:
        v = schema.dataset_versions
        newest = (
            sa.select(v.c.id)
            .where(v.c.dataset_uuid == dataset)
            .order_by(v.c.created_at.desc(), v.c.id.desc())
            .limit(1)
            .scalar_subquery()
        )
        stmt = sa.select(
            sa.func.coalesce(_pointer(sa.literal(dataset, schema.datasets.c.id.type)), newest)
        )
        rows = await self._rows("dataset version for lineage", stmt)
        if not rows or rows[0][0] is None:
            raise NotFound(f"dataset {dataset} has no version to record lineage for")
        return uuid.UUID(str(rows[0][0]))

    async def task_outputs(self, task_id: uuid.UUID) -> TaskOutputs | None:
        """See :meth:`~trace_core.storage.ports.lineage.LineageOps.task_outputs`."""
        t, j, p = schema.tasks, schema.jobs, schema.dag_version_datasets
        stmt = sa.select(j.c.id, j.c.output_datasets, j.c.input_datasets, j.c.dag_version_id)
        stmt = stmt.join(t, t.c.job_id == j.c.id).where(t.c.id == task_id)
        rows = await self._rows("task outputs", stmt)
        if not rows:
            return None
        job_id, outputs, inputs, dag_version = rows[0]
        produced = tuple(uuid.UUID(str(o)) for o in outputs or ())
        pointers = await self._rows(
            "task output versions",
            sa.select(p.c.dataset_uuid, p.c.dataset_version).where(
                p.c.dag_version_id == dag_version, p.c.dataset_uuid.in_(produced)
            ),
        )
        versions = {r[0]: r[1] for r in pointers}
        return TaskOutputs(
            job_id,
            produced,
            frozenset(uuid.UUID(str(i)) for i in inputs or ()),
            tuple(versions.get(o) for o in produced),
        )

    async def upstream(
        self,
        dataset: uuid.UUID,
        column: str | None = None,
        *,
        max_depth: int = 10,
        dataset_version: uuid.UUID | None = None,
    ) -> list[LineageRow]:
        """See :meth:`~trace_core.storage.ports.lineage.LineageOps.upstream`."""
        cl = schema.column_lineage
        return await self._walk(
            dataset,
            column,
            max_depth,
            cl.c.output_dataset_uuid,
            cl.c.output_column,
            up=True,
            first_version=dataset_version,
        )

    async def downstream(
        self, dataset: uuid.UUID, column: str | None = None, *, max_depth: int = 10
    ) -> list[LineageRow]:
        """See :meth:`~trace_core.storage.ports.lineage.LineageOps.downstream`."""
        cl = schema.column_lineage
        return await self._walk(
            dataset, column, max_depth, cl.c.input_dataset_uuid, cl.c.input_column, up=False
        )

    async def _walk(
        self,
        dataset: uuid.UUID,
        column: str | None,
        max_depth: int,
        ds_col: sa.ColumnElement[Any],
        name_col: sa.ColumnElement[Any],
        *,
        up: bool,
        first_version: uuid.UUID | None = None,
    ) -> list[LineageRow]:
        # A frontier of (dataset, column or None for every column); each level
        # is one statement, and a seen set stops cycles and repeats.
        cl = schema.column_lineage
        frontier: set[tuple[uuid.UUID, str | None]] = {(dataset, column)}
        seen: set[tuple[uuid.UUID, str | None]] = set()
        found: dict[tuple[Any, ...], LineageRow] = {}
        for depth in range(1, max_depth + 1):
            frontier -= seen
            if not frontier:
                break
            seen |= frontier
            conditions = [
                ds_col == ds
                if col is None
                else sa.and_(ds_col == ds, name_col.in_(sorted({col, _WIDE})))
                for ds, col in frontier
            ]
            if depth == 1 and first_version is not None:
                version: sa.ColumnElement[Any] = cl.c.dataset_version == first_version
            else:
                version = cl.c.dataset_version == _current_lineage_version(cl.c.output_dataset_uuid)
            stmt = _select().where(sa.or_(*conditions), version)
            rows = await self._rows("read column lineage", stmt)
            frontier = set()
            for r in rows:
                row = LineageRow(depth, r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8])
                key = (r[4], r[1], r[5], r[3], r[7])
                found.setdefault(key, row)
                if up:
                    # an input '*' (the rows as such) leads to all of its lineage
                    frontier.add((r[5], None if r[3] == _WIDE else r[3]))
                else:
                    frontier.add((r[4], None if r[1] == _WIDE else r[1]))
        return sorted(found.values())
