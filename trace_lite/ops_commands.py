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
from trace_core.storage.sql import SqlRepository

__all__ = ["OPS_COMMANDS", "add_ops_commands", "run_ops_command"]

OPS_COMMANDS = ("explain", "trigger", "metrics")


def add_ops_commands(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], db_help: str
) -> None:
    """Register ``explain``, ``trigger`` and ``metrics`` on the ``trace-lite`` parser."""
    explain = sub.add_parser("explain", help="why a job did or did not run")
    explain.add_argument("dag_name")
    explain.add_argument("job_name")
    explain.add_argument("--db", help=db_help)
    explain.add_argument("--org", default="default", help="org slug (default 'default')")
    explain.add_argument("--limit", type=int, default=20, help="recent events and entries shown")

    trigger = sub.add_parser(
        "trigger", help="run a manual source: create a task (--key) or emit an event (--event)"
    )
    trigger.add_argument("job", help="job name, or dag/job")
    trigger.add_argument("--db", help=db_help)
    what = trigger.add_mutually_exclusive_group(required=True)
    what.add_argument("--key", help="idempotency key of the manual run (same key, same task)")
    what.add_argument(
        "--event",
        help='a dataset event as JSON: {"dataset_uuid", "dataset_version", "cursor"}'
        ' or with "partition_key" (and "start", "end")',
    )

    metrics = sub.add_parser("metrics", help="queue depth/age, pauses, in-flight (Prometheus text)")
    metrics.add_argument("--db", help=db_help)


async def run_ops_command(args: argparse.Namespace, url: str) -> int:
    """Run one of :data:`OPS_COMMANDS`; the exit code."""
    clock = SystemClock()
    repo = SqlRepository(url)
    try:
        if args.command == "explain":
            report = await explain_job(
                repo, args.dag_name, args.job_name, org_slug=args.org, limit=args.limit
            )
            print(report.render())
        elif args.command == "trigger":
            trigger = ManualTrigger(repo, clock=clock)
            if args.key is not None:
                run = await trigger.create_task(_job_ref(args.job), args.key)
                if run.refused:
                    print(f"refused: {run.refused}")
                    return 1
                print(f"task {run.task_id}: {'created' if run.created else 'already exists'}")
            else:
                try:
                    doc = json.loads(args.event)
                except json.JSONDecodeError as exc:
                    print(f"trace-lite: error: --event is not JSON: {exc}")
                    return 2
                result = await trigger.emit(parse_events([doc], field="--event"))
                print(f"event {result.event_ids[0]}: {'accepted' if result.new else 'duplicate'}")
        else:
            print(await render_metrics(repo, clock), end="")
        return 0
    finally:
        await repo.close()


def _job_ref(text: str) -> str | uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        return text
