"""The lineage area (:mod:`trace_core.storage.ports.lineage`) in SQL, for both engines.

A transitive read walks one level per statement (breadth first, at most
``max_depth`` statements): lineage graphs are small and shallow, and this
avoids a recursive CTE whose dialects differ.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from trace_core.storage import schema
from trace_core.storage.ports.lineage import LineageRow, NewLineageEdge, TaskOutputs
from trace_core.storage.sql_area import SqlArea

__all__ = ["SqlLineageOps"]

_WIDE = "*"


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
    ) -> None:
        """See :meth:`~trace_core.storage.ports.lineage.LineageOps.record`."""
        cl = schema.column_lineage
        wanted = {(e.output_column, e.input_dataset, e.input_column, job_id) for e in edges}
        # Every partition of a version reports the same lineage: an unchanged
        # set is only read, so repeated completions do not rewrite the rows.
        have = await self._rows(
            "read column lineage",
            sa.select(
                cl.c.output_column, cl.c.input_dataset_uuid, cl.c.input_column, cl.c.job_id
            ).where(cl.c.output_dataset_uuid == output_dataset),
        )
        if {tuple(r) for r in have} == wanted:
            return
        await self._run(
            "replace column lineage",
            sa.delete(cl).where(cl.c.output_dataset_uuid == output_dataset),
        )
        rows = [
            {
                "output_dataset_uuid": output_dataset,
                "output_column": e.output_column,
                "input_dataset_uuid": e.input_dataset,
                "input_column": e.input_column,
                "job_id": job_id,
            }
            for e in sorted(set(edges))
        ]
        if rows:
            await self._run("record column lineage", sa.insert(cl), rows)

    async def task_outputs(self, task_id: uuid.UUID) -> TaskOutputs | None:
        """See :meth:`~trace_core.storage.ports.lineage.LineageOps.task_outputs`."""
        t, j = schema.tasks, schema.jobs
        stmt = sa.select(j.c.id, j.c.output_datasets, j.c.input_datasets)
        stmt = stmt.join(t, t.c.job_id == j.c.id).where(t.c.id == task_id)
        rows = await self._rows("task outputs", stmt)
        if not rows:
            return None
        job_id, outputs, inputs = rows[0]
        return TaskOutputs(
            job_id,
            tuple(uuid.UUID(str(o)) for o in outputs or ()),
            frozenset(uuid.UUID(str(i)) for i in inputs or ()),
        )

    async def upstream(
        self, dataset: uuid.UUID, column: str | None = None, *, max_depth: int = 10
    ) -> list[LineageRow]:
        """See :meth:`~trace_core.storage.ports.lineage.LineageOps.upstream`."""
        cl = schema.column_lineage
        return await self._walk(
            dataset, column, max_depth, cl.c.output_dataset_uuid, cl.c.output_column, up=True
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
    ) -> list[LineageRow]:
        # A frontier of (dataset, column or None for every column); each level
        # is one statement, and a seen set stops cycles and repeats.
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
            rows = await self._rows("read column lineage", _select().where(sa.or_(*conditions)))
            frontier = set()
            for r in rows:
                row = LineageRow(depth, r[0], r[1], r[2], r[3], r[4], r[5], r[6])
                key = (r[4], r[1], r[5], r[3])
                found.setdefault(key, row)
                if up:
                    # an input '*' (the rows as such) leads to all of its lineage
                    frontier.add((r[5], None if r[3] == _WIDE else r[3]))
                else:
                    frontier.add((r[4], None if r[1] == _WIDE else r[1]))
        return sorted(found.values())
