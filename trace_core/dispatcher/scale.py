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

from trace_core.clock import Clock
from trace_core.dag import LiveJob, live_jobs, parse_duration
from trace_core.dispatcher.job_states import by_job_id, ensure_job_states, lock_job_states
from trace_core.dispatcher.periodic import DispatcherService, require_positive
from trace_core.errors import ConfigurationError
from trace_core.storage.protocol import Repository

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


class IdleScaler(DispatcherService):
    """Tracks the scale state of live reactive jobs; see the module docstring."""

    def __init__(
        self,
        repo: Repository,
        *,
        clock: Clock | None = None,
        config: ScaleConfig | None = None,
    ) -> None:
        self.config = config or ScaleConfig()
        super().__init__(repo, self.config.interval_seconds, clock=clock)

    async def run_once(self) -> ScaleReport:
        """Scale up jobs with work, scale to zero jobs idle past their timeout."""
        now = self.clock.now()
        report = ScaleReport()
        async with self.repo.transaction() as tx:
            jobs = {j.job_id: j for j in await live_jobs(tx) if j.activation == "reactive"}
            if not jobs:
                return report
            ids = list(jobs)
            states: dict[uuid.UUID, tuple[str, datetime | None]] = {
                job_id: (state.scale_state, state.last_activity_at)
                for job_id, state in (await tx.job_states.scale_states(ids)).items()
            }
            missing = [j for j in ids if j not in states]
            await ensure_job_states(tx, missing, now=now)
            states.update({j: (IDLE, None) for j in missing})
            active = await tx.concurrency.active_by_job(ids)
            down = self._idle_past_timeout(jobs, states, active, now)
            # Only the rows that change are locked, in lock order (see job_states.py).
            await lock_job_states(tx, [*active, *down])
            if active:
                # Compare-and-set from Idle, so concurrent scalers journal once.
                up = await tx.job_states.mark_running_if_idle(list(active), now=now)
                for job_id in by_job_id(up):
                    report.scaled_up.append(job_id)
                    n = active[job_id]
                    await tx.journal.append(
                        job_id,
                        "scale_up",
                        f"scale up: {n} queued or running task(s)",
                        now=now,
                        detail={"active_tasks": n},
                    )
                await tx.job_states.touch_activity(list(active), now=now)
            for job_id, (idle, shown) in down.items():
                last_activity = states[job_id][1]
                if not await tx.job_states.mark_idle_if_unchanged(job_id, last_activity, now=now):
                    continue  # another scaler saw new work meanwhile
                report.scaled_down.append(job_id)
                await tx.journal.append(
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
        async with self.repo.read() as tx:
            ids = [j.job_id for j in await live_jobs(tx) if j.activation == "reactive"]
            if not ids:
                return {}
            known = {
                job_id: state.scale_state
                for job_id, state in (await tx.job_states.scale_states(ids)).items()
            }
        return {job_id: known.get(job_id, IDLE) for job_id in ids}
