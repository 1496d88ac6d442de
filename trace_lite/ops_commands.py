"""Operational CLI commands: explain a job, trigger a source, print metrics."""

from __future__ import annotations

import argparse
import json
import uuid

from trace_core.authoring.events import parse_events
from trace_core.clock import SystemClock
from trace_core.dispatcher.explain import explain_job
from trace_core.dispatcher.manual import ManualTrigger
from trace_core.dispatcher.metrics import render_metrics
from trace_core.errors import NotFound
from trace_core.storage.sql import SqlRepository
from trace_lite.cli_commands import Command, in_event_loop, positive_int
from trace_lite.state_database import StateDatabase, Use

__all__ = ["OPS_COMMANDS"]


def _explain_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dag_name")
    parser.add_argument("job_name")
    parser.add_argument("--org", default="default", help="org slug (default 'default')")
    parser.add_argument(
        "--limit",
        type=positive_int("--limit"),
        default=20,
        help="recent events and entries shown (20)",
    )


def _trigger_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", help="job name, or dag/job")
    parser.add_argument("--org", default="default", help="org slug (default 'default')")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--key", help="idempotency key of the manual run (same key, same task)")
    what.add_argument(
        "--event",
        help='a dataset event as JSON: {"dataset_uuid", "dataset_version", "cursor"}'
        ' or with "partition_key" (and "start", "end")',
    )


async def _explain(args: argparse.Namespace, db: StateDatabase) -> int:
    repo = SqlRepository(db.url())
    try:
        report = await explain_job(
            repo, args.dag_name, args.job_name, org_slug=args.org, limit=args.limit
        )
    finally:
        await repo.close()
    print(report.render())
    return 0


async def _trigger(args: argparse.Namespace, db: StateDatabase) -> int:
    events = None
    if args.event is not None:
        try:
            doc = json.loads(args.event)
        except json.JSONDecodeError as exc:
            print(f"trace-lite: error: --event is not JSON: {exc}")
            return 2
        events = parse_events([doc], field="--event")
    repo = SqlRepository(db.url())
    try:
        trigger = ManualTrigger(repo, clock=SystemClock())
        if events is None:
            async with repo.read() as tx:
                org_id = await tx.registry.find_org(args.org)
            if org_id is None:
                raise NotFound(f"no live source job {args.job!r} in org {args.org!r}")
            run = await trigger.create_task(_job_ref(args.job), args.key, org_id=org_id)
            if run.refused:
                print(f"refused: {run.refused}")
                return 1
            print(f"task {run.task_id}: {'created' if run.created else 'already exists'}")
        else:
            result = await trigger.emit(events)
            print(f"event {result.event_ids[0]}: {'accepted' if result.new else 'duplicate'}")
        return 0
    finally:
        await repo.close()


async def _metrics(args: argparse.Namespace, db: StateDatabase) -> int:
    repo = SqlRepository(db.url())
    try:
        print(await render_metrics(repo, SystemClock()), end="")
    finally:
        await repo.close()
    return 0


OPS_COMMANDS = (
    Command(
        ("explain",),
        "why a job did or did not run",
        Use.READY,
        in_event_loop(_explain),
        _explain_arguments,
    ),
    Command(
        ("trigger",),
        "run a manual source: create a task (--key) or emit an event (--event)",
        Use.READY,
        in_event_loop(_trigger),
        _trigger_arguments,
    ),
    Command(
        ("metrics",),
        "queue depth/age, pauses, in-flight (Prometheus text)",
        Use.READY,
        in_event_loop(_metrics),
    ),
)
"""``explain`` and ``metrics`` read; ``trigger`` writes: none creates a database."""


def _job_ref(text: str) -> str | uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        return text
