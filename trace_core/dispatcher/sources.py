"""The source supervisor: keeping ``always_on`` producers running.

The producer run of a job is *one* task (dedupe key ``source-run:{job_id}``)
with a practically unbounded ``max_attempts``: a crash or a lost heartbeat
fails the current attempt, the core's backoff schedules a retry, and the next
claim is a new attempt of the same task. The run id (the task id) therefore
survives restarts, and so does the idempotency of the events it emits
(interface-contracts.md, "Producer identity"); a stale attempt is fenced out.
``job_states`` mirrors the run::

    Pending (task Queued) -> Running (claimed) -> Dead (failed, restart
    scheduled) -> Pending (retry due) -> ...; Running -> Draining (drain())
    -> Stopped (the run completed, or was canceled)

``source_restarts`` counts the attempts of the current run that died. A run
that stopped (drained, finished on its own, canceled by hand) is replaced by a
new run on a later pass, keyed ``source-run:{job_id}:after:{previous run}`` so
concurrent supervisors agree on it; a run that failed terminally (a fatal
error) stays ``Dead`` for a human. Restarting always-on sources is the point.

Cron sources are fired by :class:`~trace_core.dispatcher.cron.CronScheduler`
and manual ones by :class:`~trace_core.dispatcher.manual.ManualTrigger`. What
all source kinds share (the live source jobs, source task creation with the
``bootstrap.reset_outputs`` rule, the stored run) is in
:mod:`trace_core.dispatcher.source_runs`; the ``job_states`` helpers are in
:mod:`trace_core.dispatcher.job_states`.

Paused jobs (backpressure) start no run. Jobs that are no longer live have
their run canceled. Every decision is journaled.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from trace_core.clock import Clock
from trace_core.dispatcher.job_states import RaceLost, by_job_id
from trace_core.dispatcher.periodic import DispatcherService, Handicap, require_positive
from trace_core.dispatcher.source_runs import (
    SourceJob,
    SourceRun,
    SourceState,
    SourceStatus,
    create_source_task,
    derive_status,
    live_source_jobs,
    read_source_states,
    retired_sources,
    source_run_key,
)
from trace_core.errors import ConfigurationError
from trace_core.storage.protocol import Repository
from trace_core.tasks import TaskQueue

__all__ = [
    "SOURCE_RUN_MAX_ATTEMPTS",
    "SourceConfig",
    "SourceDirective",
    "SourceReport",
    "SourceSupervisor",
]

SOURCE_RUN_MAX_ATTEMPTS = 1_000_000_000
"""``max_attempts`` of an always-on run: restarts are unbounded in practice."""


class SourceDirective(StrEnum):
    """What a running source should do, for its heartbeat reply."""

    RUN = "run"
    PAUSE = "pause"
    """Backpressure: stay alive but emit nothing until resumed."""
    STOP = "stop"
    """Shutdown drain: finish cleanly and complete the task."""


@dataclass(frozen=True)
class SourceConfig:
    """Source supervisor settings."""

    interval_seconds: float = 2.0
    """Time between passes: how late a status change or a restart is seen."""
    run_max_attempts: int = SOURCE_RUN_MAX_ATTEMPTS
    """Attempts of one always-on run (each restart is an attempt; the backoff
    between them is the task queue's retry policy)."""
    restart_stopped: bool = True
    """Replace a stopped always-on run (drained, finished, canceled) by a new
    run; off, a stopped source stays stopped until redeployed."""

    def __post_init__(self) -> None:
        require_positive("SourceConfig.interval_seconds", self.interval_seconds)
        if not 1 <= self.run_max_attempts <= 2**31 - 1:
            raise ConfigurationError("SourceConfig.run_max_attempts must be within 1..2**31-1")


@dataclass
class SourceReport:
    """What one supervisor pass did."""

    runs_created: list[uuid.UUID] = field(default_factory=list)
    transitions: list[tuple[uuid.UUID, str | None, str]] = field(default_factory=list)
    """``(job_id, old status, new status)``."""
    retired: list[uuid.UUID] = field(default_factory=list)
    """Jobs no longer live whose run was stopped."""


class SourceSupervisor(DispatcherService):
    """Keeps always-on sources running; stops the runs of non-live jobs."""

    def __init__(
        self,
        repo: Repository,
        *,
        clock: Clock | None = None,
        config: SourceConfig | None = None,
        tasks: TaskQueue | None = None,
        handicap: Handicap | None = None,
    ) -> None:
        self.config = config or SourceConfig()
        super().__init__(
            repo, self.config.interval_seconds, clock=clock, tasks=tasks, handicap=handicap
        )
        """Claim-order handicap of a priority tier (as the router uses)."""
        self._draining = False

    @property
    def draining(self) -> bool:
        """Whether :meth:`drain` was called: no new runs from now on."""
        return self._draining

    async def run_once(self) -> SourceReport:
        """Create missing runs, mirror their status, stop the runs of non-live jobs."""
        now = self.clock.now()
        report = SourceReport()
        async with self.repo.read() as t:
            jobs = await live_source_jobs(t)
            states = await read_source_states(t, [j.job_id for j in jobs])
            retired = await retired_sources(t, {j.job_id for j in jobs})
        for job in jobs:
            state = states.get(job.job_id)
            if job.kind != "always_on":
                continue
            try:
                await self._always_on(job, state, now, report)
            except RaceLost:
                continue  # another supervisor acted on this job first
        for job_id, status, task_id in retired:
            try:
                await self._retire(job_id, status, task_id, now, report)
            except RaceLost:
                continue
        return report

    # --- always_on -----------------------------------------------------------

    async def _always_on(
        self, job: SourceJob, state: SourceState | None, now: datetime, report: SourceReport
    ) -> None:
        paused = state is not None and state.paused
        if state is None or state.run is None:
            if not self._draining and not paused:
                await self._start_run(job, None, now, report)
            return
        run = state.run
        new = derive_status(run, self._draining)
        if new == SourceStatus.STOPPED and state.status == SourceStatus.STOPPED:
            if not self._draining and not paused and self.config.restart_stopped:
                await self._start_run(job, run.task_id, now, report)
            return
        if new == state.status and run.deaths == state.restarts:
            return
        async with self.repo.transaction() as t:
            ok = await t.sources.set_run_status_if_current(
                job.job_id,
                task_id=run.task_id,
                expected=state.status,
                status=str(new),
                restarts=run.deaths,
                now=now,
            )
            if not ok:
                raise RaceLost
            kind, message = _describe(run, state, new)
            await t.journal.append(
                job.job_id,
                kind,
                message,
                now=now,
                detail={
                    "task_id": str(run.task_id),
                    "attempt": run.attempt,
                    "from": state.status,
                    "to": str(new),
                    "restarts": run.deaths,
                },
            )
        report.transitions.append((job.job_id, state.status, str(new)))

    async def _start_run(
        self, job: SourceJob, previous: uuid.UUID | None, now: datetime, report: SourceReport
    ) -> None:
        async with self.repo.transaction() as t:
            created = await create_source_task(
                t,
                self.tasks,
                job,
                source_run_key(job.job_id, previous),
                now=now,
                max_attempts=self.config.run_max_attempts,
                handicap_seconds=self.handicap(job.priority_tier),
            )
            ok = await t.sources.start_run_if_previous(
                job.job_id, previous=previous, task_id=created.task_id, now=now
            )
            if not ok:
                raise RaceLost
            after = f" after run {previous} stopped" if previous else ""
            await t.journal.append(
                job.job_id,
                "source_start",
                f"source run {created.task_id} created{after}; waiting for a worker",
                now=now,
                detail={"task_id": str(created.task_id), "previous": str(previous or "")},
            )
        report.runs_created.append(created.task_id)
        report.transitions.append((job.job_id, None, str(SourceStatus.PENDING)))

    # --- no longer live --------------------------------------------------------

    async def _retire(
        self,
        job_id: uuid.UUID,
        status: str,
        task_id: uuid.UUID | None,
        now: datetime,
        report: SourceReport,
    ) -> None:
        reason = "source job no longer live (its DAG version was superseded)"
        async with self.repo.transaction() as t:
            if not await t.sources.set_source_status_if_status(
                job_id, expected=status, status=str(SourceStatus.STOPPED), now=now
            ):
                raise RaceLost
            canceled: set[Any] = set()
            if task_id is not None:
                canceled = await self.tasks.leases.cancel([task_id], reason=reason, tx=t)
            message = reason + (f"; run {task_id} canceled" if canceled else "")
            await t.journal.append(job_id, "source_retired", message, now=now)
        report.retired.append(job_id)
        report.transitions.append((job_id, status, str(SourceStatus.STOPPED)))

    # --- shutdown and the heartbeat's question ---------------------------------

    async def drain(self) -> list[uuid.UUID]:
        """Shutdown: ask every running source to stop; the jobs now ``Draining``.

        Running runs are marked ``Draining`` (their heartbeat reply becomes
        :attr:`SourceDirective.STOP`; the source finishes and completes its
        task, which the next pass records as ``Stopped``). Runs that are not
        running stay as they are, so the next Dispatcher resumes them with the
        same run id. This supervisor starts no run from now on.
        """
        self._draining = True
        now = self.clock.now()
        drained: list[uuid.UUID] = []
        async with self.repo.transaction() as tx:
            ordered = by_job_id(await tx.sources.running_sources())
            await tx.job_states.lock(ordered)
            for job_id in ordered:
                task_id = await tx.sources.drain_run_if_running(job_id, now=now)
                if task_id is None:
                    continue  # changed since the scan
                drained.append(job_id)
                await tx.journal.append(
                    job_id,
                    "source_draining",
                    f"shutdown: source run {task_id} asked to stop",
                    now=now,
                    detail={"task_id": str(task_id)},
                )
        return drained

    async def directive(self, task_id: uuid.UUID) -> SourceDirective:
        """What the source run ``task_id`` should do (for its heartbeat reply).

        ``STOP`` while its job is draining or stopped, ``PAUSE`` while the job
        is paused by backpressure, else ``RUN`` (also for tasks that are not
        always-on runs).
        """
        async with self.repo.read() as t:
            row = await t.sources.run_directive_state(task_id)
        if row is None:
            return SourceDirective.RUN
        if row[0] in (SourceStatus.DRAINING, SourceStatus.STOPPED):
            return SourceDirective.STOP
        return SourceDirective.PAUSE if row[1] else SourceDirective.RUN


def _describe(run: SourceRun, state: SourceState, new: SourceStatus) -> tuple[str, str]:
    """The journal kind and message of an observed run change."""
    rid = run.task_id
    error = f": {run.error}" if run.error else ""
    if new == SourceStatus.DEAD:
        if run.next_retry_at is not None:
            then = f"restart due at {run.next_retry_at.isoformat()}"
        else:
            then = "no restart: the run failed terminally"
        return "source_dead", f"source run {rid} died on attempt {run.attempt}{error}; {then}"
    if new == SourceStatus.PENDING and run.deaths:
        return (
            "source_restart",
            f"source run {rid} restarting: attempt {run.attempt + 1} queued "
            f"after {run.deaths} failure(s)",
        )
    if new == SourceStatus.RUNNING and run.deaths > state.restarts:
        # The whole death and restart happened between two passes.
        return (
            "source_restart",
            f"source run {rid} restarted: attempt {run.attempt} running "
            f"after {run.deaths} failure(s){error}",
        )
    if new == SourceStatus.RUNNING:
        return "source_running", f"source run {rid} running (attempt {run.attempt})"
    if new == SourceStatus.STOPPED:
        return "source_stopped", f"source run {rid} stopped ({run.status}{error})"
    return f"source_{str(new).lower()}", f"source run {rid} is {new}"
