"""The ``trace-lite`` command line.

Database URLs come from ``--db`` or the ``TRACE_DATABASE_URL`` environment
variable; the default is the embedded SQLite file ``.trace/trace.db``.
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
from trace_lite.demo import DemoConfig, run_demo
from trace_lite.ops_commands import OPS_COMMANDS, add_ops_commands, run_ops_command
from trace_lite.status_commands import STATUS_COMMANDS, add_status_commands, run_status_command

__all__ = ["main"]

DEFAULT_DB_PATH = Path(".trace") / "trace.db"


def _database_url(arg: str | None) -> str:
    raw = arg or os.environ.get("TRACE_DATABASE_URL")
    if raw:
        parse_database_url(raw)  # validate early, with the field named
        return raw
    DEFAULT_DB_PATH.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{DEFAULT_DB_PATH}"


def _positive(name: str) -> type[int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {value}")
        return value

    return parse  # type: ignore[return-value]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trace-lite", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    db_help = "database URL (sqlite:///path or postgresql://...); default .trace/trace.db"

    db = sub.add_parser("db", help="database schema")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    up = db_sub.add_parser("upgrade", help="apply migrations up to the newest revision")
    up.add_argument("--db", help=db_help)
    check = db_sub.add_parser("check", help="compare the database with the declared schema")
    check.add_argument("--db", help=db_help)

    demo = sub.add_parser("demo", help="enqueue, claim, heartbeat, fail, reclaim and complete")
    demo.add_argument("--db", help=db_help)
    demo.add_argument("--tasks", type=_positive("--tasks"), default=1000)
    demo.add_argument("--workers", type=_positive("--workers"), default=4)
    demo.add_argument("--batch", type=_positive("--batch"), default=25)

    dag = sub.add_parser("dag", help="validate, deploy and roll back DAG files")
    dag_sub = dag.add_subparsers(dest="dag_command", required=True)
    org_help = "org slug (default: the file's org:, else 'default')"
    validate = dag_sub.add_parser(
        "validate", help="check a DAG file; with --db, also against the dataset registry"
    )
    validate.add_argument("file")
    validate.add_argument("--db", help="check input datasets against this database's registry")
    validate.add_argument("--org", help=org_help)
    dep = dag_sub.add_parser("deploy", help="deploy a DAG file (a new version if it changed)")
    dep.add_argument("file")
    dep.add_argument("--db", help=db_help)
    dep.add_argument("--org", help=org_help)
    dep.add_argument(
        "--storage-root", default="s3://trace-lite/", help="prefix of Parquet dataset versions"
    )
    back = dag_sub.add_parser("rollback", help="undo the last deploy of a DAG")
    back.add_argument("dag_name")
    back.add_argument("--db", help=db_help)
    back.add_argument("--org", default="default", help="org slug (default 'default')")
    add_ops_commands(sub, db_help)
    add_status_commands(sub, db_help)

    serve = sub.add_parser(
        "serve",
        help="serve the control-plane HTTP API with the Dispatcher running",
        description="The internal token is read from $TRACE_INTERNAL_TOKEN or from "
        "--internal-token-file (never from the command line).",
    )
    serve.add_argument("--db", help=db_help)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=_port, default=8000, help="port to bind (default 8000)")
    serve.add_argument(
        "--internal-token-file",
        help="file holding the internal bearer token (must not be readable by others)",
    )
    serve.add_argument(
        "--operators", help="module:attribute of the OperatorRegistry for in-process jobs"
    )
    serve.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    serve.add_argument(
        "--data-dir",
        default=".trace",
        help="directory of the signing keys and the credential key (default .trace/)",
    )
    serve.add_argument("--data-db", help="data database URL (default sqlite:///<data-dir>/data.db)")
    worker = sub.add_parser(
        "worker",
        help="claim tasks of worker streams over HTTP and run them",
        description="The internal token is read from $TRACE_INTERNAL_TOKEN "
        "(never from the command line). SIGTERM finishes the running task, then exits.",
    )
    worker.add_argument("--api", required=True, help="base URL of `trace-lite serve`")
    worker.add_argument(
        "--streams", required=True, help="comma-separated worker streams, in priority order"
    )
    worker.add_argument("--operators", help="module:attribute of the OperatorRegistry to run")
    worker.add_argument("--worker-id", help="worker id (default <host>-<pid>)")
    worker.add_argument(
        "--max-tasks", type=_positive("--max-tasks"), help="exit after this many tasks"
    )
    worker.add_argument(
        "--max-wait-ms",
        type=_positive("--max-wait-ms"),
        default=10_000,
        help="long-poll wait of one claim (default 10000)",
    )
    run = sub.add_parser(
        "run",
        help="run a pipeline DAG end to end in this process, with live progress",
        description="Starts the whole lite platform (Dispatcher, workers, Spark, sink), "
        "deploys the DAG, follows its source over the block range and prints a summary.",
    )
    run.add_argument("file", help="the DAG file, e.g. examples/chain_pipeline.yaml")
    run.add_argument("--db", help=db_help)
    run.add_argument("--data-db", help="data database URL (default sqlite:///<data-dir>/data.db)")
    run.add_argument("--data-dir", default=".trace", help="keys, objects, databases (.trace/)")
    run.add_argument(
        "--blocks", type=_positive("--blocks"), help="follow this many blocks (default: the DAG's)"
    )
    run.add_argument("--workers", type=_positive("--workers"), default=4, help="worker threads")
    run.add_argument(
        "--rematerialize",
        metavar="DATASET",
        help="rebuild DATASET (and what depends on it) as new versions; watch them swap in",
    )
    run.add_argument("--spark-master", default="local[*]", help="Spark master (local[*])")
    run.add_argument("--spark-remote", help="Spark Connect URL (sc://host:port) instead")
    run.add_argument(
        "--timeout", type=_positive("--timeout"), default=3600, help="give up after (s)"
    )
    return parser


def _run(args: argparse.Namespace) -> int:
    from trace_lite.platform import LiteConfig
    from trace_lite.run_command import RunOptions, run_pipeline
    from trace_lite.spark import SparkConfig

    if args.db:
        parse_database_url(args.db)
    if args.data_db:
        parse_database_url(args.data_db)
    config = LiteConfig(
        data_dir=Path(args.data_dir),
        database_url=args.db,
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


def _worker(args: argparse.Namespace) -> int:
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


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--port must be an integer, got {text!r}") from None
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"--port must be within 1..65535, got {value}")
    return value


def _serve(args: argparse.Namespace, url: str) -> int:
    # Imported here: the HTTP stack (FastAPI, uvicorn) is the optional `http` extra.
    from trace_lite.serve import ServeConfig, read_internal_token, serve

    token = read_internal_token(args.internal_token_file, os.environ)
    config = ServeConfig(
        url,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        operators=args.operators,
        data_dir=args.data_dir,
        data_database_url=args.data_db,
    )
    serve(config, token)
    return 0


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


def _dag_validate(args: argparse.Namespace) -> int:
    document = load_dag(args.file)
    if args.db:
        parse_database_url(args.db)
        anyio.run(_validate_against_db, document, args.db, args.org)
    else:
        for warning in document.warnings:
            print(warning)
    spec = document.spec
    print(f"{args.file}: ok ({len(spec.jobs)} jobs, {len(spec.produced())} datasets)")
    return 0


async def _dag_deploy(args: argparse.Namespace, url: str) -> int:
    document = load_dag(args.file)
    repo = SqlRepository(url)
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
    if not result.changed:
        print(f"{result.dag_name}: unchanged (version {result.dag_version_id} {result.status})")
        return 0
    print(f"{result.dag_name}: deployed version {result.dag_version_id} ({result.status})")
    for name, pointer in sorted(result.datasets.items()):
        mark = "new version" if pointer.new_version else "kept"
        print(f"  dataset {name}: {pointer.dataset_version} ({mark})")
    for version in result.abandoned_version_ids:
        print(f"  abandoned building version {version}")
    return 0


async def _dag_rollback(args: argparse.Namespace, url: str) -> int:
    clock = SystemClock()
    repo = SqlRepository(url)
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "dag" and args.dag_command == "validate":
            return _dag_validate(args)
        if args.command == "worker":
            return _worker(args)
        if args.command == "run":
            return _run(args)
        url = _database_url(args.db)
        if args.command == "dag" and args.dag_command == "deploy":
            return anyio.run(_dag_deploy, args, url)
        if args.command == "dag" and args.dag_command == "rollback":
            return anyio.run(_dag_rollback, args, url)
        if args.command in OPS_COMMANDS:
            return anyio.run(run_ops_command, args, url)
        if args.command in STATUS_COMMANDS:
            return anyio.run(run_status_command, args, url)
        if args.command == "serve":
            return _serve(args, url)
        if args.command == "db" and args.db_command == "upgrade":
            print(f"upgraded to {upgrade(url)} (head {head_revision()})")
        elif args.command == "db" and args.db_command == "check":
            diff = schema_diff(url)
            print(json.dumps({"revision": current_revision(url), "differences": len(diff)}))
            for entry in diff:
                print(f"  {entry}")
            return 1 if diff else 0
        elif args.command == "demo":
            config = DemoConfig(url, tasks=args.tasks, workers=args.workers, batch=args.batch)
            anyio.run(run_demo, config, sys.stdout)
        return 0
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
