"""What the shared session's liveness check costs: ``SparkSessionProvider.get()``.

    python -m benchmarks.spark_session --calls 2000 --runs 5

``get()`` checks, on every call, that the session it hands out is alive (the
driver process is polled, then one trivial gateway call). Each run times
``--calls`` calls of ``get()`` on a running ``local[2]`` session, the same
number of reads of the cached session (what ``get()`` did before it checked),
and one trivial Spark job (``range(10).count()``) for scale; the order of the
three is rotated between runs so a change in machine load falls on each.

One JSON object per run on stdout (one line each), then a summary object
with medians; logs go to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks._common import configure_logging, emit, load_average, summarize
from trace_lite.spark import DEFAULT_SPARK_CONF, SparkConfig, SparkSessionProvider

__all__ = ["main"]

_KEYS = ("get_us", "cached_read_us", "trivial_job_ms", "get_overhead_us")


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print JSON lines; 0 on success."""
    parser = argparse.ArgumentParser(prog="benchmarks.spark_session", description=__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    configure_logging(args.verbose, "py4j")
    provider = SparkSessionProvider(
        SparkConfig(master="local[2]", app_name="bench-session", conf={**DEFAULT_SPARK_CONF})
    )
    session = provider.get()
    try:
        measures: dict[str, Callable[[], float]] = {
            "get_us": lambda: _per_call_us(provider.get, args.calls),
            "cached_read_us": lambda: _per_call_us(lambda: provider._session, args.calls),
            "trivial_job_ms": lambda: _per_call_us(lambda: session.range(10).count(), 5) / 1e3,
        }
        names = list(measures)
        rows: list[dict[str, Any]] = []
        for run in range(args.runs):
            order = names[run % len(names) :] + names[: run % len(names)]
            row: dict[str, Any] = {"run": run, "calls": args.calls, "load_average": load_average()}
            for name in order:
                row[name] = round(measures[name](), 3)
            row["get_overhead_us"] = round(row["get_us"] - row["cached_read_us"], 3)
            rows.append(row)
            emit(row)
        emit({"summary": True, "runs": args.runs, **summarize(rows, _KEYS)})
    finally:
        provider.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
