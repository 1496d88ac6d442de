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

from trace_core.clock import Clock
from trace_core.dag.coverage import Coverage, covers, read_coverage
from trace_core.dag.live import LIVE_JOBS_CHANNEL
from trace_core.dag.registry import find_org
from trace_core.errors import ConfigurationError, NotFound
from trace_core.storage.ports import DagVersionRow
from trace_core.storage.protocol import Repository, Transaction
from trace_core.tasks import TaskQueue

__all__ = [
    "CancelTasks",
    "RollbackResult",
    "abandon_versions",
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


async def swap_current(
    tx: Transaction,
    *,
    org_id: uuid.UUID,
    dag_name: str,
    version_id: uuid.UUID,
    now: datetime,
) -> uuid.UUID | None:
    """Make ``version_id`` current; the previous current is superseded. Returns it."""
    deploy = tx.deploy
    previous = await deploy.current_version_id(org_id, dag_name)
    await deploy.set_current_version(org_id, dag_name, version_id, now=now)
    if previous is not None and previous != version_id:
        await deploy.mark_version_superseded_if_current(previous)
    await deploy.mark_version_current(version_id, now=now)
    # Consumers follow the producer's current version (see the module docstring).
    produced = await deploy.produced_pointers(version_id, dag_name)
    await deploy.repoint_live_consumers(org_id, dag_name, produced)
    return previous


async def refresh_external_pointers(
    tx: Transaction, org_id: uuid.UUID, dag_name: str, version_id: uuid.UUID
) -> None:
    """Repoint a version's inputs from other DAGs at their producers' current versions."""
    deploy = tx.deploy
    own = await deploy.produced_pointers(version_id, dag_name)
    external = [ds for ds in await deploy.pointers(version_id) if ds not in own]
    current = await deploy.producers_current_pointers(org_id, external)
    await deploy.update_pointers(version_id, current)


async def abandon_versions(
    tx: Transaction, version_ids: Sequence[uuid.UUID], *, keep: Collection[uuid.UUID]
) -> list[uuid.UUID]:
    """Mark versions abandoned; the unfinished tasks to cancel (see the module docstring).

    ``keep`` is the set of dataset versions that stay live.
    """
    if not version_ids:
        return []
    deploy = tx.deploy
    await deploy.mark_versions_abandoned(version_ids)
    written = await deploy.pointers_of_versions(version_ids)
    kept = set(keep)
    obsolete = [
        job.job_id
        for job in await deploy.job_outputs(version_ids)
        if not any(
            written.get(job.dag_version_id, {}).get(ds) in kept for ds in job.output_datasets
        )
    ]
    return await tx.tasks.unfinished_of_jobs(obsolete)


async def _version_row(tx: Transaction, version_id: uuid.UUID) -> DagVersionRow:
    row = await tx.deploy.version(version_id)
    if row is None:
        raise NotFound(f"dag version {version_id} does not exist")
    return row


async def promote_if_caught_up(
    repo: Repository, dag_version_id: uuid.UUID, *, clock: Clock
) -> bool:
    """Make a building version current once its new dataset versions cover the current ones.

    Caught up means: for every dataset whose version differs from the current
    version's, the new version's coverage (``dataset_version_progress``)
    covers the current one's (:func:`~trace_core.dag.coverage.covers`).
    Datasets the current version does not publish hold nothing back. Returns
    True if the version is current afterwards (already, or swapped now).
    """
    async with repo.transaction() as tx:
        deploy = tx.deploy
        version = await _version_row(tx, dag_version_id)
        org_id, dag_name = version.org_id, version.dag_name
        await deploy.lock_dag_versions(org_id, dag_name)
        status = (await _version_row(tx, dag_version_id)).status  # re-read under the lock
        if status != "building":
            return status == "current"
        current = await deploy.current_version_id(org_id, dag_name)
        if current is not None:
            new = await deploy.produced_pointers(dag_version_id, dag_name)
            old = await deploy.produced_pointers(current, dag_name)
            pairs = [(new[ds], old[ds]) for ds in new if ds in old and old[ds] != new[ds]]
            progress = await read_coverage(tx, {v for pair in pairs for v in pair})
            empty = Coverage()
            if not all(covers(progress.get(n, empty), progress.get(o, empty)) for n, o in pairs):
                return False
        await swap_current(
            tx, org_id=org_id, dag_name=dag_name, version_id=dag_version_id, now=clock.now()
        )
        tx.notify(LIVE_JOBS_CHANNEL)
        return True


async def rollback(
    repo: Repository,
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
        deploy = tx.deploy
        org_id = await find_org(tx, org_slug)
        if org_id is None:
            raise NotFound(f"org '{org_slug}' does not exist")
        await deploy.lock_dag_versions(org_id, dag_name)
        current = await deploy.current_version_id(org_id, dag_name)
        building = await deploy.version_ids_with_status(org_id, dag_name, "building")
        if building and current is not None:
            restored, abandoned = current, building
        else:
            if current is None:
                raise NotFound(f"dag '{dag_name}' has no current version in org '{org_slug}'")
            previous = await deploy.latest_superseded_version(org_id, dag_name)
            if previous is None:
                raise ConfigurationError(f"dag '{dag_name}' has no earlier version to roll back to")
            await refresh_external_pointers(tx, org_id, dag_name, previous)
            await swap_current(
                tx, org_id=org_id, dag_name=dag_name, version_id=previous, now=clock.now()
            )
            restored, abandoned = previous, [current]
        keep = set((await deploy.pointers(restored)).values())
        to_cancel = await abandon_versions(tx, abandoned, keep=keep)
        tx.notify(LIVE_JOBS_CHANNEL)
    if to_cancel:
        await resolve_cancel(repo, clock, cancel)(
            to_cancel, f"rollback of dag '{dag_name}': its version was abandoned"
        )
    return RollbackResult(dag_name, org_slug, restored, tuple(abandoned), tuple(to_cancel))


def resolve_cancel(repo: Repository, clock: Clock, cancel: CancelTasks | None) -> CancelTasks:
    """``cancel``, or the task queue's own cancellation when none is given."""
    return cancel if cancel is not None else TaskQueue(repo, clock=clock).cancel
