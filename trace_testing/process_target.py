"""What every :class:`~trace_testing.faults.WorkerFleet` target that reports
to a file has in common: the first fields of its config
(:class:`ProcessConfig`), its entry point's crash handling
(:func:`run_process`), its report file (:func:`report_line`) and its wait
for the stop flag (:func:`wait_until_stopped`).

Standard library and anyio only: a spawned process imports this first.
"""

from __future__ import annotations

import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio

__all__ = ["ProcessConfig", "report_line", "run_process", "wait_until_stopped"]


@dataclass(frozen=True)
class ProcessConfig:
    """The fields every target's config starts with; picklable."""

    url: str
    name: str
    report_path: str
    """What the process reports, and any crash, is appended here."""


C = TypeVar("C", bound=ProcessConfig)


def report_line(config: ProcessConfig, line: str) -> None:
    """Append ``line`` to the process's report file (flushed: a SIGKILL may follow)."""
    with open(config.report_path, "a", encoding="utf-8") as fh:
        fh.write(line + "\n")
        fh.flush()


def run_process(
    main: Callable[[C, Any, Any], Awaitable[None]], config: C, stats: Any, stop: Any
) -> None:
    """Run ``main(config, stats, stop)`` in a new event loop; on any crash,
    append ``CRASH <name>`` and the traceback to the report file and exit 1."""
    try:
        anyio.run(main, config, stats, stop)
    except BaseException:
        report_line(config, f"CRASH {config.name}\n{traceback.format_exc()}")
        raise SystemExit(1) from None


def wait_until_stopped(stop: Any) -> None:
    """Block (a thread) until ``stop`` (a :class:`~trace_testing.faults.StopFlag`) is set."""
    while not stop.wait(1.0):
        pass
