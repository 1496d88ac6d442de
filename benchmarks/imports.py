"""What a fresh interpreter pays to import Trace: modules loaded and time taken.

``python -m benchmarks.imports [--baseline DIR] [--runs N]`` starts a new
interpreter per sample for each statement below (the operator-author API, the
UDF child, ``import trace_core``) and for ``pass`` (the interpreter's own
start: the floor), with ``-X importtime``. With ``--baseline`` it measures a
checkout of another commit the same way, alternating with this one run by run,
so the two are compared under the same load. It prints one JSON object per
sample and then, per tree and statement, the median wall time, the median
import time above the floor, the modules loaded and which heavy packages
(SQLAlchemy, Alembic, FastAPI, PySpark) came with it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

STATEMENTS = {
    "author_api": "from trace_core.authoring import DatasetEvent, OperatorSpec, TaskContext",
    "udf_child": "import trace_core.worker.udf_child",
    "trace_core": "import trace_core",
    "floor": "pass",
}
"""The statements measured; a baseline checkout without ``trace_core.authoring``
is measured with :data:`BASELINE_AUTHOR_API`, where those names lived before."""

BASELINE_AUTHOR_API = "from trace_core.dispatcher import DatasetEvent, OperatorSpec, TaskContext"
HEAVY = ("sqlalchemy", "alembic", "fastapi", "pyspark")


def sample(tree: Path, name: str, statement: str) -> dict[str, Any]:
    """One fresh interpreter importing ``statement`` from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", statement],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    wall_ms = (time.perf_counter() - started) * 1000
    lines = [line for line in done.stderr.splitlines() if line.startswith("import time:")][1:]
    modules = [line.rsplit("|", 1)[1].strip() for line in lines]
    self_us = sum(int(line.split("|")[0].split(":")[1]) for line in lines)
    return {
        "tree": str(tree),
        "statement": name,
        "wall_ms": round(wall_ms, 2),
        "import_ms": round(self_us / 1000, 2),
        "modules": len(modules),
        "heavy": sorted({m for m in modules if m in HEAVY}),
    }


def _statement(tree: Path, name: str) -> str:
    if name == "author_api" and not (tree / "trace_core" / "authoring").exists():
        return BASELINE_AUTHOR_API
    return STATEMENTS[name]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the samples and print them, then the summary per tree and statement."""
    parser = argparse.ArgumentParser(prog="benchmarks.imports", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="samples per statement and tree")
    parser.add_argument("--baseline", type=Path, help="a checkout of another commit")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    trees = [ROOT] + ([args.baseline.resolve()] if args.baseline else [])
    samples: list[dict[str, Any]] = []
    for run in range(args.runs):
        # Alternate which tree goes first, so neither always runs on a warmer cache.
        for tree in trees if run % 2 == 0 else trees[::-1]:
            for name in STATEMENTS:
                found = sample(tree, name, _statement(tree, name))
                samples.append(found)
                print(json.dumps({"run": run, **found}))
    for tree in trees:
        mine = [s for s in samples if s["tree"] == str(tree)]
        floor = statistics.median(s["wall_ms"] for s in mine if s["statement"] == "floor")
        for name in STATEMENTS:
            rows = [s for s in mine if s["statement"] == name]
            wall = statistics.median(s["wall_ms"] for s in rows)
            summary = {
                "summary": name,
                "tree": str(tree),
                "runs": len(rows),
                "median_wall_ms": round(wall, 1),
                "median_above_floor_ms": round(wall - floor, 1),
                "median_import_ms": round(statistics.median(s["import_ms"] for s in rows), 1),
                "modules": rows[-1]["modules"],
                "heavy": rows[-1]["heavy"],
            }
            print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
