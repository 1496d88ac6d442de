"""``trace-lite status``, ``datasets`` and ``tasks``: what a DAG has done.

Read-only views of the state database (and, for row counts, of the lite
data directory: Parquet footers in the object store, the buffered tables of
the data database). They create no database (see
:mod:`trace_lite.state_database` for how the state database is found).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio

from trace_core.dag.coverage import Coverage
from trace_core.storage.ports import AttemptRecord
from trace_core.storage.sql import SqlRepository
from trace_core.storage.url import parse_database_url
from trace_lite.buffered import DataDatabase
from trace_lite.cli_commands import Command, in_event_loop, positive_int
from trace_lite.state_database import StateDatabase, Use, sqlite_file
from trace_lite.status import dataset_statuses, object_rows, table_rows, task_counts
from trace_lite.tables import render_table

__all__ = ["STATUS_COMMANDS"]

_STATES = ("Queued", "Running", "Failed", "Completed", "Canceled")


def _dag_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dag_name")
    parser.add_argument("--org", default="default", help="org slug (default 'default')")


def _tasks_arguments(parser: argparse.ArgumentParser) -> None:
    _dag_arguments(parser)
    parser.add_argument("--job", help="only this job's tasks")
    parser.add_argument("--state", choices=_STATES, help="only tasks in this state")
    parser.add_argument(
        "--limit", type=positive_int("--limit"), default=50, help="at most this many (50)"
    )
    parser.add_argument(
        "--attempts",
        action="store_true",
        help="also each task's execution attempts, with their results and errors",
    )


async def _run_status(args: argparse.Namespace, db: StateDatabase) -> int:
    repo = SqlRepository(db.url())
    try:
        lines = await _status(repo, args.dag_name, args.org)
    finally:
        await repo.close()
    print("\n".join(lines))
    return 0


async def _run_datasets(args: argparse.Namespace, db: StateDatabase) -> int:
    repo = SqlRepository(db.url())
    try:
        lines = await _datasets(repo, args, db.data_dir)
    finally:
        await repo.close()
    print("\n".join(lines))
    return 0


async def _run_tasks(args: argparse.Namespace, db: StateDatabase) -> int:
    repo = SqlRepository(db.url())
    try:
        lines = await _tasks(repo, args)
    finally:
        await repo.close()
    print("\n".join(lines))
    return 0


STATUS_COMMANDS = (
    Command(
        ("status",),
        "a DAG's versions, dataset coverage and tasks per job and state",
        Use.READY,
        in_event_loop(_run_status),
        _dag_arguments,
    ),
    Command(
        ("datasets",),
        "a DAG's datasets: versions, events, blocks covered, rows",
        Use.READY,
        in_event_loop(_run_datasets),
        _dag_arguments,
        data_database=True,
    ),
    Command(
        ("tasks",),
        "a DAG's tasks, newest first",
        Use.READY,
        in_event_loop(_run_tasks),
        _tasks_arguments,
    ),
)
"""``status``, ``datasets`` and ``tasks``: read-only, on an existing, current database."""


async def _status(repo: SqlRepository, dag: str, org: str) -> list[str]:
    statuses = await dataset_statuses(repo, dag, org_slug=org)
    counts = await task_counts(repo, dag, org_slug=org)
    if not statuses and not counts.by_job:
        return [f"{dag}: not deployed"]
    lines = [f"{dag}:"]
    rows = [
        (s.name, s.dag_version_status, str(s.dataset_version)[:8], s.events, _ranges(s.coverage))
        for s in statuses
    ]
    lines += [
        "  " + line
        for line in render_table(("dataset", "dag version", "version", "events", "covered"), rows)
    ]
    task_rows = [
        (job, *(counts.by_job[job].get(state, 0) for state in _STATES))
        for job in sorted(counts.by_job)
    ]
    lines += [""] + ["  " + line for line in render_table(("job", *_STATES), task_rows)]
    return lines


def _ranges(coverage: Coverage) -> str:
    """Block ranges (the first three), else the cursor, else ``-``."""
    ranges = coverage.ranges
    if not ranges:
        return "-" if coverage.max_cursor is None else f"cursor {coverage.max_cursor}"
    shown = ", ".join(f"{a}-{b}" for a, b in ranges[:3])
    return shown + (f" (+{len(ranges) - 3} more)" if len(ranges) > 3 else "")


async def _datasets(repo: SqlRepository, args: argparse.Namespace, data_dir: Path) -> list[str]:
    statuses = await dataset_statuses(repo, args.dag_name, org_slug=args.org)
    data_url = args.data_db or f"sqlite:///{data_dir / 'data.db'}"
    data_file = sqlite_file(parse_database_url(data_url))
    # A read command creates no database: no data file yet means no buffered rows yet.
    data = None if data_file is not None and not data_file.exists() else DataDatabase(data_url)
    rows = []
    try:
        for s in statuses:
            if s.location.startswith("s3://"):
                _, count = await anyio.to_thread.run_sync(
                    object_rows, data_dir / "objects", s.location
                )
            else:
                count = 0 if data is None else await table_rows(data, s.location)
            rows.append(
                (
                    s.name,
                    str(s.dataset_version),
                    s.dag_version_status,
                    s.events,
                    s.blocks_covered,
                    count,
                    s.location,
                )
            )
    finally:
        if data is not None:
            await data.close()
    header = ("dataset", "version", "dag version", "events", "blocks", "rows", "location")
    return render_table(header, rows)


async def _tasks(repo: SqlRepository, args: argparse.Namespace) -> list[str]:
    async with repo.read() as tx:
        found = await tx.status.recent_tasks(
            args.org,
            args.dag_name,
            limit=max(1, args.limit),
            job_name=args.job or None,
            status=args.state or None,
        )
        attempts = await tx.attempts.of_tasks([r.task_id for r in found]) if args.attempts else {}
    rows = [
        (
            str(r.task_id),
            r.job_name,
            ",".join(r.partitions) or "-",
            r.status,
            r.attempt,
            r.queued_at.strftime("%Y-%m-%d %H:%M:%S"),
            (r.error_message or "")[:60],
        )
        for r in found
    ]
    lines = render_table(("task", "job", "partition", "state", "attempt", "queued", "error"), rows)
    for r in found:
        if r.task_id in attempts:
            lines += ["", f"attempts of {r.task_id}:"]
            lines += ["  " + line for line in _attempt_lines(attempts[r.task_id])]
    return lines


_SHOWN = 80  # characters of a result or an error shown per attempt


def _attempt_lines(records: list[AttemptRecord]) -> list[str]:
    """One row per attempt: who ran it, how it ended, its result or error."""
    rows = [
        (
            a.attempt,
            str(a.attempt_id),
            a.worker_id,
            a.status,
            a.started_at.strftime("%Y-%m-%d %H:%M:%S"),
            a.ended_at.strftime("%Y-%m-%d %H:%M:%S") if a.ended_at else "-",
            f"{a.stream} {a.message_id}" if a.stream else "-",
            _outcome(a.result, a.error),
        )
        for a in records
    ]
    header = ("#", "attempt id", "worker", "state", "started", "ended", "message", "outcome")
    return render_table(header, rows)


def _outcome(result: Mapping[str, Any] | None, error: Mapping[str, Any] | None) -> str:
    """``error CODE: message`` (first line), else the result as compact JSON."""
    if error is not None:
        message = str(error.get("message") or "").splitlines()
        text = f"error {error.get('code', 'error')}: {message[0] if message else ''}"
    elif result is not None:
        text = json.dumps(result, sort_keys=True, separators=(",", ":"))
    else:
        return "-"
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."
