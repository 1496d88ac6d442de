"""The rules that relate fields and jobs of a DAG (structure is checked by the models).

Every rule reports a :class:`~trace_core.dag.problems.Problem` naming the
field and the rule; all problems are collected. Inputs by dataset name are
resolved against the DAG itself and, when the caller knows it, the org's
dataset registry: with ``known_datasets=None`` (no database at hand) an input
naming a dataset that this DAG does not produce is a *warning*, since it may
be registered by another DAG; deploy passes the registry's names and makes it
an error.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Collection, Iterator
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import cronsim

from trace_core.dag.problems import LineMap, Problem, Severity, format_field
from trace_core.dag.spec import DEFAULT_OPERATORS, DEFAULT_RUNTIMES, DagSpec, JobSpec

__all__ = ["INPUTS_WHERE_KEY", "check_dag", "did_you_mean", "job_dependencies"]

INPUTS_WHERE_KEY = "inputs_where"
"""Reserved key of ``jobs.config``: ``{dataset_uuid: where}`` of the job's filtered inputs."""

_CRON_ANCHOR = datetime(2000, 1, 1, tzinfo=UTC)


def did_you_mean(word: str, choices: Collection[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest choice, or ``""``."""
    close = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def job_dependencies(spec: DagSpec) -> dict[str, list[str]]:
    """Job name -> the jobs of this DAG it reads from, in input order (no repeats).

    Inputs naming an unknown job or a dataset produced outside the DAG are
    skipped: they are other rules' problems.
    """
    produced = spec.produced()
    names = {job.name for job in spec.jobs}
    deps: dict[str, list[str]] = {}
    for job in spec.jobs:
        ups: list[str] = []
        for edge in job.inputs:
            ref = edge.from_
            up = ref.job if ref.job is not None else produced.get(ref.dataset or "", (None,))[0]
            if up is not None and up in names and up not in ups:
                ups.append(up)
        deps.setdefault(job.name, ups)
    return deps


class _Checker:
    def __init__(self, spec: DagSpec, file: str, lines: LineMap) -> None:
        self.spec = spec
        self.file = file
        self.lines = lines
        self.problems: list[Problem] = []

    def add(self, path: tuple[str | int, ...], message: str, severity: Severity = "error") -> None:
        self.problems.append(
            Problem(self.file, self.lines.line(path), format_field(path), message, severity)
        )


def check_dag(
    spec: DagSpec,
    *,
    file: str,
    lines: LineMap | None = None,
    operators: Collection[str] = DEFAULT_OPERATORS,
    runtimes: Collection[str] = DEFAULT_RUNTIMES,
    known_datasets: Collection[str] | None = None,
) -> list[Problem]:
    """Every semantic problem of ``spec`` (errors and warnings), in file order."""
    c = _Checker(spec, file, lines or LineMap())
    if not spec.jobs:
        c.add(("jobs",), "no jobs — a DAG needs at least one job")
    first_line: dict[str, int] = {}
    for i, job in enumerate(spec.jobs):
        at = ("jobs", i)
        if job.name in first_line:
            c.add(
                (*at, "name"),
                f"duplicate job name '{job.name}' — job names are unique in a DAG "
                f"(first defined at line {first_line[job.name]})",
            )
        else:
            first_line[job.name] = c.lines.line((*at, "name")) or 0
        if job.operator not in operators:
            c.add(
                (*at, "operator"),
                f"unknown operator '{job.operator}'{did_you_mean(job.operator, operators)} — "
                f"the operator must be one of: {', '.join(sorted(operators))}",
            )
        if job.runtime not in runtimes:
            c.add(
                (*at, "runtime"),
                f"unknown runtime '{job.runtime}'{did_you_mean(job.runtime, runtimes)} — "
                f"the runtime must be one of: {', '.join(sorted(runtimes))}",
            )
        _check_activation(c, at, job)
        _check_job_fields(c, at, job)
    _check_outputs(c)
    _check_inputs(c, known_datasets)
    _check_cycles(c)
    return sorted(c.problems, key=lambda p: (p.line or 0, p.field, p.message))


def _check_activation(c: _Checker, at: tuple[str | int, ...], job: JobSpec) -> None:
    if job.activation == "source":
        if job.source is None:
            c.add(
                (*at, "source"),
                "missing source — a source job needs source: {kind: always_on | cron | manual}",
            )
        if job.inputs:
            c.add((*at, "inputs"), "a source job has no inputs — only reactive jobs read inputs")
        if job.execution_strategy is not None:
            c.add(
                (*at, "execution_strategy"),
                "not allowed on a source job — execution_strategy is for reactive jobs",
            )
        if job.idle_timeout is not None:
            c.add(
                (*at, "idle_timeout"),
                "not allowed on a source job — idle_timeout is for reactive jobs",
            )
    else:
        if job.source is not None:
            c.add(
                (*at, "source"),
                "not allowed on a reactive job — a reactive job runs on its inputs' events",
            )
        if job.bootstrap is not None:
            c.add((*at, "bootstrap"), "not allowed on a reactive job — bootstrap is for sources")
        if job.execution_strategy is None:
            c.add(
                (*at, "execution_strategy"),
                "missing execution_strategy — a reactive job needs PerUpdate or PerPartition",
            )
        if not job.inputs:
            c.add((*at, "inputs"), "missing inputs — a reactive job needs at least one input")
    source = job.source
    if source is None:
        return
    if source.kind != "cron":
        for key in ("schedule", "timezone"):
            if getattr(source, key) is not None:
                c.add(
                    (*at, "source", key),
                    f"not allowed for a {source.kind} source — {key} is for cron sources",
                )
        return
    if source.schedule is None:
        c.add((*at, "source", "schedule"), "missing schedule — a cron source needs a schedule")
    else:
        reason = _cron_problem(source.schedule)
        if reason is not None:
            c.add(
                (*at, "source", "schedule"),
                f"bad cron expression '{source.schedule}': {reason} — a schedule has five "
                "fields: minute hour day-of-month month day-of-week",
            )
    if source.timezone is not None:
        try:
            ZoneInfo(source.timezone)
        except (ZoneInfoNotFoundError, ValueError):
            c.add(
                (*at, "source", "timezone"),
                f"unknown timezone '{source.timezone}' — use an IANA zone such as UTC or "
                "Europe/Paris",
            )


def _cron_problem(expr: str) -> str | None:
    # cronsim also takes a sixth (seconds) field; cron elsewhere (EventBridge,
    # crontab) does not, so a schedule must stay portable: five fields.
    if len(expr.split()) != 5:
        return "wrong number of fields"
    try:
        next(cronsim.CronSim(expr, _CRON_ANCHOR))
    except (cronsim.CronSimError, StopIteration) as exc:
        return str(exc) or "never fires"
    return None


def _check_job_fields(c: _Checker, at: tuple[str | int, ...], job: JobSpec) -> None:
    if not job.outputs:
        c.add((*at, "outputs"), "no outputs — every job materializes at least one dataset")
    if job.unique_key is not None and not job.unique_key:
        c.add((*at, "unique_key"), "empty — unique_key names at least one column")
    elif job.update_strategy == "append" and job.unique_key is None:
        c.add(
            (*at, "update_strategy"),
            "append needs unique_key — appended rows are deduplicated on it",
        )
    for k, output in enumerate(job.outputs):
        if output.range is not None and output.range.end < output.range.start:
            c.add(
                (*at, "outputs", k, "range", "end"),
                f"end {output.range.end} is before start {output.range.start} — a range is "
                "inclusive and must have start <= end",
            )
    if INPUTS_WHERE_KEY in job.config:
        c.add(
            (*at, "config", INPUTS_WHERE_KEY),
            f"reserved key — '{INPUTS_WHERE_KEY}' is filled from the inputs' where filters",
        )
    for path in _non_finite(job.config, (*at, "config")):
        c.add(path, "not a finite number — config must be JSON (no .nan or .inf)")


def _non_finite(value: Any, path: tuple[str | int, ...]) -> Iterator[tuple[str | int, ...]]:
    if isinstance(value, float) and not math.isfinite(value):
        yield path
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _non_finite(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _non_finite(item, (*path, index))


def _check_outputs(c: _Checker) -> None:
    producers: dict[str, tuple[str, int]] = {}
    for i, job in enumerate(c.spec.jobs):
        for k, output in enumerate(job.outputs):
            first = producers.get(output.dataset)
            if first is None:
                producers[output.dataset] = (job.name, k)
                continue
            c.add(
                ("jobs", i, "outputs", k, "dataset"),
                f"dataset '{output.dataset}' is already produced by job '{first[0]}' "
                f"(outputs[{first[1]}]) — a dataset has a single producer",
            )


def _check_inputs(c: _Checker, known: Collection[str] | None) -> None:
    jobs = {job.name: job for job in c.spec.jobs}
    produced = c.spec.produced()
    for i, job in enumerate(c.spec.jobs):
        read: dict[str, int] = {}
        for k, edge in enumerate(job.inputs):
            at: tuple[str | int, ...] = ("jobs", i, "inputs", k, "from")
            ref = edge.from_
            if ref.job is not None and ref.dataset is not None:
                c.add(at, "both job and dataset — an input names {job, output_index} or {dataset}")
                continue
            if ref.job is None and ref.dataset is None:
                c.add(at, "empty — an input names {job, output_index} or {dataset}")
                continue
            if ref.dataset is not None and ref.output_index is not None:
                c.add(
                    (*at, "output_index"),
                    "output_index goes with job — a dataset input is named by dataset alone",
                )
                continue
            if ref.job is not None:
                upstream = jobs.get(ref.job)
                if upstream is None:
                    c.add(
                        (*at, "job"),
                        f"unknown job '{ref.job}'{did_you_mean(ref.job, jobs)} — an input must "
                        "name a job of this DAG",
                    )
                    continue
                index = ref.output_index or 0
                if index >= len(upstream.outputs):
                    c.add(
                        (*at, "output_index"),
                        f"output_index {index} is out of range — job '{ref.job}' has "
                        f"{len(upstream.outputs)} output(s) (0..{len(upstream.outputs) - 1})",
                    )
                    continue
                dataset = upstream.outputs[index].dataset
            else:
                dataset = ref.dataset or ""
                if dataset not in produced:
                    if known is None:
                        c.add(
                            (*at, "dataset"),
                            f"dataset '{dataset}' is not produced in this DAG — it must be "
                            "registered by another DAG when this one is deployed",
                            "warning",
                        )
                    elif dataset not in known:
                        hint = did_you_mean(dataset, {*produced, *known})
                        c.add(
                            (*at, "dataset"),
                            f"unknown dataset '{dataset}'{hint} — an input must name a dataset "
                            "produced in this DAG or already registered",
                        )
                        continue
            if dataset in read:
                c.add(
                    at,
                    f"dataset '{dataset}' is already an input of this job (inputs[{read[dataset]}])"
                    " — read each dataset once",
                )
            read.setdefault(dataset, k)


def _check_cycles(c: _Checker) -> None:
    deps = job_dependencies(c.spec)
    order = {job.name: i for i, job in reversed(list(enumerate(c.spec.jobs)))}
    downstream: dict[str, list[str]] = {name: [] for name in deps}
    for name, ups in deps.items():
        for up in ups:
            downstream[up].append(name)
    seen_cycles: set[tuple[str, ...]] = set()
    done: set[str] = set()
    for root in deps:
        if root in done:
            continue
        # Iterative DFS (a DAG may be deeper than Python's recursion limit).
        stack: list[tuple[str, Iterator[str]]] = [(root, iter(downstream[root]))]
        on_stack = {root}
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                on_stack.discard(node)
                done.add(node)
            elif child in on_stack:
                path = [n for n, _ in stack]
                cycle = path[path.index(child) :]
                start = min(range(len(cycle)), key=lambda j: order[cycle[j]])
                cycle = cycle[start:] + cycle[:start]
                if tuple(cycle) not in seen_cycles:
                    seen_cycles.add(tuple(cycle))
                    c.add(
                        ("jobs", order[cycle[0]], "inputs"),
                        f"cycle: {' -> '.join([*cycle, cycle[0]])} — jobs must form a DAG",
                    )
            elif child not in done:
                stack.append((child, iter(downstream[child])))
                on_stack.add(child)
