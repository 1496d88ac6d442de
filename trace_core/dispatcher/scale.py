"""Scale to zero: which reactive jobs need workers now (Reactive Job Lifecycle).

``job_states.scale_state`` of every live reactive job:

- ``Idle -> Running`` as soon as the job has a ``Queued`` or ``Running``
  task; while it has any, ``last_activity_at`` is kept at the pass time.
- ``Running -> Idle`` once it has had none for its ``idle_timeout``
  (``jobs.idle_timeout``: ``'never'`` never idles, ``'0'`` idles at once,
  else a duration such as ``'30s'`` or ``'5m'``).

A task waiting for a retry is not activity: its requeue makes it ``Queued``
and scales the job up again. :meth:`IdleScaler.scale_states` is what a
deployment reads to scale a job's workers to zero. Transitions are journaled.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

import sqlalchemy as sa

from trace_core.clock import Clock, SystemClock
from trace_core.dag import LiveJob, live_jobs, parse_duration
from trace_core.dispatcher.job_states import (
    by_job_id,
    ensure_job_states,
    lock_job_states,
    same_as,
)
from trace_core.dispatcher.journal import record
from trace_core.dispatcher.periodic import PeriodicService, require_positive
from trace_core.errors import ConfigurationError
from trace_core.storage import schema
from trace_core.storage.sql import SqlRepository, as_sql

__all__ = ["IdleScaler", "ScaleConfig", "ScaleReport", "idle_timeout_seconds"]

IDLE = "Idle"
RUNNING = "Running"


def idle_timeout_seconds(text: str | None, default: str = "never") -> float | None:
    """Seconds of ``idle_timeout`` text (``default`` when unset); ``None`` = never.

    Raises :class:`ConfigurationError` for text that is not ``never``, ``0``
    or a duration.
    """
    value = (text if text is not None else default).strip()
    if value == "never":
        return None
    try:
        return float(parse_duration(value))
    except ValueError as exc:
        raise ConfigurationError(f"idle_timeout {value!r}: {exc}") from None


@dataclass(frozen=True)
class ScaleConfig:
    """Idle scaler settings."""

    interval_seconds: float = 5.0
    """Time between passes: how late a scale-up or scale-to-zero is seen."""
    default_idle_timeout: str = "never"
    """For reactive jobs without ``idle_timeout``: keep their workers."""

    def __post_init__(self) -> None:
        require_positive("ScaleConfig.interval_seconds", self.interval_seconds)
        idle_timeout_seconds(self.default_idle_timeout)


@dataclass
class ScaleReport:
    """What one pass changed."""

    scaled_up: list[uuid.UUID] = field(default_factory=list)
    """Jobs that went ``Idle -> Running``."""
    scaled_down: list[uuid.UUID] = field(default_factory=list)
    """Jobs that went ``Running -> Idle``."""


class IdleScaler(PeriodicService):
    """Tracks the scale state of live reactive jobs; see the module docstring."""

    def __init__(
        self,
        repo: SqlRepository,
        *,
        clock: Clock | None = None,
        config: ScaleConfig | None = None,
    ) -> None:
        self.config = config or ScaleConfig()
        super().__init__(self.config.interval_seconds)
        self.repo = repo
        self.clock = clock or SystemClock()

    async def run_once(self) -> ScaleReport:
        """Scale up jobs with work, scale to zero jobs idle past their timeout."""
        now = self.clock.now()
        report = ScaleReport()
        s, t = schema.job_states, schema.tasks
        async with self.repo.transaction() as tx:
            st = as_sql(tx)
            conn = st.connection
            jobs = {j.job_id: j for j in await live_jobs(st) if j.activation == "reactive"}
            if not jobs:
                return report
            ids = list(jobs)
            states: dict[uuid.UUID, tuple[str, datetime | None]] = {
                r[0]: (r[1], r[2])
                for r in await conn.execute(
                    sa.select(s.c.job_id, s.c.scale_state, s.c.last_activity_at).where(
                        s.c.job_id.in_(ids)
                    )
                )
            }
            missing = [j for j in ids if j not in states]
            await ensure_job_states(st, missing, now=now)
            states.update({j: (IDLE, None) for j in missing})
            active = {
                r[0]: int(r[1])
                for r in await conn.execute(
                    sa.select(t.c.job_id, sa.func.count())
                    .where(t.c.status.in_(("Queued", "Running")), t.c.job_id.in_(ids))
                    .group_by(t.c.job_id)
                )
            }
            down = self._idle_past_timeout(jobs, states, active, now)
            # Only the rows that change are locked, in lock order (see job_states.py).
            await lock_job_states(st, [*active, *down])
            if active:
                # Compare-and-set from Idle, so concurrent scalers journal once.
                up = (
                    await conn.execute(
                        sa.update(s)
                        .where(s.c.job_id.in_(list(active)), s.c.scale_state == IDLE)
                        .values(scale_state=RUNNING, last_activity_at=now, updated_at=now)
                        .returning(s.c.job_id)
                    )
                ).scalars()
                for job_id in by_job_id(up):
                    report.scaled_up.append(job_id)
                    n = active[job_id]
                    await record(
                        st,
                        job_id,
                        "scale_up",
                        f"scale up: {n} queued or running task(s)",
                        now=now,
                        detail={"active_tasks": n},
                    )
                await conn.execute(
                    sa.update(s)
                    .where(s.c.job_id.in_(list(active)))
                    .values(last_activity_at=now, updated_at=now)
                )
            for job_id, (idle, shown) in down.items():
                last_activity = states[job_id][1]
                changed = await conn.execute(
                    sa.update(s)
                    .where(
                        s.c.job_id == job_id,
                        s.c.scale_state == RUNNING,
                        same_as(s.c.last_activity_at, last_activity),
                    )
                    .values(scale_state=IDLE, updated_at=now)
                )
                if not changed.rowcount:
                    continue  # another scaler saw new work meanwhile
                report.scaled_down.append(job_id)
                await record(
                    st,
                    job_id,
                    "scale_to_zero",
                    f"scale to zero: no queued or running task for {idle:g} s "
                    f"(idle_timeout {shown})",
                    now=now,
                    detail={"idle_seconds": idle, "idle_timeout": shown},
                )
        return report

    def _idle_past_timeout(
        self,
        jobs: Mapping[uuid.UUID, LiveJob],
        states: Mapping[uuid.UUID, tuple[str, datetime | None]],
        active: Mapping[uuid.UUID, int],
        now: datetime,
    ) -> dict[uuid.UUID, tuple[float, str]]:
        """Running jobs without work for their idle timeout: seconds idle and
        the timeout as shown in the journal, in lock order."""
        down: dict[uuid.UUID, tuple[float, str]] = {}
        for job_id in by_job_id(states):
            state, last_activity = states[job_id]
            if state != RUNNING or job_id in active:
                continue
            text = jobs[job_id].idle_timeout
            try:
                timeout = idle_timeout_seconds(text, self.config.default_idle_timeout)
            except ConfigurationError:
                continue  # not understood: never scale to zero on a guess
            if timeout is None:
                continue
            idle = (now - last_activity).total_seconds() if last_activity else timeout
            if idle >= timeout:
                shown = (
                    text if text is not None else f"{self.config.default_idle_timeout} (default)"
                )
                down[job_id] = (idle, shown)
        return down

    async def scale_states(self) -> dict[uuid.UUID, str]:
        """``Idle`` or ``Running`` for every live reactive job (``Idle`` if never seen)."""
        s = schema.job_states
        async with self.repo.read() as tx:
            conn = as_sql(tx).connection
            ids = [j.job_id for j in await live_jobs(tx) if j.activation == "reactive"]
            if not ids:
                return {}
            rows = await conn.execute(
                sa.select(s.c.job_id, s.c.scale_state).where(s.c.job_id.in_(ids))
            )
            known = {r[0]: str(r[1]) for r in rows}
        return {job_id: known.get(job_id, IDLE) for job_id in ids}
