"""Trace side by side with its peers, on one machine and one Postgres server.

    python -m benchmarks.compare [--runs 3] [--tasks 30000] [--samples 300] [--pairs ...]

The peers run in their own virtualenv (``--peers-venv``, default
``.peers-venv`` at the repository root; made and filled from
``benchmarks/peers/requirements.txt`` when it has no interpreter yet), so
their dependencies never mix with Trace's. One throwaway PostgreSQL cluster
serves both sides. Each run measures every pair, the two sides back to back
(which goes first alternates by run, so a drift of the machine does not
always favour the same side), each after a ``CHECKPOINT`` so that neither
pays for the other's dirty pages. Pairs:

``postgres-drain``
    ``benchmarks.queue --engine postgres`` (4 worker processes, 1 consumer
    each, batch 200) against PgQueuer (4 worker processes, its default batch
    of 10). Ratio: Trace tasks/s over PgQueuer jobs/s.
``sqlite-drain``
    ``benchmarks.queue --engine sqlite`` (1 worker process, batch 500)
    against huey's ``SqliteHuey`` (4 worker processes), both with WAL and
    ``synchronous=NORMAL``. Ratio: Trace over huey.
``postgres-latency``
    Idle enqueue -> claim across processes (LISTEN/NOTIFY), one task every
    20 ms: Trace's ``cross-process`` scenario against a PgQueuer worker.
    Ratio: PgQueuer's median over Trace's (above 1: Trace is faster).
``postgres-enqueue``
    ``benchmarks.enqueue`` (``TaskQueue.create`` in batches of 1,000 with
    their wake-up outbox rows), once without and once with a dedupe key per
    task, against PgQueuer's ``enqueue`` with lists (batches of 1,000), the
    same number of tasks (jobs). Ratio: Trace tasks/s over PgQueuer jobs/s;
    ``ratio_dedupe`` the same with a dedupe key per task on both sides
    (PgQueuer's ``dedupe_key`` list with ``on_conflict="skip"``). Trace's side also measures
    its floor (``benchmarks.enqueue --floor``: the same task rows, one bare
    ``INSERT … SELECT unnest(…)`` per batch, no wake-up rows):
    ``ratio_floor`` (``ratio_dedupe_floor``) is Trace's tasks/s over it;
    ``ratio_floor_peer`` is the floor over PgQueuer (the most any enqueue on
    the specification's schema could reach), ``ratio_floor_no_fk_peer`` the
    same floor without the per-row foreign-key check on ``jobs``.

The floor pairs (:mod:`benchmarks._compare_floors`) read Trace against the
d016d38 baseline or a floor measured in the same run, each with its issue-19
target: ``http-baseline`` (the worker's HTTP paths against the baseline tree,
with the HTTP floor), ``routing-floor`` and ``handoff-floor`` (per engine of
``--engines``). Their rows carry ``figures`` and ``targets``; their summaries
``figures_median`` and each target's median and whether it is ``met``.

One JSON object per pair and run, then one summary per pair (and engine)
with the medians of both sides and of the per-run ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import venv
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks._common import checkpoint, configure_logging, emit, load_average, log, median
from benchmarks._compare_floors import (
    FLOOR_PAIRS,
    BaselineTree,
    FloorSides,
    json_rows,
    only_row,
    summarize_floor_pair,
)
from trace_lite.pgcluster import PostgresCluster

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "benchmarks" / "peers"
PEER_PAIRS = ("postgres-drain", "sqlite-drain", "postgres-latency", "postgres-enqueue")
PAIRS = (*PEER_PAIRS, *FLOOR_PAIRS)
ENGINES = ("postgres", "sqlite")
BASELINE = "d016d38"
"""The commit issue 19 measured its HTTP figures on."""
ENQUEUE_BATCH = 1000

# Each pair's figure: what it is, its key in Trace's row, its key in the
# peer's row, and whether higher is better. A drain peer's row is its
# one-run summary.
_FIGURES = {
    "postgres-drain": ("tasks_per_s / jobs_per_s", "tasks_per_s", "median_jobs_per_s", True),
    "sqlite-drain": ("tasks_per_s / jobs_per_s", "tasks_per_s", "median_jobs_per_s", True),
    "postgres-latency": ("median_ms", "median_ms", "median_ms", False),
    "postgres-enqueue": ("tasks_per_s / jobs_per_s", "tasks_per_s", "median_jobs_per_s", True),
}
# Further figures of Trace's row, each with its own ratio (``ratio_<name>``):
# name -> (key in Trace's row, the key in Trace's row it is divided by, or
# None for the peer's figure, or "peer_<key>" for another figure of the
# peer's row).
_PEER_KEY = "peer_"
_EXTRA_FIGURES: dict[str, dict[str, tuple[str, str | None]]] = {
    "postgres-enqueue": {
        "dedupe": ("dedupe_tasks_per_s", "peer_dedupe_jobs_per_s"),
        "floor": ("tasks_per_s", "floor_tasks_per_s"),
        "dedupe_floor": ("dedupe_tasks_per_s", "dedupe_floor_tasks_per_s"),
        "floor_peer": ("floor_tasks_per_s", None),
        "floor_no_fk_peer": ("floor_no_fk_tasks_per_s", None),
    }
}


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    description = (__doc__ or "").split("\n")[0]
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=description)
    p.add_argument("--runs", type=int, default=3, help="runs of every pair; summaries are medians")
    p.add_argument(
        "--tasks", type=int, default=30_000, help="drain and enqueue: tasks (jobs) per run"
    )
    p.add_argument(
        "--samples", type=int, default=300, help="postgres-latency and handoff-floor: samples"
    )
    p.add_argument(
        "--pairs",
        nargs="+",
        default=[",".join(PAIRS)],
        help=f"pairs, comma- or space-separated, of {', '.join(PAIRS)}",
    )
    p.add_argument(
        "--engines",
        default=",".join(ENGINES),
        help="routing-floor and handoff-floor: comma-separated engines",
    )
    p.add_argument("--http-tasks", type=int, default=400, help="http-baseline: tasks per path")
    p.add_argument("--http-workers", type=int, default=4, help="http-baseline: worker processes")
    p.add_argument(
        "--http-paths",
        default="internal,task,v1",
        help="http-baseline: comma-separated paths of benchmarks.api (the floor comes with them)",
    )
    p.add_argument(
        "--baseline",
        default=BASELINE,
        help="http-baseline: the commit the new code is read against",
    )
    p.add_argument(
        "--routing-events", type=int, default=5000, help="routing-floor: distinct events"
    )
    p.add_argument(
        "--db",
        help="a Postgres server URL both sides use (default: a throwaway cluster); "
        "its role must be allowed to CHECKPOINT",
    )
    p.add_argument("--peers-venv", type=Path, default=ROOT / ".peers-venv")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    args.pair_list = _names(p, "--pairs", ",".join(args.pairs), PAIRS)
    args.engine_list = _names(p, "--engines", args.engines, ENGINES)
    args.http_path_list = _names(p, "--http-paths", args.http_paths, ("internal", "task", "v1"))
    for name in ("runs", "tasks", "samples", "http_tasks", "http_workers", "routing_events"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def _names(p: argparse.ArgumentParser, option: str, given: str, known: Sequence[str]) -> list[str]:
    """The comma-separated names of ``option``, each one of ``known``, in the given order."""
    names = list(dict.fromkeys(x.strip() for x in given.replace(" ", ",").split(",") if x.strip()))
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        what = ", ".join(unknown) or "nothing given"
        p.error(f"{option}: unknown {what} (choose from {', '.join(known)})")
    return names


def peers_python(venv_dir: Path) -> Path:
    """The peers' interpreter, made with their pinned requirements if missing."""
    python = venv_dir / "bin" / "python"
    if not python.exists():
        log.info("making the peers' virtualenv in %s", venv_dir)
        venv.create(venv_dir, with_pip=True)
        requirements = PEERS / "requirements.txt"
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "-r", str(requirements)], check=True
        )
    return python


class Sides:
    """The commands of both sides of every pair, on one server."""

    def __init__(self, args: argparse.Namespace, server_url: str, peers: Path) -> None:
        self.args = args
        self.url = server_url
        self.peers = str(peers)

    def settle(self) -> None:
        """Flush what the previous side left dirty, so neither side pays for the other's writes."""
        checkpoint(self.url)

    def trace(self, pair: str) -> dict[str, Any]:
        queue = [sys.executable, "-m", "benchmarks.queue"]
        if pair == "postgres-drain":
            drain = ["--tasks", str(self.args.tasks), "--workers", "4", "--consumers", "1"]
            rows = json_rows([*queue, "--engine", "postgres", "--db", self.url, *drain])
            return only_row(rows, mode="drain")
        if pair == "sqlite-drain":
            drain = ["--tasks", str(self.args.tasks), "--workers", "1", "--consumers", "1"]
            rows = json_rows([*queue, "--engine", "sqlite", *drain, "--batch", "500"])
            return only_row(rows, mode="drain")
        if pair == "postgres-enqueue":
            return self._trace_enqueue()
        samples = ["--samples", str(self.args.samples)]
        rows = json_rows(
            [*queue, "--engine", "postgres", "--db", self.url, "--mode", "latency", *samples]
        )
        return only_row(rows, scenario="cross-process")

    def _trace_enqueue(self) -> dict[str, Any]:
        """Both Trace rows of the enqueue pair (dedupe keys off, then on), the
        second after its own ``CHECKPOINT``; the row of the first with the
        second's figure as ``dedupe_tasks_per_s``."""
        command = [sys.executable, "-m", "benchmarks.enqueue", "--engine", "postgres"]
        command += ["--db", self.url, "--tasks", str(self.args.tasks)]
        command += ["--batch", str(ENQUEUE_BATCH), "--floor"]
        plain_rows = json_rows(command)
        self.settle()
        dedupe_rows = json_rows([*command, "--dedupe-keys"])
        plain, dedupe = only_row(plain_rows, mode="enqueue"), only_row(dedupe_rows, mode="enqueue")
        floor = only_row(plain_rows, mode="enqueue-floor")
        dedupe_floor = only_row(dedupe_rows, mode="enqueue-floor")
        if not all(r["verified"] for r in (plain, dedupe, floor, dedupe_floor)):
            raise RuntimeError(f"enqueue not verified: {plain_rows} {dedupe_rows}")
        return {
            **plain,
            "dedupe_tasks_per_s": dedupe["tasks_per_s"],
            "dedupe_floor_tasks_per_s": dedupe_floor["tasks_per_s"],
            "dedupe_row": dedupe,
            "floor_row": floor,
            "dedupe_floor_row": dedupe_floor,
        }

    def peer(self, pair: str) -> dict[str, Any]:
        if pair == "postgres-drain":
            script = [self.peers, str(PEERS / "pgqueuer_drain.py"), "--db", self.url]
            jobs = ["--jobs", str(self.args.tasks), "--workers", "4", "--runs", "1"]
            return only_row(json_rows([*script, *jobs]), peer="pgqueuer", summary=True)
        if pair == "sqlite-drain":
            script = [self.peers, str(PEERS / "huey_drain.py"), "--jobs", str(self.args.tasks)]
            rows = json_rows([*script, "--workers", "4", "--sync", "normal", "--runs", "1"])
            return only_row(rows, peer="huey", summary=True)
        if pair == "postgres-enqueue":
            # Without, then with dedupe keys (after its own CHECKPOINT), as Trace's side.
            script = [self.peers, str(PEERS / "pgqueuer_enqueue.py"), "--db", self.url]
            script += ["--jobs", str(self.args.tasks), "--batch", str(ENQUEUE_BATCH)]
            row = only_row(json_rows([*script, "--runs", "1"]), peer="pgqueuer", summary=True)
            self.settle()
            rows = json_rows([*script, "--runs", "1", "--dedupe-keys"])
            dedupe = only_row(rows, peer="pgqueuer", summary=True)
            if not (row["all_verified"] and dedupe["all_verified"]):
                raise RuntimeError(f"PgQueuer's enqueue not verified: {row} {dedupe}")
            return {**row, "dedupe_jobs_per_s": dedupe["median_jobs_per_s"], "dedupe_row": dedupe}
        script = [self.peers, str(PEERS / "pgqueuer_latency.py"), "--db", self.url]
        rows = json_rows([*script, "--samples", str(self.args.samples)])
        return only_row(rows, peer="pgqueuer")


def _measure(pair: str, run: int, sides: Sides) -> dict[str, Any]:
    figure, trace_key, peer_key, higher_better = _FIGURES[pair]
    order: list[tuple[str, Callable[[str], dict[str, Any]]]] = [
        ("trace", sides.trace),
        ("peer", sides.peer),
    ]
    if run % 2:
        order.reverse()
    load = load_average()
    got: dict[str, dict[str, Any]] = {}
    for side, measure in order:
        sides.settle()
        got[side] = measure(pair)
    trace_figure = float(got["trace"][trace_key])
    peer_row = got["peer"]
    peer_figure = float(peer_row[peer_key])
    ratio = trace_figure / peer_figure if higher_better else peer_figure / trace_figure
    extra: dict[str, Any] = {}
    for name, (key, over) in _EXTRA_FIGURES.get(pair, {}).items():
        # The figure that is not Trace's or the peer's main one: the
        # numerator over the peer, or the floor Trace is divided by; over
        # another figure of the peer, both.
        if over is None:
            base = peer_figure
        elif over.startswith(_PEER_KEY):
            base = float(peer_row[over.removeprefix(_PEER_KEY)])
            extra[over] = base
        else:
            base = float(got["trace"][over])
        shown = _shown(key, over)
        extra[shown] = float(got["trace"][shown])
        extra[f"ratio_{name}"] = round(float(got["trace"][key]) / base, 3)
    return {
        "pair": pair,
        "run": run,
        "first": order[0][0],
        "trace": trace_figure,
        "peer": peer_figure,
        "figure": figure,
        "trace_row": got["trace"],
        "peer_row": peer_row,
        "ratio": round(ratio, 3),
        **extra,
        "load_average_before": load,
    }


def _measure_floor_pair(pair: str, engine: str, run: int, sides: FloorSides) -> dict[str, Any]:
    load = load_average()
    got = sides.measure(pair, engine, run)
    return {"pair": pair, "engine": engine, "run": run, **got, "load_average_before": load}


def _shown(key: str, over: str | None) -> str:
    """The row key of an extra figure: the numerator's own key when it is
    divided by a figure of the peer, else the floor's (its divisor's) key."""
    return key if over is None or over.startswith(_PEER_KEY) else over


def _peer_summary(pair: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    summary = {
        "pair": pair,
        "summary": True,
        "runs": len(rows),
        "figure": rows[0]["figure"],
        "trace_median": round(median([r["trace"] for r in rows]), 3),
        "peer_median": round(median([r["peer"] for r in rows]), 3),
        "ratio_median": round(median([r["ratio"] for r in rows]), 3),
        "ratios": [r["ratio"] for r in rows],
    }
    for name, (key, over) in _EXTRA_FIGURES.get(pair, {}).items():
        shown = _shown(key, over)
        summary[f"{shown}_median"] = round(median([r[shown] for r in rows]), 3)
        if over is not None and over.startswith(_PEER_KEY):
            summary[f"{over}_median"] = round(median([r[over] for r in rows]), 3)
        summary[f"ratio_{name}_median"] = round(median([r[f"ratio_{name}"] for r in rows]), 3)
        summary[f"ratios_{name}"] = [r[f"ratio_{name}"] for r in rows]
    return summary


@contextlib.contextmanager
def _server(db: str | None) -> Iterator[str]:
    """The Postgres server URL both sides use: ``db``, or a throwaway cluster's."""
    if db is not None:
        yield db
        return
    with PostgresCluster() as cluster:
        yield cluster.url("postgres")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the pairs (module docstring); the exit code."""
    args = _parse(argv)
    configure_logging(args.verbose)
    peer_pairs = [p for p in args.pair_list if p in PEER_PAIRS]
    floor_pairs = [p for p in args.pair_list if p in FLOOR_PAIRS]
    # The peers' virtualenv is made only when a peer runs.
    peers = peers_python(args.peers_venv) if peer_pairs else Path(sys.executable)
    keys = [(p, "postgres") for p in peer_pairs]
    for pair in floor_pairs:
        engines = ["postgres"] if pair == "http-baseline" else args.engine_list
        keys += [(pair, engine) for engine in engines]
    results: dict[tuple[str, str], list[dict[str, Any]]] = {key: [] for key in keys}
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(_server(args.db))
        baseline = None
        if "http-baseline" in floor_pairs:
            baseline = stack.enter_context(BaselineTree(args.baseline))
        sides = Sides(args, url, peers)
        floors = FloorSides(
            server_url=url,
            settle=sides.settle,
            http_tasks=args.http_tasks,
            http_workers=args.http_workers,
            http_paths=args.http_path_list,
            routing_events=args.routing_events,
            samples=args.samples,
            baseline=baseline,
        )
        for run in range(args.runs):
            for pair, engine in keys:
                if pair in PEER_PAIRS:
                    row = _measure(pair, run, sides)
                else:
                    row = _measure_floor_pair(pair, engine, run, floors)
                emit(row)
                results[(pair, engine)].append(row)
    for (pair, engine), rows in results.items():
        if pair in PEER_PAIRS:
            emit(_peer_summary(pair, rows))
        else:
            head = {"pair": pair, "engine": engine, "summary": True, "runs": len(rows)}
            emit({**head, **summarize_floor_pair(rows)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
