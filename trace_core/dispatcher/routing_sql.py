"""Set-based routing: the common case in ONE statement.

When every dependent an event batch reaches reads a single input (so its
task's dedupe key is the event's own unit key, its pinned inputs are its one
edge plus the unit, and it needs no join check) and none of them is paused,
the whole routing decision is a join of the batch's events with its
dependents, which the storage runs set-based
(:meth:`~trace_core.storage.ports.routing.RoutingOps.route_single_input_events`:
one statement on Postgres, a few in the transaction on SQLite). The meaning
is exactly the generic planner's (:mod:`trace_core.dispatcher.routing`);
multi-input joins and paused jobs take the generic path.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Iterable, Mapping, Sequence
from datetime import datetime, timedelta

from trace_core.dispatcher.topology import Dependent, InputEdge
from trace_core.storage.ports.routing import SetRoute, SingleInputJob
from trace_core.storage.protocol import TaskWakeup, Transaction

__all__ = ["SetRoute", "route_in_sql", "set_based", "single_input_jobs"]


def set_based(dependents: Mapping[uuid.UUID, list[tuple[Dependent, InputEdge]]]) -> bool:
    """Whether every dependent reads one input only (no join to check)."""
    return all(len(job.inputs) == 1 for deps in dependents.values() for job, _ in deps)


async def route_in_sql(
    tx: Transaction,
    event_ids: Collection[uuid.UUID],
    not_current: Iterable[uuid.UUID],
    jobs: Sequence[tuple[Dependent, float]],
    *,
    now: datetime,
    wakeup: TaskWakeup,
) -> SetRoute:
    """Route the events ``event_ids`` to ``jobs`` (single-input dependents, each
    with its tier's handicap in seconds); they become ``routed``, except those
    of ``not_current`` (events of versions no live DAG version points at).

    Creates the tasks with their ``task_inputs`` rows and their wake-ups (the
    ``enqueue_task`` rows of :class:`~trace_core.storage.protocol.TaskWakeup`,
    built on the server, so no task id makes a round trip), and stores each
    event's outcome, in the caller's transaction.
    """
    return await tx.routing.route_single_input_events(
        event_ids, list(not_current), single_input_jobs(jobs, now), now=now, wakeup=wakeup
    )


def single_input_jobs(
    jobs: Sequence[tuple[Dependent, float]], now: datetime
) -> list[SingleInputJob]:
    """``jobs`` (single-input dependents, each with its tier's handicap in
    seconds) as the set-based statements take them."""
    return [
        SingleInputJob(
            job_id=job.job_id,
            job_name=job.job_name,
            dataset_version=job.inputs[0].dataset_version,
            pinned=job.inputs[0].pinned,
            max_attempts=job.max_attempts,
            queued_at=now + timedelta(seconds=handicap),
        )
        for job, handicap in jobs
    ]
