"""``trace-lite pause``, ``resume`` and ``rematerialize``: a writer's controls from the shell.

The CLI twins of ``POST /v1/dags/{dag}/jobs/{job}/pause`` / ``resume`` and
``POST /v1/datasets/{name}/rematerialize``, run as the org's operator (who
may see everything of ``--org``, and nothing of another org):

- ``pause`` is :class:`~trace_core.dispatcher.manual_pause.ManualPause`'s
  manual pause (``manual by <--by>``), which backpressure never lifts;
  ``resume`` lifts only that pause.
- ``rematerialize`` rewrites the producer DAG's newest live YAML with a
  fresh ``rematerialize`` token
  (:func:`~trace_core.dag.rematerialize.with_rematerialization`) and deploys
  it like ``dag deploy``.
"""

from __future__ import annotations

import argparse
import getpass

from trace_core.clock import SystemClock
from trace_core.dag import DeployResult, deploy, parse_dag
from trace_core.dag.rematerialize import with_rematerialization
from trace_core.dispatcher.manual_pause import ManualPause, PauseChange
from trace_core.errors import ConfigurationError, NotFound
from trace_core.people import PeopleService
from trace_core.people.access import Caller
from trace_core.people.catalog import PeopleCatalog
from trace_core.storage.sql import SqlRepository
from trace_lite.cli_commands import Command, in_event_loop
from trace_lite.state_database import StateDatabase, Use

__all__ = ["CONTROL_COMMANDS", "STORAGE_ROOT", "print_deploy"]

_ORG = "org slug (default 'default')"
STORAGE_ROOT = "s3://trace-lite/"
"""Where ``dag deploy`` and ``rematerialize`` put new dataset versions by default."""


def print_deploy(result: DeployResult) -> None:
    """What ``dag deploy`` (and ``rematerialize``) print about a deploy."""
    if not result.changed:
        print(f"{result.dag_name}: unchanged (version {result.dag_version_id} {result.status})")
        return
    print(f"{result.dag_name}: deployed version {result.dag_version_id} ({result.status})")
    for name, pointer in sorted(result.datasets.items()):
        mark = "new version" if pointer.new_version else "kept"
        print(f"  dataset {name}: {pointer.dataset_version} ({mark})")
    for version in result.abandoned_version_ids:
        print(f"  abandoned building version {version}")


def _job_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dag_name")
    parser.add_argument("job_name")
    parser.add_argument("--org", default="default", help=_ORG)
    parser.add_argument(
        "--by", default=None, help="who pauses or resumes, for the reason (default: your login)"
    )


def _dataset_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dataset")
    parser.add_argument("--org", default="default", help=_ORG)
    parser.add_argument(
        "--storage-root", default=STORAGE_ROOT, help="prefix of the new Parquet dataset versions"
    )


async def _operator(repo: SqlRepository, org: str) -> Caller:
    try:
        return await PeopleService(repo, SystemClock()).operator(org)
    except NotFound:
        raise ConfigurationError(f"--org: no org {org!r}") from None


def _print_changes(dag: str, job: str, changes: list[PauseChange]) -> None:
    for c in changes:
        state = f"paused ({c.reason})" if c.paused else "running"
        print(f"{dag}/{job} {c.job_id}: {state}{'' if c.changed else ' (unchanged)'}")


async def _pause_or_resume(args: argparse.Namespace, db: StateDatabase, *, pause: bool) -> int:
    by = args.by or getpass.getuser()
    repo = SqlRepository(db.url())
    try:
        caller = await _operator(repo, args.org)
        job_ids = await PeopleCatalog(repo).live_jobs(caller, args.dag_name, args.job_name)
        pauses = ManualPause(repo, clock=SystemClock())
        act = pauses.pause if pause else pauses.resume
        changes = await act(job_ids, by=by)
    finally:
        await repo.close()
    _print_changes(args.dag_name, args.job_name, changes)
    return 0


async def _pause(args: argparse.Namespace, db: StateDatabase) -> int:
    return await _pause_or_resume(args, db, pause=True)


async def _resume(args: argparse.Namespace, db: StateDatabase) -> int:
    return await _pause_or_resume(args, db, pause=False)


async def _rematerialize(args: argparse.Namespace, db: StateDatabase) -> int:
    clock = SystemClock()
    repo = SqlRepository(db.url())
    try:
        caller = await _operator(repo, args.org)
        dag, text = await PeopleCatalog(repo).producer_yaml(caller, args.dataset)
        token = clock.now().strftime("%Y%m%dT%H%M%S.%fZ")
        document = parse_dag(
            with_rematerialization(text, args.dataset, token),
            file=f"{dag} (rematerialize {args.dataset})",
        )
        result = await deploy(
            repo, document, clock=clock, org_slug=args.org, storage_root=args.storage_root
        )
    finally:
        await repo.close()
    print_deploy(result)
    return 0


CONTROL_COMMANDS = (
    Command(
        ("pause",),
        "pause a job by hand (no new tasks; backpressure never lifts it)",
        Use.READY,
        in_event_loop(_pause),
        _job_arguments,
    ),
    Command(
        ("resume",),
        "lift a job's manual pause (a pause by backpressure stays)",
        Use.READY,
        in_event_loop(_resume),
        _job_arguments,
    ),
    Command(
        ("rematerialize",),
        "rebuild a dataset: new versions of it and what follows, swapped in when caught up",
        Use.READY,
        in_event_loop(_rematerialize),
        _dataset_arguments,
    ),
)
"""Writing commands on an existing, current database; none creates one."""
