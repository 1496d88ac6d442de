"""``trace-lite lineage DATASET [COLUMN]``: where a dataset's columns come from and go.

Reads the recorded column lineage (the ``lineage`` area of the state
database): upstream (what the dataset, or its column, is computed from,
transitively) and downstream (what is computed from it), to ``--depth``
levels, with each edge's kind; each dataset's current version's lineage
(``--dataset-version ID``: that version of DATASET's, upstream). ``--openlineage
FILE|URL`` also writes the upstream lineage as OpenLineage run events
(:mod:`trace_lite.lineage_openlineage`).
"""

from __future__ import annotations

import argparse
import uuid
from datetime import UTC, datetime

from trace_core.dag.lineage import DATASET_WIDE
from trace_core.errors import NotFound
from trace_core.storage.ports import LineageRow
from trace_core.storage.sql import SqlRepository
from trace_lite.cli_commands import Command, in_event_loop, positive_int
from trace_lite.lineage_openlineage import openlineage_events, send_events
from trace_lite.state_database import StateDatabase, Use
from trace_lite.tables import render_table

__all__ = ["LINEAGE_COMMANDS", "lineage_lines"]


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dataset")
    parser.add_argument("column", nargs="?", help="only this column (and what decides its rows)")
    parser.add_argument("--org", default="default", help="org slug (default 'default')")
    parser.add_argument(
        "--direction", choices=("up", "down", "both"), default="both", help="(default both)"
    )
    parser.add_argument(
        "--depth", type=positive_int("--depth"), default=10, help="levels to follow (10)"
    )
    parser.add_argument(
        "--dataset-version",
        type=_version_id,
        metavar="ID",
        help="upstream of this dataset version of DATASET (default: the current one)",
    )
    parser.add_argument(
        "--openlineage",
        metavar="FILE|URL",
        help="also write the upstream lineage as OpenLineage run events (JSON lines or POST)",
    )


def _version_id(raw: str) -> uuid.UUID:
    try:
        return uuid.UUID(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--dataset-version: {raw!r} is not a dataset version id"
        ) from None


def _column(name: str, column: str) -> str:
    # the output '*' holds what decides the rows (filters, joins, grouping)
    return f"{name}.{column}" if column != DATASET_WIDE else f"{name} (rows)"


def _table(rows: list[LineageRow]) -> list[str]:
    if not rows:
        return ["  (none recorded)"]
    body = [
        (
            r.depth,
            _column(r.output_name, r.output_column),
            f"{r.input_name}.{r.input_column}",
            r.kind,
        )
        for r in rows
    ]
    header = ("depth", "output", "computed from", "kind")
    return ["  " + line for line in render_table(header, body)]


async def lineage_lines(repo: SqlRepository, args: argparse.Namespace) -> list[str]:
    """The command's output (and its OpenLineage export, when asked)."""
    async with repo.read() as tx:
        org = await tx.registry.find_org(args.org)
        found = []
        if org is not None:
            found = await tx.registry.datasets_named_or_produced_by(org, names=[args.dataset])
        if org is None or not found:
            raise NotFound(f"no dataset {args.dataset!r} in org {args.org!r}")
        dataset = found[0].dataset_uuid
        up = await tx.lineage.upstream(
            dataset,
            args.column,
            max_depth=args.depth,
            dataset_version=getattr(args, "dataset_version", None),
        )
        down = await tx.lineage.downstream(dataset, args.column, max_depth=args.depth)
        jobs = {}
        if args.openlineage:
            names = {r.output_name for r in up} | {r.input_name for r in up}
            for d in await tx.registry.datasets_named_or_produced_by(org, names=names):
                jobs[d.dataset_uuid] = f"{d.producer_dag_name}.{d.producer_job_name}"
    subject = args.dataset + (f".{args.column}" if args.column else "")
    lines = []
    if args.direction in ("up", "both"):
        lines += [f"upstream of {subject}", *_table(up)]
    if args.direction in ("down", "both"):
        lines += [f"downstream of {subject}", *_table(down)]
    if args.openlineage:
        by_job = {r.job_id: jobs.get(r.output_dataset, "unknown") for r in up if r.job_id}
        events = openlineage_events(up, org=args.org, jobs=by_job, event_time=datetime.now(UTC))
        send_events(events, args.openlineage)
        lines.append(f"{len(events)} OpenLineage run event(s) written to {args.openlineage}")
    return lines


async def _run(args: argparse.Namespace, db: StateDatabase) -> int:
    repo = SqlRepository(db.url())
    try:
        lines = await lineage_lines(repo, args)
    finally:
        await repo.close()
    print("\n".join(lines))
    return 0


LINEAGE_COMMANDS: tuple[Command, ...] = (
    Command(
        ("lineage",),
        "a dataset's (or column's) column lineage, upstream and downstream",
        Use.READY,
        in_event_loop(_run),
        _arguments,
        description="Reads the column lineage recorded when the dataset's versions "
        "committed. With --openlineage FILE|URL the upstream lineage is also written "
        "as OpenLineage run events with the columnLineage facet.",
    ),
)
"""``lineage``: read-only, on an existing, current database."""
