"""The trace-lite command line.

Which state database, for every command: --db URL, else $TRACE_DATABASE_URL,
else the SQLite file <data dir>/trace.db (--data-dir, default .trace/). So
`trace-lite status DAG --data-dir DIR` reads what `trace-lite run DAG.yaml
--data-dir DIR` wrote.

Commands that read or operate a deployed system (status, datasets, tasks,
explain, metrics, trigger, dag deploy, dag rollback, dag validate --db,
db check) never create a database: a missing one is an error naming the
path looked for; one not at the newest schema revision is an error naming
the `trace-lite db upgrade ...` command to run.

Commands that start Trace (run, serve, demo) create and migrate the embedded
SQLite file by themselves; a Postgres database must be migrated first with
`trace-lite db upgrade --db postgresql://...` (they refuse otherwise, naming
that command). `worker` opens no database: it works through serve's HTTP API.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio

from trace_core.clock import SystemClock
from trace_core.dag import DagDocument, DagValidationError, deploy, load_dag, rollback
from trace_core.dag.registry import (
    all_dataset_names,
    find_org,
    registered_datasets,
    registry_problems,
)
from trace_core.dag.version_rows import dag_dataset_names
from trace_core.errors import ConfigurationError, TraceError
from trace_core.storage.migrate import current_revision, head_revision, schema_diff, upgrade
from trace_core.storage.sql import SqlRepository
from trace_core.storage.url import parse_database_url
from trace_core.tasks import TaskQueue
from trace_lite.cli_commands import Command, build_parser, in_event_loop, port, positive_int
from trace_lite.control_cli import CONTROL_COMMANDS, STORAGE_ROOT, print_deploy
from trace_lite.demo import DemoConfig, run_demo
from trace_lite.euterpe_cli import EUTERPE_COMMANDS, EUTERPE_GROUPS
from trace_lite.lineage_cli import LINEAGE_COMMANDS
from trace_lite.ops_commands import OPS_COMMANDS
from trace_lite.people_cli import PEOPLE_COMMANDS, PEOPLE_GROUPS
from trace_lite.state_database import StateDatabase, Use
from trace_lite.status_commands import STATUS_COMMANDS

__all__ = ["COMMANDS", "main"]

_ORG_HELP = "org slug (default: the file's org:, else 'default')"


# --- db ---------------------------------------------------------------------------


def _db_upgrade(args: argparse.Namespace, db: StateDatabase) -> int:
    url = db.url()
    print(f"upgraded to {upgrade(url)} (head {head_revision()})")
    return 0


def _db_check(args: argparse.Namespace, db: StateDatabase) -> int:
    url = db.url()
    diff = schema_diff(url)
    print(json.dumps({"revision": current_revision(url), "differences": len(diff)}))
    for entry in diff:
        print(f"  {entry}")
    return 1 if diff else 0


# --- dag ----------------------------------------------------------------------------


def _file_and_org(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file")
    parser.add_argument("--org", help=_ORG_HELP)


def _deploy_arguments(parser: argparse.ArgumentParser) -> None:
    _file_and_org(parser)
    parser.add_argument(
        "--storage-root", default=STORAGE_ROOT, help="prefix of Parquet dataset versions"
    )


def _rollback_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dag_name")
    parser.add_argument("--org", default="default", help="org slug (default 'default')")


def _print_problems(exc: DagValidationError) -> int:
    for problem in exc.problems:
        print(problem)
    errors = len(exc.errors)
    print(f"{errors} error{'s' if errors != 1 else ''}")
    return 1


async def _validate_against_db(document: DagDocument, url: str, org: str | None) -> None:
    """Re-check inputs by dataset name and single producers against the registry."""
    spec = document.spec
    wanted = dag_dataset_names(spec)
    repo = SqlRepository(url)
    try:
        async with repo.read() as tx:
            org_id = await find_org(tx, org or spec.org or "default")
            names: set[str] = set()
            registered = []
            if org_id is not None:
                names = await all_dataset_names(tx, org_id)
                registered = await registered_datasets(
                    tx, org_id, names=wanted, producer_dag=spec.dag
                )
    finally:
        await repo.close()
    problems = document.recheck(known_datasets=names) + registry_problems(document, registered)
    if any(p.severity == "error" for p in problems):
        raise DagValidationError(problems)


def _dag_validate(args: argparse.Namespace, db: StateDatabase) -> int:
    document = load_dag(args.file)
    if db.named:
        anyio.run(_validate_against_db, document, db.url(), args.org)
    else:
        for warning in document.warnings:
            print(warning)
    spec = document.spec
    print(f"{args.file}: ok ({len(spec.jobs)} jobs, {len(spec.produced())} datasets)")
    return 0


async def _dag_deploy(args: argparse.Namespace, db: StateDatabase) -> int:
    document = load_dag(args.file)
    repo = SqlRepository(db.url())
    try:
        result = await deploy(
            repo,
            document,
            clock=SystemClock(),
            org_slug=args.org,
            storage_root=args.storage_root,
        )
    finally:
        await repo.close()
    print_deploy(result)
    return 0


async def _dag_rollback(args: argparse.Namespace, db: StateDatabase) -> int:
    clock = SystemClock()
    repo = SqlRepository(db.url())
    try:
        result = await rollback(
            repo,
            args.dag_name,
            org_slug=args.org,
            clock=clock,
            cancel=TaskQueue(repo, clock=clock).cancel,
        )
    finally:
        await repo.close()
    print(f"{result.dag_name}: version {result.current_version_id} is current")
    for version in result.abandoned_version_ids:
        print(f"  abandoned version {version}")
    print(f"  canceled {len(result.canceled_task_ids)} unfinished task(s)")
    return 0


# --- starting Trace -----------------------------------------------------------------

_START_RULE = (
    "A new (or older) SQLite state database is migrated by this command; a Postgres one "
    "must be at the newest schema revision (run `trace-lite db upgrade --db URL` first)."
)


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tasks", type=positive_int("--tasks"), default=1000)
    parser.add_argument("--workers", type=positive_int("--workers"), default=4)
    parser.add_argument("--batch", type=positive_int("--batch"), default=25)


def _demo(args: argparse.Namespace, db: StateDatabase) -> int:
    config = DemoConfig(db.url(), tasks=args.tasks, workers=args.workers, batch=args.batch)
    anyio.run(run_demo, config, sys.stdout)
    return 0


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=port, default=8000, help="port to bind (default 8000)")
    parser.add_argument(
        "--internal-token-file",
        help="file holding the internal bearer token (must not be readable by others)",
    )
    parser.add_argument(
        "--operators", help="module:attribute of the OperatorRegistry for in-process jobs"
    )
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("TRACE_REDIS_URL") or None,
        help="Redis (redis://host:port/db) carrying the v1 worker streams "
        "(default $TRACE_REDIS_URL; none: claims read the database)",
    )
    parser.add_argument(
        "--stream-idle-seconds",
        type=float,
        default=120.0,
        help="with --redis-url: a stream message left pending this long by a worker "
        "is taken over by another (a dead worker's; default 120, above the lease TTL)",
    )
    # For process tests only (trace_lite.fault_points), so not in --help.
    parser.add_argument("--fault-point", default=None, help=argparse.SUPPRESS)


def _serve(args: argparse.Namespace, db: StateDatabase) -> int:
    # Imported here: the HTTP stack (FastAPI, uvicorn) is the optional `http` extra.
    from trace_lite.serve import ServeConfig, read_internal_token, serve

    # The token first: a start refused for want of one creates no database.
    token = read_internal_token(args.internal_token_file, os.environ)
    config = ServeConfig(
        db.url(),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        operators=args.operators,
        data_dir=str(db.data_dir),
        data_database_url=args.data_db,
        redis_url=args.redis_url,
        stream_idle_seconds=args.stream_idle_seconds,
        fault_point=args.fault_point,
    )
    serve(config, token)
    return 0


def _worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api", required=True, help="base URL of `trace-lite serve`")
    parser.add_argument(
        "--streams", required=True, help="comma-separated worker streams, in priority order"
    )
    parser.add_argument("--operators", help="module:attribute of the OperatorRegistry to run")
    parser.add_argument("--worker-id", help="worker id (default <host>-<pid>)")
    parser.add_argument(
        "--max-tasks", type=positive_int("--max-tasks"), help="exit after this many tasks"
    )
    parser.add_argument(
        "--max-wait-ms",
        type=positive_int("--max-wait-ms"),
        default=10_000,
        help="long-poll wait of one claim (default 10000)",
    )


def _worker(args: argparse.Namespace, db: StateDatabase) -> int:
    from trace_lite.worker_cli import WorkerConfig, default_worker_id, worker_main

    config = WorkerConfig(
        api=args.api,
        streams=tuple(s.strip() for s in args.streams.split(",")),
        worker_id=args.worker_id or default_worker_id(),
        operators=args.operators,
        max_tasks=args.max_tasks,
        max_wait_ms=args.max_wait_ms,
    )
    return worker_main(config, os.environ)


def _run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="the DAG file, e.g. examples/chain_pipeline.yaml")
    parser.add_argument(
        "--blocks",
        type=positive_int("--blocks"),
        help="follow this many blocks (default: the DAG's)",
    )
    parser.add_argument(
        "--workers", type=positive_int("--workers"), default=4, help="worker threads"
    )
    parser.add_argument(
        "--rematerialize",
        metavar="DATASET",
        help="rebuild DATASET (and what depends on it) as new versions; watch them swap in",
    )
    parser.add_argument("--spark-master", default="local[*]", help="Spark master (local[*])")
    parser.add_argument("--spark-remote", help="Spark Connect URL (sc://host:port) instead")
    parser.add_argument(
        "--timeout", type=positive_int("--timeout"), default=3600, help="give up after (s)"
    )


def _run(args: argparse.Namespace, db: StateDatabase) -> int:
    from trace_lite.platform import LiteConfig
    from trace_lite.run_command import RunOptions, run_pipeline
    from trace_lite.spark import SparkConfig

    config = LiteConfig(
        data_dir=db.data_dir,
        database_url=db.url(),
        data_database_url=args.data_db,
        workers=args.workers,
        spark=SparkConfig(master=args.spark_master, remote=args.spark_remote),
    )
    options = RunOptions(
        Path(args.file),
        config,
        blocks=args.blocks,
        rematerialize=args.rematerialize,
        timeout_seconds=args.timeout,
    )
    summary = anyio.run(run_pipeline, options, sys.stdout)
    return 0 if summary.finished else 1


# --- the table ----------------------------------------------------------------------

_GROUPS = {
    "db": "database schema",
    "dag": "validate, deploy and roll back DAG files",
    **EUTERPE_GROUPS,
    **PEOPLE_GROUPS,
}

COMMANDS: tuple[Command, ...] = (
    Command(
        ("db", "upgrade"),
        "apply migrations up to the newest revision (creates a new SQLite file)",
        Use.UPGRADE,
        _db_upgrade,
    ),
    Command(
        ("db", "check"),
        "compare an existing database with the declared schema",
        Use.EXISTING,
        _db_check,
    ),
    Command(
        ("dag", "validate"),
        "check a DAG file; with --db or --data-dir, also against the dataset registry",
        Use.OPTIONAL,
        _dag_validate,
        _file_and_org,
    ),
    Command(
        ("dag", "deploy"),
        "deploy a DAG file (a new version if it changed)",
        Use.READY,
        in_event_loop(_dag_deploy),
        _deploy_arguments,
    ),
    Command(
        ("dag", "rollback"),
        "undo the last deploy of a DAG",
        Use.READY,
        in_event_loop(_dag_rollback),
        _rollback_arguments,
    ),
    *STATUS_COMMANDS,
    *LINEAGE_COMMANDS,
    *OPS_COMMANDS,
    *CONTROL_COMMANDS,
    Command(
        ("run",),
        "run a pipeline DAG end to end in this process, with live progress",
        Use.START,
        _run,
        _run_arguments,
        description="Starts the whole lite platform (Dispatcher, workers, Spark, sink), "
        "deploys the DAG, follows its source over the block range and prints a summary. "
        + _START_RULE,
        data_database=True,
    ),
    Command(
        ("serve",),
        "serve the control-plane HTTP API with the Dispatcher running",
        Use.START,
        _serve,
        _serve_arguments,
        description="The internal token is read from $TRACE_INTERNAL_TOKEN or from "
        "--internal-token-file (never from the command line). " + _START_RULE,
        data_database=True,
    ),
    Command(
        ("worker",),
        "claim tasks of worker streams over HTTP and run them",
        Use.NONE,
        _worker,
        _worker_arguments,
        description="The internal token is read from $TRACE_INTERNAL_TOKEN "
        "(never from the command line). SIGTERM finishes the running task, then exits. "
        "A worker opens no database: it works through the HTTP API of `trace-lite serve`, "
        "which creates or checks the state database as `serve --help` says.",
    ),
    Command(
        ("demo",),
        "enqueue, claim, heartbeat, fail, reclaim and complete",
        Use.START,
        _demo,
        _demo_arguments,
        description="The ownership protocol alone, printed as it happens. " + _START_RULE,
    ),
    *EUTERPE_COMMANDS,
    *PEOPLE_COMMANDS,
)
"""Every ``trace-lite`` subcommand, in ``--help`` order."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code.

    Usage errors (bad arguments, a missing or unmigrated database, a bad
    URL or token) print one line on stderr and return 2; no traceback.
    """
    args = build_parser("trace-lite", __doc__ or "", COMMANDS, _GROUPS).parse_args(argv)
    command: Command = args.command
    db = StateDatabase(command.database, getattr(args, "db", None), getattr(args, "data_dir", None))
    try:
        if getattr(args, "data_db", None):
            parse_database_url(args.data_db)  # refused before anything starts, naming the URL
        return command.run(args, db)
    except DagValidationError as exc:
        return _print_problems(exc)
    except ConfigurationError as exc:
        print(f"trace-lite: error: {exc}", file=sys.stderr)
        return 2
    except TraceError as exc:
        print(f"trace-lite: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
