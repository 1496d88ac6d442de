"""DAG version activation: swap pointers, promote a caught-up build, roll back.

A DAG version's status moves ``building -> current -> superseded``, or to
``abandoned`` when a rollback or a newer deploy drops it. At most one version
of a DAG is ``current`` (``dag_current_versions`` points at it) and at most
one is ``building``. Every change is one transaction under the DAG's lock,
which notifies :data:`~trace_core.dag.live.LIVE_JOBS_CHANNEL` on commit.

Swapping makes a version current and, since a DAG reading another DAG's
dataset follows that producer's *current* version, repoints the consumers'
live versions at the new dataset versions in the same transaction.

When a version is abandoned, the unfinished tasks (Queued, Running, or
Failed with a retry due) of its jobs are canceled, except those of jobs that
write at least one dataset version still live: their work lands in a version
readers use (a rolled-back-to version shares it), and the restored jobs never
got those tasks. Cancellation goes through the ``cancel`` callable (normally
``TaskQueue(repo, clock=clock).cancel``) after the status change commits, so
a worker holding such a task is fenced out by the task protocol itself.

Re-deploying the YAML of a superseded or abandoned version reactivates that
version through the same swap rule as a new deploy (it swaps at once only if
its dataset versions are the current ones, else it builds and catches up);
``rollback`` is the emergency path that swaps back at once.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from trace_core.clock import Clock
from trace_core.dag.coverage import Coverage, covers, read_coverage
from trace_core.dag.live import LIVE_JOBS_CHANNEL
from trace_core.dag.registry import (
    Pointers,
    current_version_id,
    find_org,
    lock_dag,
    pointers,
    producers_current_pointers,
)
from trace_core.errors import ConfigurationError, NotFound
from trace_core.storage import schema
from trace_core.storage.sql import SqlRepository, SqlTransaction
from trace_core.tasks import TaskQueue

__all__ = [
    "CancelTasks",
    "RollbackResult",
    "abandon_versions",
    "produced_pointers",
    "promote_if_caught_up",
    "refresh_external_pointers",
    "resolve_cancel",
    "rollback",
    "swap_current",
]

CancelTasks = Callable[[list[uuid.UUID], str], Awaitable[Any]]
"""``async (task_ids, reason)``: cancel unfinished tasks (``TaskQueue.cancel``)."""


@dataclass(frozen=True)
class RollbackResult:
    """What a rollback changed."""

    dag_name: str
    org_slug: str
    current_version_id: uuid.UUID
    """The version that is current after the rollback."""
    abandoned_version_ids: tuple[uuid.UUID, ...]
    canceled_task_ids: tuple[uuid.UUID, ...]
    """Tasks handed to ``cancel`` (unfinished tasks of abandoned jobs)."""


async def produced_pointers(
    conn: AsyncConnection, dag_version_id: uuid.UUID, dag_name: str
) -> Pointers:
    """The pointers of the datasets ``dag_name`` produces (external inputs left out)."""
    p, d = schema.dag_version_datasets, schema.datasets
    rows = await conn.execute(
        sa.select(p.c.dataset_uuid, p.c.dataset_version)
        .join(d, d.c.id == p.c.dataset_uuid)
        .where(p.c.dag_version_id == dag_version_id, d.c.producer_dag_name == dag_name)
    )
    return {row[0]: row[1] for row in rows.all()}


async def swap_current(
    tx: SqlTransaction,
    *,
    org_id: uuid.UUID,
    dag_name: str,
    version_id: uuid.UUID,
    now: datetime,
) -> uuid.UUID | None:
    """Make ``version_id`` current; the previous current is superseded. Returns it."""
    conn = tx.connection
    dv, cur = schema.dag_versions, schema.dag_current_versions
    previous = await current_version_id(conn, org_id, dag_name)
    await conn.execute(
        tx.insert(cur)
        .values(org_id=org_id, dag_name=dag_name, dag_version_id=version_id, updated_at=now)
        .on_conflict_do_update(
            index_elements=[cur.c.org_id, cur.c.dag_name],
            set_={"dag_version_id": version_id, "updated_at": now},
        )
    )
    if previous is not None and previous != version_id:
        await conn.execute(
            sa.update(dv)
            .where(dv.c.id == previous, dv.c.status == "current")
            .values(status="superseded")
        )
    await conn.execute(
        sa.update(dv).where(dv.c.id == version_id).values(status="current", activated_at=now)
    )
    await _repoint_consumers(conn, org_id, dag_name, version_id)
    return previous


async def _repoint_consumers(
    conn: AsyncConnection, org_id: uuid.UUID, dag_name: str, version_id: uuid.UUID
) -> None:
    dv, p = schema.dag_versions, schema.dag_version_datasets
    consumers = sa.select(dv.c.id).where(
        dv.c.org_id == org_id,
        dv.c.dag_name != dag_name,
        dv.c.status.in_(["current", "building"]),
    )
    for dataset_uuid, dataset_version in (
        await produced_pointers(conn, version_id, dag_name)
    ).items():
        await conn.execute(
            sa.update(p)
            .where(
                p.c.dataset_uuid == dataset_uuid,
                p.c.dag_version_id.in_(consumers),
                p.c.dataset_version != dataset_version,
            )
            .values(dataset_version=dataset_version)
        )


async def refresh_external_pointers(
    conn: AsyncConnection, org_id: uuid.UUID, dag_name: str, version_id: uuid.UUID
) -> None:
    """Repoint a version's inputs from other DAGs at their producers' current versions."""
    own = await produced_pointers(conn, version_id, dag_name)
    external = [ds for ds in await pointers(conn, version_id) if ds not in own]
    p = schema.dag_version_datasets
    for dataset_uuid, dataset_version in (
        await producers_current_pointers(conn, org_id, external)
    ).items():
        await conn.execute(
            sa.update(p)
            .where(p.c.dag_version_id == version_id, p.c.dataset_uuid == dataset_uuid)
            .values(dataset_version=dataset_version)
        )


async def abandon_versions(
    conn: AsyncConnection, version_ids: Sequence[uuid.UUID], *, keep: Collection[uuid.UUID]
) -> list[uuid.UUID]:
    """Mark versions abandoned; the unfinished tasks to cancel (see the module docstring).

    ``keep`` is the set of dataset versions that stay live.
    """
    if not version_ids:
        return []
    dv, j, p, t = schema.dag_versions, schema.jobs, schema.dag_version_datasets, schema.tasks
    await conn.execute(
        sa.update(dv).where(dv.c.id.in_(list(version_ids))).values(status="abandoned")
    )
    written: dict[tuple[uuid.UUID, uuid.UUID], uuid.UUID] = {
        (row[0], row[1]): row[2]
        for row in (
            await conn.execute(
                sa.select(p.c.dag_version_id, p.c.dataset_uuid, p.c.dataset_version).where(
                    p.c.dag_version_id.in_(list(version_ids))
                )
            )
        ).all()
    }
    jobs = (
        await conn.execute(
            sa.select(j.c.id, j.c.dag_version_id, j.c.output_datasets).where(
                j.c.dag_version_id.in_(list(version_ids))
            )
        )
    ).all()
    kept = set(keep)
    obsolete = [
        job_id
        for job_id, version_id, outputs in jobs
        if not any(written.get((version_id, uuid.UUID(ds))) in kept for ds in outputs or [])
    ]
    if not obsolete:
        return []
    unfinished = sa.or_(
        t.c.status.in_(["Queued", "Running"]),
        sa.and_(t.c.status == "Failed", t.c.next_retry_at.is_not(None)),
    )
    rows = await conn.execute(
        sa.select(t.c.id).where(t.c.job_id.in_(obsolete), unfinished).order_by(t.c.created_at)
    )
    return list(rows.scalars().all())


async def _version_row(conn: AsyncConnection, version_id: uuid.UUID) -> tuple[uuid.UUID, str, str]:
    dv = schema.dag_versions
    row = (
        await conn.execute(
            sa.select(dv.c.org_id, dv.c.dag_name, dv.c.status).where(dv.c.id == version_id)
        )
    ).first()
    if row is None:
        raise NotFound(f"dag version {version_id} does not exist")
    return row[0], str(row[1]), str(row[2])


async def promote_if_caught_up(
    repo: SqlRepository, dag_version_id: uuid.UUID, *, clock: Clock
) -> bool:
    """Make a building version current once its new dataset versions cover the current ones.

    Caught up means: for every dataset whose version differs from the current
    version's, the new version's coverage (``dataset_version_progress``)
    covers the current one's (:func:`~trace_core.dag.coverage.covers`).
    Datasets the current version does not publish hold nothing back. Returns
    True if the version is current afterwards (already, or swapped now).
    """
    async with repo.transaction() as tx:
        conn = tx.connection
        org_id, dag_name, _ = await _version_row(conn, dag_version_id)
        await lock_dag(tx, org_id, dag_name)
        status = (await _version_row(conn, dag_version_id))[2]  # re-read under the lock
        if status != "building":
            return status == "current"
        current = await current_version_id(conn, org_id, dag_name)
        if current is not None:
            new = await produced_pointers(conn, dag_version_id, dag_name)
            old = await produced_pointers(conn, current, dag_name)
            pairs = [(new[ds], old[ds]) for ds in new if ds in old and old[ds] != new[ds]]
            progress = await read_coverage(conn, {v for pair in pairs for v in pair})
            empty = Coverage()
            if not all(covers(progress.get(n, empty), progress.get(o, empty)) for n, o in pairs):
                return False
        await swap_current(
            tx, org_id=org_id, dag_name=dag_name, version_id=dag_version_id, now=clock.now()
        )
        tx.notify(LIVE_JOBS_CHANNEL)
        return True


async def rollback(
    repo: SqlRepository,
    dag_name: str,
    *,
    org_slug: str = "default",
    clock: Clock,
    cancel: CancelTasks | None = None,
) -> RollbackResult:
    """Undo the DAG's last deploy.

    If a version is building, it is abandoned and the current one stays.
    Otherwise the current version is abandoned and the most recently
    superseded one is made current again at once. Unfinished tasks of the
    abandoned version's jobs that write no restored dataset version are
    canceled through ``cancel`` (default: ``TaskQueue(repo, clock=clock).cancel``).
    """
    async with repo.transaction() as tx:
        conn = tx.connection
        org_id = await find_org(conn, org_slug)
        if org_id is None:
            raise NotFound(f"org '{org_slug}' does not exist")
        await lock_dag(tx, org_id, dag_name)
        dv = schema.dag_versions
        current = await current_version_id(conn, org_id, dag_name)
        building = list(
            (
                await conn.execute(
                    sa.select(dv.c.id).where(
                        dv.c.org_id == org_id, dv.c.dag_name == dag_name, dv.c.status == "building"
                    )
                )
            ).scalars()
        )
        if building and current is not None:
            restored, abandoned = current, building
        else:
            if current is None:
                raise NotFound(f"dag '{dag_name}' has no current version in org '{org_slug}'")
            previous = (
                await conn.execute(
                    sa.select(dv.c.id)
                    .where(
                        dv.c.org_id == org_id,
                        dv.c.dag_name == dag_name,
                        dv.c.status == "superseded",
                    )
                    .order_by(sa.nulls_last(dv.c.activated_at.desc()), dv.c.created_at.desc())
                    .limit(1)
                )
            ).scalar_one_or_none()
            if previous is None:
                raise ConfigurationError(f"dag '{dag_name}' has no earlier version to roll back to")
            await refresh_external_pointers(conn, org_id, dag_name, previous)
            await swap_current(
                tx, org_id=org_id, dag_name=dag_name, version_id=previous, now=clock.now()
            )
            restored, abandoned = previous, [current]
        keep = set((await pointers(conn, restored)).values())
        to_cancel = await abandon_versions(conn, abandoned, keep=keep)
        tx.notify(LIVE_JOBS_CHANNEL)
    if to_cancel:
        await resolve_cancel(repo, clock, cancel)(
            to_cancel, f"rollback of dag '{dag_name}': its version was abandoned"
        )
    return RollbackResult(dag_name, org_slug, restored, tuple(abandoned), tuple(to_cancel))


def resolve_cancel(repo: SqlRepository, clock: Clock, cancel: CancelTasks | None) -> CancelTasks:
    """``cancel``, or the task queue's own cancellation when none is given."""
    return cancel if cancel is not None else TaskQueue(repo, clock=clock).cancel
