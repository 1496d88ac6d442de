"""Cron sources: the Dispatcher evaluates ``source.kind: cron`` schedules itself.

dispatcher.md leaves cron to EventBridge in the AWS profile; in the lite
profile :class:`CronScheduler` evaluates schedules with ``cronsim``
(:class:`CronSchedule`: a five-field expression read in ``source.timezone``,
default UTC; fire times are whole seconds, kept in UTC).

Each fire creates one task with dedupe key ``cron:{job_id}:{fire time, UTC
ISO}`` and ``input_versions = {"cron": {"fire_at", "missed"}}``, and moves
``job_states.next_fire_at`` on by a compare-and-set in the same transaction:
neither a restarted Dispatcher nor a second one fires a time twice. A
schedule starts when the scheduler first sees the job (``next_fire_at`` is
set to the first fire after that moment; nothing fires at deploy time).

**Missed fires** (the Dispatcher was down, or the clock jumped): every fire
time in the missed window collapses into *one* fire, for the most recent due
time; the count of the others is reported so it can be journaled. A daily
job that was down for a week runs once, not seven times: a storm of
catch-up runs would compete with the live work it is meant to feed.

A fire that falls due while the job is paused is skipped, not deferred, and
journaled ("paused by backpressure", or "paused by hand" for a manual pause). A draining scheduler
fires nothing (the next Dispatcher fires what is due, once). Jobs that are no
longer live have their schedule cleared.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from trace_core.clock import Clock
from trace_core.dispatcher.job_states import RaceLost
from trace_core.dispatcher.manual_pause import MANUAL_PREFIX
from trace_core.dispatcher.periodic import DispatcherService, Handicap, require_positive
from trace_core.dispatcher.source_runs import (
    SourceJob,
    SourceStatus,
    create_source_task,
    live_source_jobs,
)
from trace_core.errors import ConfigurationError
from trace_core.storage.protocol import Repository
from trace_core.tasks import TaskQueue

__all__ = ["CronConfig", "CronDue", "CronReport", "CronSchedule", "CronScheduler", "cron_key"]

_SECOND = timedelta(seconds=1)


@dataclass(frozen=True)
class CronDue:
    """The fire a due schedule makes now."""

    fire_at: datetime
    """The most recent due fire time (UTC): the one that runs."""
    missed: int
    """Earlier due fire times collapsed into this one (a lower bound when the
    scan limit was reached)."""
    next_fire_at: datetime
    """The first fire time after ``fire_at`` (UTC)."""


@dataclass(frozen=True)
class CronSchedule:
    """A five-field cron expression read in an IANA time zone (default UTC)."""

    expression: str
    timezone: str = "UTC"
    scan_limit: int = 10_000
    """Most fire times counted in a missed window (the count is only reported)."""
    _zone: ZoneInfo = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            zone = ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError):
            raise ConfigurationError(
                f"unknown time zone {self.timezone!r} (an IANA name such as 'Europe/Berlin')"
            ) from None
        object.__setattr__(self, "_zone", zone)
        try:
            CronSim(self.expression, datetime.now(zone))
        except CronSimError as exc:
            raise ConfigurationError(f"bad cron schedule {self.expression!r}: {exc}") from None

    def _iter(self, start: datetime, *, reverse: bool = False) -> Iterator[datetime]:
        it = CronSim(self.expression, start.astimezone(self._zone), reverse=reverse)
        return (t.astimezone(UTC) for t in it)

    def next_after(self, instant: datetime) -> datetime:
        """The first fire time strictly after ``instant`` (UTC)."""
        return next(self._iter(instant))

    def last_at_or_before(self, instant: datetime) -> datetime:
        """The latest fire time at or before ``instant`` (UTC)."""
        # cronsim's reverse iteration is strictly before its start; fire times
        # are whole seconds, so "<= instant" is "< floor(instant) + 1 s".
        return next(self._iter(instant.replace(microsecond=0) + _SECOND, reverse=True))

    def due(self, next_fire_at: datetime, now: datetime) -> CronDue | None:
        """The fire to make at ``now`` given the stored ``next_fire_at``, or
        ``None`` if it is not due yet. Every due time collapses into one fire."""
        if now < next_fire_at:
            return None
        latest = self.last_at_or_before(now)
        if latest < next_fire_at:
            # next_fire_at is not a fire time of this schedule (set by hand or
            # by another schedule): it is due now, as itself.
            latest = next_fire_at
        missed = 0
        for when in self._iter(next_fire_at - _SECOND):
            if when >= latest or missed >= self.scan_limit:
                break
            missed += 1
        return CronDue(fire_at=latest, missed=missed, next_fire_at=self.next_after(latest))


def cron_key(job_id: uuid.UUID, fire_at: datetime) -> str:
    """The dedupe key of the task of one fire."""
    return f"cron:{job_id}:{fire_at.astimezone(UTC).isoformat()}"


@dataclass(frozen=True)
class CronConfig:
    """Cron scheduler settings."""

    interval_seconds: float = 1.0
    """Time between passes: how late past its time a fire may start."""
    scan_limit: int = 10_000
    """Most missed fire times counted for the journal after an outage."""

    def __post_init__(self) -> None:
        require_positive("CronConfig.interval_seconds", self.interval_seconds)
        if self.scan_limit < 1:
            raise ConfigurationError("CronConfig.scan_limit must be >= 1")


@dataclass
class CronReport:
    """What one scheduler pass did."""

    fired: list[uuid.UUID] = field(default_factory=list)
    """Tasks created by fires."""
    skipped: list[uuid.UUID] = field(default_factory=list)
    """Jobs whose due fire was skipped (paused)."""
    scheduled: list[uuid.UUID] = field(default_factory=list)
    """Jobs whose schedule started this pass."""
    retired: list[uuid.UUID] = field(default_factory=list)
    """Jobs no longer live whose schedule was cleared."""


class CronScheduler(DispatcherService):
    """Fires the cron sources of live jobs; see the module docstring."""

    def __init__(
        self,
        repo: Repository,
        *,
        clock: Clock | None = None,
        config: CronConfig | None = None,
        tasks: TaskQueue | None = None,
        handicap: Handicap | None = None,
    ) -> None:
        self.config = config or CronConfig()
        super().__init__(
            repo, self.config.interval_seconds, clock=clock, tasks=tasks, handicap=handicap
        )
        """Claim-order handicap of a priority tier (as the router uses)."""
        self._draining = False

    async def drain(self) -> None:
        """Shutdown: fire nothing from now on (due fires wait for the next Dispatcher)."""
        self._draining = True

    async def run_once(self) -> CronReport:
        """Start new schedules, fire due ones, clear those of non-live jobs."""
        report = CronReport()
        if self._draining:
            return report
        now = self.clock.now()
        async with self.repo.read() as t:
            jobs = [j for j in await live_source_jobs(t) if j.kind == "cron"]
            states = await t.sources.cron_states([j.job_id for j in jobs])
        live = {j.job_id for j in jobs}
        for job in jobs:
            state = states.get(job.job_id)
            next_fire, status = (state.next_fire_at, state.source_status) if state else (None, None)
            try:
                await self._job(job, next_fire, status, now, report)
            except RaceLost:
                continue  # another Dispatcher acted on this job first
        for job_id, state in states.items():
            if job_id not in live and state.next_fire_at is not None:
                try:
                    await self._retire(job_id, state.next_fire_at, now, report)
                except RaceLost:
                    continue
        return report

    async def _job(
        self,
        job: SourceJob,
        next_fire: datetime | None,
        status: str | None,
        now: datetime,
        report: CronReport,
    ) -> None:
        try:
            schedule = CronSchedule(job.schedule or "", job.timezone, self.config.scan_limit)
        except ConfigurationError as exc:
            # Deploy validates schedules; this catches a time zone the host
            # lost since. Reported once, through the Dead status.
            if status != SourceStatus.DEAD:
                await self._mark_invalid(job.job_id, status, str(exc), now)
            return
        if next_fire is None:
            await self._start(job, schedule, now)
            report.scheduled.append(job.job_id)
            return
        due = schedule.due(next_fire, now)
        if due is not None:
            await self._fire(job, next_fire, due, now, report)

    async def _start(self, job: SourceJob, schedule: CronSchedule, now: datetime) -> None:
        first = schedule.next_after(now)
        async with self.repo.transaction() as t:
            if not await t.sources.schedule_cron_if_unscheduled(job.job_id, first=first, now=now):
                raise RaceLost
            await t.journal.append(
                job.job_id,
                "cron_scheduled",
                f"cron {schedule.expression!r} ({schedule.timezone}): "
                f"first fire at {first.isoformat()}",
                now=now,
                detail={"next_fire_at": first.isoformat()},
            )

    async def _fire(
        self, job: SourceJob, next_fire: datetime, due: CronDue, now: datetime, report: CronReport
    ) -> None:
        fire = due.fire_at.isoformat()
        detail = {"fire_at": fire, "missed": due.missed, "next": due.next_fire_at.isoformat()}
        missed = f"; {due.missed} earlier missed fire(s) collapsed into it" if due.missed else ""
        async with self.repo.transaction() as t:
            # Compare-and-set on the fire time we read: exactly one pass, in
            # one Dispatcher, gets to fire it.
            if not await t.sources.advance_cron_if_next_fire(
                job.job_id, expected=next_fire, next_fire_at=due.next_fire_at, now=now
            ):
                raise RaceLost
            paused, reason = await t.job_states.pause_state(job.job_id)
            if paused:
                await t.journal.append(
                    job.job_id,
                    "cron_skipped",
                    f"cron fire at {fire} skipped: paused by "
                    + ("hand" if (reason or "").startswith(MANUAL_PREFIX) else "backpressure")
                    + (f" ({reason})" if reason else "")
                    + missed,
                    now=now,
                    detail=detail,
                )
                report.skipped.append(job.job_id)
                return
            created = await create_source_task(
                t,
                self.tasks,
                job,
                cron_key(job.job_id, due.fire_at),
                now=now,
                inputs={"cron": {"fire_at": fire, "missed": due.missed}},
                handicap_seconds=self.handicap(job.priority_tier),
            )
            await t.sources.record_cron_fire(job.job_id, fired_at=due.fire_at, now=now)
            await t.journal.append(
                job.job_id,
                "cron_fired",
                f"cron fired for {fire}: task {created.task_id}{missed}",
                now=now,
                detail={**detail, "task_id": str(created.task_id)},
            )
        report.fired.append(created.task_id)

    async def _mark_invalid(
        self, job_id: uuid.UUID, status: str | None, problem: str, now: datetime
    ) -> None:
        async with self.repo.transaction() as t:
            if not await t.sources.set_source_status_if_status(
                job_id, expected=status, status=str(SourceStatus.DEAD), now=now
            ):
                raise RaceLost
            await t.journal.append(job_id, "cron_invalid", problem, now=now)

    async def _retire(
        self, job_id: uuid.UUID, next_fire: datetime, now: datetime, report: CronReport
    ) -> None:
        async with self.repo.transaction() as t:
            if not await t.sources.clear_cron_if_next_fire(job_id, expected=next_fire, now=now):
                raise RaceLost
            await t.journal.append(
                job_id,
                "cron_retired",
                "cron schedule stopped: job no longer live (its DAG version was superseded)",
                now=now,
            )
        report.retired.append(job_id)
