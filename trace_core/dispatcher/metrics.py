"""Dispatcher metrics in the Prometheus text exposition format (version 0.0.4).

Read from the database at scrape time, in one read transaction, so every
Dispatcher process reports the same numbers and nothing is kept in memory.
The format is written here rather than through ``prometheus_client``: a
handful of gauges needs no dependency, and no process-global registry.

A ``(dag, job)`` pair can name two live jobs while a new DAG version builds
next to the current one; their series are merged (depths and in-flight
counts add up, the oldest age wins, paused if either is) so each label set
appears once, as the format requires.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping

from trace_core.clock import Clock
from trace_core.dispatcher.backpressure import load_job_graph, measure_queues, read_paused
from trace_core.dispatcher.backpressure_plan import QueueMeasurement
from trace_core.dispatcher.concurrency import count_in_flight_by_operator
from trace_core.storage.protocol import Repository

__all__ = ["CONTENT_TYPE", "TASK_STATUSES", "render_metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The HTTP ``Content-Type`` of :func:`render_metrics` output."""

TASK_STATUSES = ("Queued", "Running", "Completed", "Failed", "Canceled")
"""Every task status; each is reported (zero included) so series never vanish."""

Labels = tuple[tuple[str, str], ...]


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n")


def _value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def _family(
    name: str, help_text: str, samples: Iterable[tuple[Labels, float]], kind: str = "gauge"
) -> list[str]:
    lines = [f"# HELP {name} {_escape_help(help_text)}", f"# TYPE {name} {kind}"]
    for labels, value in sorted(samples):
        rendered = ",".join(f'{key}="{_escape_label(val)}"' for key, val in labels)
        lines.append(
            f"{name}{{{rendered}}} {_value(value)}" if labels else f"{name} {_value(value)}"
        )
    return lines


async def render_metrics(repo: Repository, clock: Clock) -> str:
    """The Dispatcher's gauges, as a Prometheus text exposition document.

    ``trace_job_queue_depth{dag,job}``, ``trace_job_queue_age_seconds{dag,job}``,
    ``trace_job_paused{dag,job}``, ``trace_operator_in_flight{operator}`` and
    ``trace_tasks{status}``. Scraping costs a few grouped queries; the task
    totals count the whole ``tasks`` table (keep finished rows swept).
    """
    now = clock.now()
    async with repo.read() as tx:
        jobs = await load_job_graph(tx)
        queues = await measure_queues(tx, now)
        paused = await read_paused(tx)
        in_flight = await count_in_flight_by_operator(tx)
        by_status = await tx.explain.task_status_counts()

    depth: dict[Labels, float] = defaultdict(float)
    age: dict[Labels, float] = defaultdict(float)
    is_paused: dict[Labels, float] = defaultdict(float)
    operators: dict[str, float] = defaultdict(float)
    empty = QueueMeasurement()
    for job in jobs:
        labels = (("dag", job.dag_name), ("job", job.job_name))
        queue = queues.get(job.job_id, empty)
        depth[labels] += queue.depth
        age[labels] = max(age[labels], queue.age_seconds)
        is_paused[labels] = max(is_paused[labels], 1.0 if job.job_id in paused else 0.0)
        operators[job.operator] += 0  # every live operator gets a series, idle ones too
    for operator, n in in_flight.items():
        operators[operator] += n

    def op_samples(values: Mapping[str, float]) -> list[tuple[Labels, float]]:
        return [((("operator", op),), n) for op, n in values.items()]

    statuses = {s: 0 for s in TASK_STATUSES} | by_status
    lines = [
        *_family("trace_job_queue_depth", "Queued tasks of a live job.", depth.items()),
        *_family(
            "trace_job_queue_age_seconds",
            "Age of a live job's oldest queued task, in seconds (0 when none is queued).",
            age.items(),
        ),
        *_family(
            "trace_job_paused",
            "1 while a live job is paused (backpressure or by hand), else 0.",
            is_paused.items(),
        ),
        *_family("trace_operator_in_flight", "Running tasks per operator.", op_samples(operators)),
        *_family(
            "trace_tasks",
            "Tasks by status.",
            [((("status", s),), float(n)) for s, n in statuses.items()],
        ),
    ]
    return "\n".join(lines) + "\n"
