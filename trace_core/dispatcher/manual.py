"""The manual trigger API: emit events by hand, or start a manual source's task.

dispatcher.md: "Expose manual source API (emits events)". Two ways in:

- :meth:`ManualTrigger.emit` accepts dataset events exactly as a worker's
  would be, through the :class:`~trace_core.dispatcher.events.EventGateway`
  with ``producer=None`` (stored with ``origin = 'manual'``); routing then
  creates the dependent tasks.
- :meth:`ManualTrigger.create_task` creates a task of a live
  ``source.kind: manual`` job with dedupe key ``manual:{key}``: repeating a
  trigger with the same key returns the same task and creates nothing.

A paused job (by backpressure or by hand) refuses new manual tasks (the refusal is
journaled); events are accepted either way, the router holds them.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from trace_core.authoring.events import AcceptResult, DatasetEvent
from trace_core.clock import Clock
from trace_core.dispatcher.events import EventGateway
from trace_core.dispatcher.manual_pause import MANUAL_PREFIX
from trace_core.dispatcher.periodic import service_clock
from trace_core.dispatcher.source_runs import SourceJob, create_source_task, live_source_jobs
from trace_core.errors import ConfigurationError, NotFound
from trace_core.storage.protocol import Repository
from trace_core.tasks import TaskQueue

__all__ = ["ManualRun", "ManualTrigger"]

_MAX_KEY = 256


@dataclass(frozen=True)
class ManualRun:
    """The answer to a manual task trigger."""

    job_id: uuid.UUID
    task_id: uuid.UUID | None
    """The task for the key (new or existing); ``None`` when refused."""
    created: bool
    """False for a repeated key (or a refusal)."""
    refused: str | None = None
    """Why no task was created (the job is paused, and why)."""


class ManualTrigger:
    """Manual events and manual source tasks; see the module docstring."""

    def __init__(
        self,
        repo: Repository,
        *,
        clock: Clock | None = None,
        tasks: TaskQueue | None = None,
        gateway: EventGateway | None = None,
    ) -> None:
        self.repo = repo
        self.clock = service_clock(clock, tasks)
        self.tasks = tasks or TaskQueue(repo, clock=self.clock)
        self.gateway = gateway or EventGateway(repo, clock=self.clock)

    async def emit(self, events: Sequence[DatasetEvent]) -> AcceptResult:
        """Accept ``events`` as manual events (no producer task) and route them."""
        return await self.gateway.accept(events, producer=None)

    async def create_task(
        self, job: str | uuid.UUID, key: str, *, org_id: uuid.UUID | None = None
    ) -> ManualRun:
        """Create the task of manual source ``job`` for ``key`` (idempotent per key).

        ``job`` is a job id, a job name, or ``dag_name/job_name`` when the name
        alone is ambiguous; with ``org_id`` only that org's jobs are looked at
        (another org's job reads as missing). Raises :class:`NotFound` for no such live job and
        :class:`ConfigurationError` for a job that is not a manual source or a
        blank or over-long key.
        """
        if not key.strip() or len(key) > _MAX_KEY:
            raise ConfigurationError(
                f"manual trigger key must be 1..{_MAX_KEY} non-blank characters"
            )
        now = self.clock.now()
        async with self.repo.transaction() as t:
            jobs = await live_source_jobs(t)
            target = _resolve([j for j in jobs if org_id in (None, j.org_id)], job)
            paused, why = await t.job_states.pause_state(target.job_id)
            if paused:
                manual = why is not None and why.startswith(MANUAL_PREFIX)
                reason = f"paused by hand ({why})" if manual else "paused by backpressure"
                await t.journal.append(
                    target.job_id,
                    "manual_refused",
                    f"manual trigger {key!r} refused: {reason}",
                    now=now,
                    detail={"key": key},
                )
                return ManualRun(target.job_id, None, False, reason)
            created = await create_source_task(
                t, self.tasks, target, f"manual:{key}", now=now, inputs={"manual": {"key": key}}
            )
            if created.created:
                await t.journal.append(
                    target.job_id,
                    "manual_task",
                    f"manual trigger {key!r} created task {created.task_id}",
                    now=now,
                    detail={"key": key, "task_id": str(created.task_id)},
                )
        return ManualRun(target.job_id, created.task_id, created.created)


def _resolve(jobs: list[SourceJob], job: str | uuid.UUID) -> SourceJob:
    """The live manual source named by ``job``."""
    if isinstance(job, uuid.UUID):
        found = [j for j in jobs if j.job_id == job]
    elif "/" in job:
        dag, _, name = job.partition("/")
        found = [j for j in jobs if j.dag_name == dag and j.job_name == name]
    else:
        found = [j for j in jobs if j.job_name == job]
    if not found:
        raise NotFound(f"no live source job {str(job)!r}")
    if len(found) > 1:
        # The same job in the current and a building version: the current one.
        current = [j for j in found if j.role == "current"]
        found = current if len(current) == 1 else found
    if len(found) > 1:
        dags = sorted(f"{j.dag_name}/{j.job_name}" for j in found)
        raise ConfigurationError(f"job name {job!r} is ambiguous; name one of {dags}")
    target = found[0]
    if target.kind != "manual":
        raise ConfigurationError(
            f"job {target.dag_name}/{target.job_name} is a {target.kind!r} source, not a manual one"
        )
    return target
