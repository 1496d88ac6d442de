"""The pairs of ``benchmarks.compare`` that read Trace against a baseline or a floor.

Issue 19's targets are ratios measured side by side in one run; each pair
here measures both sides of one target in the same run and reports figures
(``figures``: numbers, named) of which some carry a target (``targets``:
``{"at_least": x}`` or ``{"at_most": x}``). Pairs:

``http-baseline``
    ``benchmarks.api --client raw --path <paths>`` on this tree against the
    same benchmark client run on the baseline tree (``--baseline``, d016d38 by
    default): a throwaway detached ``git worktree`` of that commit, with this
    tree's client files copied in (:data:`HTTP_CLIENT`), run with its tree on
    ``PYTHONPATH``, so that only the server code differs. Both
    sides use the same Postgres server; which goes first alternates by run.
    This tree's side also measures the floor (``--path floor``: the same
    workers against a minimal ASGI app running the SQL a triple needs).
    Per path: ``<path>_ratio`` (new triples/s over the baseline's, target
    5), ``<path>_new_cpu_ms`` (this tree's server CPU per triple, target
    1.5 ms), ``<path>_share_of_floor`` and ``<path>_cpu_over_floor``.
``routing-floor``
    ``benchmarks.routing`` (per engine), whose run measures its own floor:
    ``ratio`` = its ``share_of_ceiling`` (target 0.8).
``handoff-floor``
    ``benchmarks.queue --mode latency --scenarios in-process-handoff`` (per
    engine): ``ratio`` = the hand-off's median enqueue -> start over the
    floor row's durable one-row insert of the same run (target 1.2). On
    SQLite that insert takes a thread hop, as Trace's writes do; the
    hand-off itself runs on the event loop there, so its row also carries
    ``ratio_to_inline_floor``, over the same insert run on the loop: the
    like-for-like floor, with the same target.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from benchmarks._common import median

__all__ = [
    "FLOOR_PAIRS",
    "HTTP_CLIENT",
    "BaselineTree",
    "FloorSides",
    "json_rows",
    "only_row",
    "summarize_floor_pair",
]

log = logging.getLogger("benchmarks")

ROOT = Path(__file__).resolve().parent.parent
FLOOR_PAIRS = ("http-baseline", "routing-floor", "handoff-floor")
HTTP_CLIENT = {
    "api.py": "api_new.py",
    "_api_floor.py": "_api_floor.py",
    "_api_workers.py": "_api_workers.py",
    "_common.py": "_common.py",
    "_raw_http.py": "_raw_http.py",
}
"""The benchmark client's files (``benchmarks/``) and their names in the
baseline tree. ``api.py`` goes in beside the tree's own, which ``serve``
there loads the benchmark's operators from (``benchmarks.api:OPERATORS_FACTORY``
builds the registry of that tree's own classes); ``_common.py`` only grew
since d016d38, so the tree's own ``api.py`` still imports from it."""
_HTTP_MODULE = {"new": "benchmarks.api", "base": "benchmarks.api_new"}

_AT_LEAST, _AT_MOST = "at_least", "at_most"
_HTTP_TARGETS = {"ratio": (_AT_LEAST, 5.0), "new_cpu_ms": (_AT_MOST, 1.5)}
_TARGETS = {
    "routing-floor": {"ratio": (_AT_LEAST, 0.8)},
    "handoff-floor": {"ratio": (_AT_MOST, 1.2)},
}


def json_rows(
    command: list[str], *, cwd: Path = ROOT, env: Mapping[str, str] | None = None
) -> list[dict[str, Any]]:
    """Run a benchmark command; its JSON output lines (stderr passes through)."""
    log.info("+ %s", " ".join(command))
    out = subprocess.run(
        command,
        cwd=cwd,
        env=None if env is None else {**os.environ, **env},
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def only_row(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    """The one row of ``rows`` with every ``match`` item; an error otherwise."""
    found = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    if len(found) != 1:
        raise RuntimeError(f"expected one row with {match}, got {len(found)}: {rows}")
    return found[0]


class BaselineTree:
    """A throwaway detached worktree of ``revision`` holding this tree's benchmark client."""

    def __init__(self, revision: str) -> None:
        self.revision = revision
        self._scratch: Path | None = None
        self.path = Path()

    def __enter__(self) -> BaselineTree:
        self._scratch = Path(tempfile.mkdtemp(prefix="trace-baseline-"))
        self.path = self._scratch / "tree"
        git = ["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet"]
        try:
            subprocess.run([*git, str(self.path), self.revision], check=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            shutil.rmtree(self._scratch, ignore_errors=True)
            raise RuntimeError(
                f"--baseline {self.revision}: no worktree of it could be made from {ROOT} "
                "(a git checkout holding that commit is needed)"
            ) from exc
        try:
            for name, copy in HTTP_CLIENT.items():
                shutil.copy2(ROOT / "benchmarks" / name, self.path / "benchmarks" / copy)
        except BaseException:
            self.__exit__(None, None, None)  # no worktree is left behind
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(self.path)],
            check=False,
        )
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)


class FloorSides:
    """The measurements of the floor pairs, on one Postgres server."""

    def __init__(
        self,
        *,
        server_url: str,
        settle: Callable[[], None],
        http_tasks: int,
        http_workers: int,
        http_paths: Sequence[str],
        routing_events: int,
        samples: int,
        baseline: BaselineTree | None,
    ) -> None:
        self.url = server_url
        self.settle = settle
        self.http_tasks = http_tasks
        self.http_workers = http_workers
        self.http_paths = tuple(http_paths)
        self.routing_events = routing_events
        self.samples = samples
        self.baseline = baseline

    def measure(self, pair: str, engine: str, run: int) -> dict[str, Any]:
        """One run of ``pair`` on ``engine``: its row (figures, targets, the raw rows)."""
        if pair == "http-baseline":
            return self._http(run)
        if pair == "routing-floor":
            return self._routing(engine)
        if pair == "handoff-floor":
            return self._handoff(engine)
        raise ValueError(f"not a floor pair: {pair}")

    def _db(self, engine: str) -> list[str]:
        return ["--engine", engine, *(["--db", self.url] if engine == "postgres" else [])]

    def _http_side(self, side: str) -> list[dict[str, Any]]:
        paths = ",".join(self.http_paths) + (",floor" if side == "new" else "")
        tree = ROOT if side == "new" else self._baseline_path()
        command = [sys.executable, "-m", _HTTP_MODULE[side], *self._db("postgres"), "--runs", "1"]
        command += ["--workers", str(self.http_workers), "--tasks", str(self.http_tasks)]
        command += ["--path", paths, "--client", "raw"]
        rows = json_rows(command, cwd=tree, env={"PYTHONPATH": str(tree)})
        failed = [r for r in rows if not r.get("verified")]
        if failed:
            raise RuntimeError(f"http-baseline: {side} side not verified: {failed}")
        return rows

    def _baseline_path(self) -> Path:
        if self.baseline is None:
            raise RuntimeError("http-baseline needs its baseline tree")
        return self.baseline.path

    def _http(self, run: int) -> dict[str, Any]:
        order = ["new", "base"] if run % 2 == 0 else ["base", "new"]
        got: dict[str, list[dict[str, Any]]] = {}
        for side in order:
            self.settle()
            got[side] = self._http_side(side)
        floor = only_row(got["new"], path="floor")
        figures: dict[str, float | None] = {
            "floor_per_s": floor["round_trips_per_s"],
            "floor_cpu_ms": floor["server_cpu_ms_per_triple"],
            "floor_postgres_cpu_ms": floor["postgres_cpu_ms_per_triple"],
        }
        targets: dict[str, dict[str, float]] = {}
        for path in self.http_paths:
            new, base = only_row(got["new"], path=path), only_row(got["base"], path=path)
            figures |= {
                f"{path}_base_per_s": base["round_trips_per_s"],
                f"{path}_new_per_s": new["round_trips_per_s"],
                f"{path}_ratio": round(new["round_trips_per_s"] / base["round_trips_per_s"], 3),
                f"{path}_base_cpu_ms": base["server_cpu_ms_per_triple"],
                f"{path}_new_cpu_ms": new["server_cpu_ms_per_triple"],
                f"{path}_share_of_floor": new["share_of_floor"],
                f"{path}_cpu_over_floor": new["cpu_over_floor"],
            }
            for name, (bound, value) in _HTTP_TARGETS.items():
                targets[f"{path}_{name}"] = {bound: value}
        return {
            "first": order[0],
            "baseline": self._baseline_revision(),
            "figures": figures,
            "targets": targets,
            "new_rows": got["new"],
            "base_rows": got["base"],
        }

    def _baseline_revision(self) -> str:
        return self.baseline.revision if self.baseline is not None else ""

    def _routing(self, engine: str) -> dict[str, Any]:
        self.settle()
        command = [sys.executable, "-m", "benchmarks.routing", *self._db(engine), "--runs", "1"]
        command += ["--events", str(self.routing_events)]
        row = only_row(json_rows(command), bench="routing", run=0)
        if not (row["verified"] and row["floor_rows_ok"]):
            raise RuntimeError(f"routing-floor on {engine} not verified: {row}")
        return {
            "figures": {
                "events_per_s": row["events_per_s"],
                "ceiling_events_per_s": row["events_per_s_ceiling"],
                "ratio": row["share_of_ceiling"],
                "seconds": row["seconds"],
                "floor_seconds": row["floor_seconds"],
            },
            "targets": _targets("routing-floor"),
            "trace_row": row,
        }

    def _handoff(self, engine: str) -> dict[str, Any]:
        self.settle()
        command = [sys.executable, "-m", "benchmarks.queue", *self._db(engine)]
        command += ["--mode", "latency", "--scenarios", "in-process-handoff"]
        rows = json_rows([*command, "--samples", str(self.samples)])
        floor = only_row(rows, scenario="floor")
        handoff = only_row(rows, scenario="in-process-handoff")
        if "error" in handoff:
            raise RuntimeError(f"handoff-floor on {engine} failed: {handoff}")
        figures = {
            "handoff_median_ms": handoff["median_ms"],
            "floor_median_ms": floor["durable_insert_median_ms"],
            "ratio": handoff["ratio_to_floor"],
            "paired_floor_median_ms": handoff.get("paired_floor_median_ms"),
            "ratio_to_paired_floor": handoff.get("ratio_to_paired_floor"),
        }
        targets = _targets("handoff-floor")
        if "ratio_to_inline_floor" in handoff:
            figures["inline_floor_median_ms"] = floor["inline_insert_median_ms"]
            figures["ratio_to_inline_floor"] = handoff["ratio_to_inline_floor"]
            targets["ratio_to_inline_floor"] = targets["ratio"]
        return {
            "figures": figures,
            "targets": targets,
            "trace_row": handoff,
            "floor_row": floor,
        }


def _targets(pair: str) -> dict[str, dict[str, float]]:
    return {name: {bound: value} for name, (bound, value) in _TARGETS[pair].items()}


def summarize_floor_pair(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The medians of every figure of ``rows`` (one pair, one engine), each
    target with its median and whether the median meets it."""
    names = list(rows[0]["figures"])
    figures: dict[str, float | None] = {}
    for name in names:
        values = [float(r["figures"][name]) for r in rows if r["figures"].get(name) is not None]
        figures[name] = round(median(values), 3) if values else None
    targets: dict[str, dict[str, Any]] = {}
    for name, bound in rows[0]["targets"].items():
        got = figures.get(name)
        ((kind, value),) = bound.items()
        met = got is not None and (got >= value if kind == _AT_LEAST else got <= value)
        targets[name] = {kind: value, "median": got, "met": met}
    return {
        "figures_median": figures,
        "figures_all": {name: [r["figures"].get(name) for r in rows] for name in names},
        "targets": targets,
    }
