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

from trace_core.errors import ConfigurationError, TraceError
from trace_core.storage.migrate import current_revision, head_revision, schema_diff, upgrade
from trace_core.storage.url import parse_database_url
from trace_lite.demo import DemoConfig, run_demo

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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = _parser().parse_args(argv)
    try:
        url = _database_url(args.db)
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
    except ConfigurationError as exc:
        print(f"trace-lite: error: {exc}", file=sys.stderr)
        return 2
    except TraceError as exc:
        print(f"trace-lite: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
