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
    ``ratio_dedupe`` the same with dedupe keys.

One JSON object per pair and run, then one summary per pair with the
medians of both sides and of the per-run ratios.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import venv
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psycopg

from benchmarks._common import configure_logging, emit, load_average, log, median
from trace_core.storage.url import parse_database_url
from trace_lite.pgcluster import PostgresCluster

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "benchmarks" / "peers"
PAIRS = ("postgres-drain", "sqlite-drain", "postgres-latency", "postgres-enqueue")
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
# Further figures of Trace's row, each with its own ratio to the same peer
# figure (``ratio_<name>``): name -> key in Trace's row.
_EXTRA_FIGURES = {"postgres-enqueue": {"dedupe": "dedupe_tasks_per_s"}}


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    description = (__doc__ or "").split("\n")[0]
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=description)
    p.add_argument("--runs", type=int, default=3, help="runs of every pair; summaries are medians")
    p.add_argument(
        "--tasks", type=int, default=30_000, help="drain and enqueue: tasks (jobs) per run"
    )
    p.add_argument("--samples", type=int, default=300, help="latency: samples per run")
    p.add_argument(
        "--pairs", default=",".join(PAIRS), help=f"comma-separated subset of {', '.join(PAIRS)}"
    )
    p.add_argument("--peers-venv", type=Path, default=ROOT / ".peers-venv")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    args.pair_list = [x.strip() for x in args.pairs.split(",") if x.strip()]
    unknown = sorted(set(args.pair_list) - set(PAIRS))
    if unknown:
        p.error(f"--pairs: unknown {', '.join(unknown)} (choose from {', '.join(PAIRS)})")
    if args.runs < 1 or args.tasks < 1 or args.samples < 1:
        p.error("--runs, --tasks and --samples must be >= 1")
    return args


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


def _json_rows(command: list[str]) -> list[dict[str, Any]]:
    """Run a benchmark command; its JSON output lines (stderr passes through)."""
    log.info("+ %s", " ".join(command))
    out = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        if line.startswith("{"):
            rows.append(json.loads(line))
    return rows


def _only(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    found = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    if len(found) != 1:
        raise RuntimeError(f"expected one row with {match}, got {len(found)}: {rows}")
    return found[0]


class Sides:
    """The commands of both sides of every pair, on one server."""

    def __init__(self, args: argparse.Namespace, server_url: str, peers: Path) -> None:
        self.args = args
        self.url = server_url
        self.peers = str(peers)

    def settle(self) -> None:
        """Flush what the previous side left dirty, so neither side pays for the other's writes."""
        with psycopg.connect(parse_database_url(self.url).conninfo(), autocommit=True) as conn:
            conn.execute("CHECKPOINT")

    def trace(self, pair: str) -> dict[str, Any]:
        queue = [sys.executable, "-m", "benchmarks.queue"]
        if pair == "postgres-drain":
            drain = ["--tasks", str(self.args.tasks), "--workers", "4", "--consumers", "1"]
            rows = _json_rows([*queue, "--engine", "postgres", "--db", self.url, *drain])
            return _only(rows, mode="drain")
        if pair == "sqlite-drain":
            drain = ["--tasks", str(self.args.tasks), "--workers", "1", "--consumers", "1"]
            rows = _json_rows([*queue, "--engine", "sqlite", *drain, "--batch", "500"])
            return _only(rows, mode="drain")
        if pair == "postgres-enqueue":
            return self._trace_enqueue()
        samples = ["--samples", str(self.args.samples)]
        rows = _json_rows(
            [*queue, "--engine", "postgres", "--db", self.url, "--mode", "latency", *samples]
        )
        return _only(rows, scenario="cross-process")

    def _trace_enqueue(self) -> dict[str, Any]:
        """Both Trace rows of the enqueue pair (dedupe keys off, then on), the
        second after its own ``CHECKPOINT``; the row of the first with the
        second's figure as ``dedupe_tasks_per_s``."""
        command = [sys.executable, "-m", "benchmarks.enqueue", "--engine", "postgres"]
        command += ["--db", self.url, "--tasks", str(self.args.tasks)]
        command += ["--batch", str(ENQUEUE_BATCH)]
        plain = _only(_json_rows(command), mode="enqueue")
        self.settle()
        dedupe = _only(_json_rows([*command, "--dedupe-keys"]), mode="enqueue")
        if not (plain["verified"] and dedupe["verified"]):
            raise RuntimeError(f"enqueue not verified: {plain} {dedupe}")
        return {**plain, "dedupe_tasks_per_s": dedupe["tasks_per_s"], "dedupe_row": dedupe}

    def peer(self, pair: str) -> dict[str, Any]:
        if pair == "postgres-drain":
            script = [self.peers, str(PEERS / "pgqueuer_drain.py"), "--db", self.url]
            jobs = ["--jobs", str(self.args.tasks), "--workers", "4", "--runs", "1"]
            return _only(_json_rows([*script, *jobs]), peer="pgqueuer", summary=True)
        if pair == "sqlite-drain":
            script = [self.peers, str(PEERS / "huey_drain.py"), "--jobs", str(self.args.tasks)]
            rows = _json_rows([*script, "--workers", "4", "--sync", "normal", "--runs", "1"])
            return _only(rows, peer="huey", summary=True)
        if pair == "postgres-enqueue":
            script = [self.peers, str(PEERS / "pgqueuer_enqueue.py"), "--db", self.url]
            jobs = ["--jobs", str(self.args.tasks), "--batch", str(ENQUEUE_BATCH), "--runs", "1"]
            row = _only(_json_rows([*script, *jobs]), peer="pgqueuer", summary=True)
            if not row["all_verified"]:
                raise RuntimeError(f"PgQueuer's enqueue not verified: {row}")
            return row
        script = [self.peers, str(PEERS / "pgqueuer_latency.py"), "--db", self.url]
        rows = _json_rows([*script, "--samples", str(self.args.samples)])
        return _only(rows, peer="pgqueuer")


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
    for name, key in _EXTRA_FIGURES.get(pair, {}).items():
        extra[f"trace_{name}"] = float(got["trace"][key])
        extra[f"ratio_{name}"] = round(float(got["trace"][key]) / peer_figure, 3)
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


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    configure_logging(args.verbose)
    peers = peers_python(args.peers_venv)
    results: dict[str, list[dict[str, Any]]] = {pair: [] for pair in args.pair_list}
    with PostgresCluster() as cluster:
        sides = Sides(args, cluster.url("postgres"), peers)
        for run in range(args.runs):
            for pair in args.pair_list:
                row = _measure(pair, run, sides)
                emit(row)
                results[pair].append(row)
    for pair, rows in results.items():
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
        for name in _EXTRA_FIGURES.get(pair, {}):
            summary[f"trace_{name}_median"] = round(median([r[f"trace_{name}"] for r in rows]), 3)
            summary[f"ratio_{name}_median"] = round(median([r[f"ratio_{name}"] for r in rows]), 3)
            summary[f"ratios_{name}"] = [r[f"ratio_{name}"] for r in rows]
        emit(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
