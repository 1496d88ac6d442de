"""Backpressure planning: from a job graph and queue measurements, the pauses.

Pure functions and data, no database: :func:`plan_backpressure` takes the
live jobs (:class:`JobNode`, with their dataset edges and
:class:`Thresholds`), each job's :class:`QueueMeasurement` and the producers
paused now, and decides which producers must be paused and why
(:class:`BackpressurePlan`). :class:`~trace_core.dispatcher.backpressure.BackpressureMonitor`
reads those inputs from the database and writes the decision back.

Decisions are made from the producer's side, with hysteresis: a producer is
*paused* when some queue downstream of it (transitively, through the dataset
edges) is over its threshold, and a paused producer *stays paused* while some
queue downstream of it is still above the resume level (``resume_fraction``
of the depth threshold, or over the age threshold). So a producer paused by
two tripped jobs stays paused until both have cleared. Bulk-tier producers
are shed first, at ``bulk_shed_fraction`` of the thresholds.
"""

from __future__ import annotations

import uuid
from collections import defaultdict, deque
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from trace_core.errors import ConfigurationError

__all__ = [
    "PAUSE_PREFIX",
    "TIERS",
    "BackpressureConfig",
    "BackpressurePlan",
    "Cause",
    "JobGraph",
    "JobNode",
    "JobPressure",
    "Level",
    "Pause",
    "QueueMeasurement",
    "Thresholds",
    "cause_labels",
    "evaluate_pressure",
    "plan_backpressure",
]

PAUSE_PREFIX = "backpressure: "
"""How a pause reason written by the monitor starts (and how it knows its own)."""

TIERS = ("normal", "bulk")


@dataclass(frozen=True)
class BackpressureConfig:
    """Backpressure settings: the planning fractions, the monitor's interval
    and the bulk tier's claim-order handicap."""

    interval_seconds: float = 5.0
    """Time between rounds of the monitor
    (:class:`~trace_core.dispatcher.backpressure.BackpressureMonitor`)."""
    resume_fraction: float = 0.8
    """Hysteresis: a paused producer resumes once the queues that paused it are
    below this fraction of their depth threshold (and under the age threshold)."""
    bulk_shed_fraction: float = 0.5
    """Bulk-tier producers are paused once a downstream queue reaches this
    fraction of its thresholds (before normal-tier producers are)."""
    bulk_handicap_seconds: float = 300.0
    """Claim-order handicap of bulk-tier tasks: they yield to normal work created
    up to this much later, then age in (never starved)."""

    def __post_init__(self) -> None:
        if self.interval_seconds <= 0:
            raise ConfigurationError("BackpressureConfig.interval_seconds must be > 0")
        if not 0 < self.resume_fraction <= 1:
            raise ConfigurationError("BackpressureConfig.resume_fraction must be within (0, 1]")
        if not 0 < self.bulk_shed_fraction <= 1:
            raise ConfigurationError("BackpressureConfig.bulk_shed_fraction must be within (0, 1]")
        if self.bulk_handicap_seconds < 0:
            raise ConfigurationError("BackpressureConfig.bulk_handicap_seconds must be >= 0")

    def handicap_seconds(self, tier: str) -> float:
        """The ``NewTask.handicap_seconds`` for a task of a job in ``tier``."""
        if tier == "bulk":
            return self.bulk_handicap_seconds
        if tier == "normal":
            return 0.0
        raise ConfigurationError(f"priority tier must be one of {TIERS}, got {tier!r}")


# --- the job graph ----------------------------------------------------------


@dataclass(frozen=True)
class Thresholds:
    """A job's queue limits (``jobs.backpressure``); either may be absent."""

    max_queue_depth: int | None = None
    max_queue_age_seconds: float | None = None

    def __post_init__(self) -> None:
        depth, age = self.max_queue_depth, self.max_queue_age_seconds
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int)):
            raise ConfigurationError(f"max_queue_depth must be an integer, got {depth!r}")
        if depth is not None and depth < 1:
            raise ConfigurationError(f"max_queue_depth must be >= 1, got {depth}")
        if age is not None and (isinstance(age, bool) or not isinstance(age, int | float)):
            raise ConfigurationError(f"max_queue_age_seconds must be a number, got {age!r}")
        if age is not None and not age > 0:
            raise ConfigurationError(f"max_queue_age_seconds must be > 0, got {age}")

    @classmethod
    def from_json(cls, doc: Any) -> Thresholds | None:
        """Parse ``jobs.backpressure``; ``None`` when the job sets no limit."""
        if doc is None:
            return None
        if not isinstance(doc, Mapping):
            raise ConfigurationError(f"backpressure must be an object, got {doc!r}")
        depth = doc.get("max_queue_depth")
        age = doc.get("max_queue_age_seconds")
        if depth is None and age is None:
            return None
        return cls(depth, age)


@dataclass(frozen=True)
class JobNode:
    """One live job as backpressure (and metrics) see it."""

    job_id: uuid.UUID
    dag_name: str
    job_name: str
    operator: str = "noop"
    priority_tier: str = "normal"
    input_datasets: tuple[str, ...] = ()
    output_datasets: tuple[str, ...] = ()
    thresholds: Thresholds | None = None

    @property
    def label(self) -> str:
        """``dag/job``: how reasons and the journal name the job."""
        return f"{self.dag_name}/{self.job_name}"


class JobGraph:
    """Producer edges between jobs, through the datasets they write and read."""

    def __init__(self, jobs: Iterable[JobNode]) -> None:
        self.jobs = {job.job_id: job for job in jobs}
        self._producers: dict[str, list[JobNode]] = defaultdict(list)
        for job in self.jobs.values():
            for dataset in job.output_datasets:
                self._producers[dataset].append(job)

    def upstream(self, job_id: uuid.UUID) -> list[JobNode]:
        """Every job whose outputs reach ``job_id``'s inputs, transitively.

        The job itself is excluded even if a cycle leads back to it: pausing a
        job's own task creation is not the producer pause this is for.
        """
        start = self.jobs.get(job_id)
        if start is None:
            return []
        seen = {job_id}
        found: list[JobNode] = []
        todo = deque([start])
        while todo:
            for dataset in todo.popleft().input_datasets:
                for producer in self._producers.get(dataset, ()):
                    if producer.job_id not in seen:
                        seen.add(producer.job_id)
                        found.append(producer)
                        todo.append(producer)
        return found


# --- measurements and the pure decision -------------------------------------


@dataclass(frozen=True)
class QueueMeasurement:
    """A job's queue: ``Queued`` tasks, and the age of the oldest one."""

    depth: int = 0
    age_seconds: float = 0.0


class Level(StrEnum):
    """How far a queue is over its limits, i.e. which producers it sheds."""

    BULK = "bulk"
    """Over the bulk-shed fraction: bulk-tier producers are paused."""
    NORMAL = "normal"
    """Over the threshold: every producer is paused."""


def _applies(level: Level | None, tier: str) -> bool:
    return level is Level.NORMAL or (level is Level.BULK and tier == "bulk")


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.1f}"


@dataclass(frozen=True)
class JobPressure:
    """The pressure of one job's queue: what it starts and what it keeps paused."""

    job_id: uuid.UUID
    label: str
    measurement: QueueMeasurement
    trip: Level | None
    """Producers of these tiers are paused (threshold exceeded)."""
    trip_reason: str
    hold: Level | None
    """Producers of these tiers that are paused stay paused (above the resume level)."""
    hold_reason: str

    def cause(self, tier: str, *, paused: bool) -> str | None:
        """Why a producer of ``tier`` must be paused for this queue, or ``None``."""
        if _applies(self.trip, tier):
            return self.trip_reason
        if paused and _applies(self.hold, tier):
            return self.hold_reason
        return None


def evaluate_pressure(
    job: JobNode, measurement: QueueMeasurement, config: BackpressureConfig
) -> JobPressure | None:
    """Compare one queue with its thresholds; ``None`` when it pushes back on nothing."""
    th = job.thresholds
    if th is None:
        return None
    depth, age = measurement.depth, measurement.age_seconds
    max_depth, max_age = th.max_queue_depth, th.max_queue_age_seconds
    shed, resume = config.bulk_shed_fraction, config.resume_fraction

    def over(age_at: float, depth_at: float, strict: bool, note: str = "") -> list[str]:
        """The measurements at or over (``strict``: over) the scaled thresholds."""
        found = []
        op = ">" if strict else ">="
        if max_depth is not None:
            at = depth_at * max_depth
            if depth > at if strict else depth >= at:
                found.append(f"queue depth {depth} {op} {_num(at)}{note.format(max_depth)}")
        if max_age is not None:
            at = age_at * max_age
            if age > at if strict else age >= at:
                found.append(f"queue age {_num(age)}s {op} {_num(at)}s")
        return found

    trip: Level | None = None
    hold: Level | None = None
    trip_why: list[str] = []
    hold_why: list[str] = []
    if found := over(1.0, 1.0, True):
        trip, trip_why = Level.NORMAL, found
    elif found := over(shed, shed, False, f" (bulk shed at {shed:.0%} of {{}})"):
        trip, trip_why = Level.BULK, found
    # Hysteresis on depth only: age falls by itself as the oldest tasks are
    # claimed, while a depth hovering at the threshold would flap.
    if found := over(1.0, resume, False, f" (resumes below {resume:.0%} of {{}})"):
        hold, hold_why = Level.NORMAL, found
    elif found := over(
        shed, resume * shed, False, f" (bulk resumes below {resume:.0%} of {shed:.0%} of {{}})"
    ):
        hold, hold_why = Level.BULK, found
    # A trip implies a hold at least as strong (the resume levels are lower).
    if hold is None:
        return None
    where = f" at job {job.label}"
    return JobPressure(
        job_id=job.job_id,
        label=job.label,
        measurement=measurement,
        trip=trip,
        trip_reason=" and ".join(trip_why) + where if trip_why else "",
        hold=hold,
        hold_reason=" and ".join(hold_why) + where,
    )


@dataclass(frozen=True)
class Cause:
    """One downstream queue that keeps a producer paused."""

    job_id: uuid.UUID
    label: str
    reason: str


@dataclass(frozen=True)
class Pause:
    """A producer to keep paused, and the downstream queues that cause it."""

    job_id: uuid.UUID
    causes: tuple[Cause, ...]
    """Sorted by label."""

    @property
    def reason(self) -> str:
        """The ``job_states.pause_reason`` text."""
        return PAUSE_PREFIX + "; ".join(c.reason for c in self.causes)

    @property
    def cause_labels(self) -> frozenset[str]:
        """The jobs whose queues cause this pause."""
        return frozenset(c.label for c in self.causes)


@dataclass(frozen=True)
class BackpressurePlan:
    """What one round decides: each queue's pressure and the producers to pause."""

    pressures: dict[uuid.UUID, JobPressure]
    pauses: dict[uuid.UUID, Pause]


def plan_backpressure(
    jobs: Iterable[JobNode],
    measurements: Mapping[uuid.UUID, QueueMeasurement],
    config: BackpressureConfig,
    *,
    paused: Collection[uuid.UUID] = (),
) -> BackpressurePlan:
    """Pure pause propagation: graph + measurements (+ who is paused now) -> pauses.

    A producer is paused when a queue downstream of it (transitively) trips at
    a level that applies to its tier; one already in ``paused`` stays paused
    while such a queue is above its resume level.
    """
    graph = JobGraph(jobs)
    empty = QueueMeasurement()
    pressures = {
        job_id: p
        for job_id, job in graph.jobs.items()
        if (p := evaluate_pressure(job, measurements.get(job_id, empty), config)) is not None
    }
    paused_set = set(paused)
    causes: dict[uuid.UUID, list[Cause]] = defaultdict(list)
    for pressure in pressures.values():
        for producer in graph.upstream(pressure.job_id):
            why = pressure.cause(producer.priority_tier, paused=producer.job_id in paused_set)
            if why is not None:
                causes[producer.job_id].append(Cause(pressure.job_id, pressure.label, why))
    pauses = {
        job_id: Pause(job_id, tuple(sorted(found, key=lambda c: (c.label, c.job_id.int))))
        for job_id, found in causes.items()
    }
    return BackpressurePlan(pressures, pauses)


def cause_labels(reason: str) -> frozenset[str]:
    """The job labels a stored pause reason names (each cause ends ``at job <label>``)."""
    body = reason.removeprefix(PAUSE_PREFIX)
    return frozenset(part.rpartition(" at job ")[2] for part in body.split("; ") if part)
