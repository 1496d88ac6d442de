"""``trace-lite run <dag.yaml>``: the pipeline end to end, with live progress.

Starts a :class:`~trace_lite.platform.TraceLite`, deploys the DAG (with
``--blocks N`` the block range of its sources' outputs becomes ``N`` blocks
from their start, which is a config change and so a new dataset version),
and waits until every block-range dataset covers the whole range (a
version being rebuilt has swapped in: ``run`` after changing a job's config
watches the rematerialization), no task
has work left (the always-on source aside), the outbox is drained and the
buffer is empty. Meanwhile it prints a progress line: tasks per state,
blocks processed (the least-covered block-range dataset) and throughput.
It ends with a summary: datasets with versions, partitions and rows, tasks
by state, alerts, time.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import anyio
import yaml

from trace_core.dag import DagDocument, parse_dag
from trace_core.dag.rematerialize import with_rematerialization
from trace_core.errors import ConfigurationError
from trace_core.storage import Repository
from trace_lite.disk_space import DataDirectoryFull, check_free_space
from trace_lite.platform import LiteConfig, TraceLite
from trace_lite.spark import SparkSessionProvider
from trace_lite.status import (
    DatasetStatus,
    TaskCounts,
    dataset_statuses,
    object_rows,
    table_rows,
    task_counts,
)
from trace_lite.tables import render_table

__all__ = [
    "RunOptions",
    "RunSummary",
    "fill_summary",
    "follow_run",
    "print_summary",
    "run_pipeline",
    "with_block_count",
    "with_rematerialization",
]


@dataclass(frozen=True)
class RunOptions:
    """What ``trace-lite run`` does."""

    dag_file: Path
    config: LiteConfig
    blocks: int | None = None
    rematerialize: str | None = None
    """A dataset to rebuild: its producer's config gets a new ``rematerialize``
    token, so it (and everything downstream) gets new dataset versions, built
    beside the current ones and swapped in once caught up."""
    timeout_seconds: float = 3600.0
    refresh_seconds: float = 1.0


@dataclass
class RunSummary:
    """What a run did (also what the command prints at the end)."""

    dag_name: str
    blocks: int
    seconds: float
    datasets: list[dict[str, Any]] = field(default_factory=list)
    tasks: dict[str, int] = field(default_factory=dict)
    alerts: int = 0
    finished: bool = False

    @property
    def blocks_per_second(self) -> float:
        """Throughput over the whole run (start to finish)."""
        return self.blocks / self.seconds if self.seconds > 0 else 0.0


def with_block_count(text: str, blocks: int) -> str:
    """The DAG YAML with every source output's ``range`` set to ``blocks`` blocks
    from its start."""
    if blocks < 1:
        raise ConfigurationError("--blocks must be >= 1")
    doc = yaml.safe_load(text)
    changed = False
    for job in doc.get("jobs", []) if isinstance(doc, dict) else []:
        if not isinstance(job, dict) or job.get("activation") != "source":
            continue
        for output in job.get("outputs", []) or []:
            span = output.get("range") if isinstance(output, dict) else None
            if isinstance(span, dict) and "start" in span:
                span["end"] = int(span["start"]) + blocks - 1
                changed = True
    if not changed:
        raise ConfigurationError("--blocks: the DAG has no source output with a block range")
    return str(yaml.safe_dump(doc, sort_keys=False))


def _load(options: RunOptions, operators: frozenset[str]) -> DagDocument:
    try:
        text = options.dag_file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigurationError(f"{options.dag_file}: {exc.strerror or exc}") from None
    name = str(options.dag_file)
    if options.blocks is not None:
        text, name = with_block_count(text, options.blocks), f"{name} (--blocks {options.blocks})"
    if options.rematerialize is not None:
        token = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
        text = with_rematerialization(text, options.rematerialize, token)
        name = f"{name} (--rematerialize {options.rematerialize})"
    return parse_dag(text, file=name, operators=operators)


def _target(statuses: Sequence[DatasetStatus]) -> tuple[int, int] | None:
    """The block range of the current version's source outputs."""
    spans = [
        (s.range_start, s.range_end)
        for s in statuses
        if s.dag_version_status == "current" and s.range_start is not None
    ]
    if not spans:
        return None
    return min(a for a, _ in spans if a is not None), max(b for _, b in spans if b is not None)


def _block_datasets(statuses: Sequence[DatasetStatus]) -> list[DatasetStatus]:
    """The object-store datasets (block-range partitioned) of the DAG version
    being built, if one is (a rematerialization), else of the current one."""
    building = any(s.dag_version_status == "building" for s in statuses)
    wanted = "building" if building else "current"
    return [
        s for s in statuses if s.dag_version_status == wanted and s.location.startswith("s3://")
    ]


def _blocks_done(datasets: Sequence[DatasetStatus], target: tuple[int, int]) -> int:
    lo, hi = target
    done = []
    for s in datasets:
        inside = sum(max(0, min(b, hi) - max(a, lo) + 1) for a, b in s.coverage.ranges)
        done.append(inside)
    return min(done) if done else 0


async def _pending_outbox(repo: Repository) -> int:
    async with repo.read() as tx:
        return await tx.status.open_outbox_count()


def _progress_line(counts: TaskCounts, done: int, total: int, elapsed: float) -> str:
    states = counts.total
    shown = " ".join(
        f"{state} {states[state]}"
        for state in ("Queued", "Running", "Failed", "Completed", "Canceled")
        if states[state]
    )
    rate = done / elapsed if elapsed > 0 else 0.0
    return (
        f"[{elapsed:7.1f}s] tasks: {shown or 'none'} | blocks {done:,}/{total:,} "
        f"({100 * done / max(total, 1):5.1f}%) | {rate:,.0f} blocks/s"
    )


async def run_pipeline(
    options: RunOptions, out: TextIO, *, spark: SparkSessionProvider | None = None
) -> RunSummary:
    """Run the DAG to completion (or the timeout); print progress and the summary.

    ``spark`` shares a session the caller owns (tests, benchmarks).
    """

    def say(message: str) -> None:
        print(message, file=out, flush=True)

    started = time.perf_counter()
    async with TraceLite(options.config, spark=spark) as lite:
        document = _load(options, lite.dispatcher.operators.names())
        result = await lite.deploy(document)
        dag = result.dag_name
        state = "deployed" if result.changed else "unchanged"
        say(f"{dag}: {state}, version {result.dag_version_id} ({result.status})")
        say(f"  state db {lite.repo.url.render()}, data dir {options.config.data_dir}")
        if lite.takeover is not None and lite.takeover.any:
            say(f"  {lite.takeover.describe()}")
        sources = frozenset(job.name for job in document.spec.jobs if job.activation == "source")
        data_dir, floor = options.config.data_dir, options.config.min_free_bytes

        async def disk_space() -> None:
            await anyio.to_thread.run_sync(check_free_space, data_dir, floor)

        try:
            summary = await follow_run(
                lite.repo,
                dag,
                sources,
                say,
                started=started,
                timeout_seconds=options.timeout_seconds,
                refresh_seconds=options.refresh_seconds,
                buffer_pending=lite.buffer.pending,
                check=disk_space,
            )
        except DataDirectoryFull:
            await lite.abort()  # a drain would only write, and fail
            raise
        objects = lite.config.data_dir / "objects"

        async def rows(status: DatasetStatus) -> int:
            if status.location.startswith("s3://"):
                _, found = await anyio.to_thread.run_sync(object_rows, objects, status.location)
                return found
            return await table_rows(lite.data, status.location)

        await fill_summary(lite.repo, summary, rows)
    print_summary(summary, say)
    return summary


async def follow_run(
    repo: Repository,
    dag: str,
    sources: frozenset[str],
    say: Callable[[str], None],
    *,
    started: float,
    timeout_seconds: float,
    refresh_seconds: float,
    buffer_pending: Callable[[], Awaitable[int]],
    check: Callable[[], Awaitable[None]] | None = None,
) -> RunSummary:
    """Print a progress line whenever it changes until the run is finished
    (or ``timeout_seconds``); the run's summary so far (finished or not,
    blocks done, seconds since ``started``: no datasets or tasks yet).

    Finished: every block-range dataset covers the whole range, every
    dataset's DAG version is current, no task but the ``sources`` is open,
    the outbox is drained and ``buffer_pending()`` (the dataset buffer's
    records not yet written) is 0. ``started`` is the ``perf_counter`` the
    elapsed time and throughput count from. ``check`` runs at every refresh
    and stops the run by raising (the lite run's disk space). Shared by every
    profile's run.
    """
    done, last_line = 0, ""

    def summary(finished: bool) -> RunSummary:
        return RunSummary(dag, done, time.perf_counter() - started, finished=finished)

    with anyio.move_on_after(timeout_seconds):
        while True:
            statuses = await dataset_statuses(repo, dag)
            counts = await task_counts(repo, dag)
            target = _target(statuses)
            if target is None:
                raise ConfigurationError(f"{dag}: no block-range source output to follow")
            total = target[1] - target[0] + 1
            done = _blocks_done(_block_datasets(statuses), target)
            line = _progress_line(counts, done, total, time.perf_counter() - started)
            if line.split("]", 1)[1] != last_line:
                say(line)
                last_line = line.split("]", 1)[1]
            if (
                done == total
                and all(s.dag_version_status == "current" for s in statuses)
                and counts.open_except(sources) == 0
                and await _pending_outbox(repo) == 0
                and await buffer_pending() == 0
            ):
                return summary(True)
            if check is not None:
                await check()
            await anyio.sleep(refresh_seconds)
    return summary(False)


async def fill_summary(
    repo: Repository,
    summary: RunSummary,
    rows: Callable[[DatasetStatus], Awaitable[int]],
) -> None:
    """Add the DAG's datasets (with ``rows(status)`` rows each) and its task
    counts to ``summary``; the ``alerts`` table's rows are its alerts."""
    statuses = await dataset_statuses(repo, summary.dag_name)
    counts = await task_counts(repo, summary.dag_name)
    for s in statuses:
        found = await rows(s)
        if not s.location.startswith("s3://") and s.name == "alerts":
            summary.alerts = found
        summary.datasets.append(
            {
                "dataset": s.name,
                "version": str(s.dataset_version)[:8],
                "dag_version": s.dag_version_status,
                "partitions": s.events,
                "events": s.events,
                "rows": found,
                "blocks": s.blocks_covered,
            }
        )
    summary.tasks = dict(counts.total)


def print_summary(summary: RunSummary, say: Callable[[str], None]) -> None:
    """Print the summary block that ends a run."""
    say("")
    say(f"{summary.dag_name}: {'finished' if summary.finished else 'STOPPED BEFORE FINISHING'}")
    rows = [
        (d["dataset"], d["version"], d["dag_version"], f"{d['events']:,}", f"{d['rows']:,}")
        for d in summary.datasets
    ]
    for line in render_table(("dataset", "version", "dag version", "events", "rows"), rows):
        say("  " + line)
    tasks = ", ".join(f"{state} {n:,}" for state, n in sorted(summary.tasks.items()))
    say(f"  tasks: {tasks or 'none'}")
    say(f"  alerts: {summary.alerts:,}")
    say(
        f"  {summary.blocks:,} blocks in {summary.seconds:.1f} s "
        f"({summary.blocks_per_second:,.0f} blocks/s)"
    )
