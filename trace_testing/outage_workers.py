"""Kit workers that carry on through a database outage (a Postgres crash-restart).

:func:`~trace_testing.workers.run_worker` ends its process on the first
database error: right for the worker faults it was made for (a crash there
is a finding). Under a database fault the worker must outlive the outage
instead, as every loop of Trace does (:class:`~trace_core.outage.LoopHealth`):
:func:`run_worker_through_outages` runs the same worker and, when the
database goes away under it, backs off and starts its loop again on fresh
connections. Leases it held when the server went down expire and are
reclaimed (by any worker's ``reclaim_expired``); an effect recorded in a
transaction the crash cut rolled back with it, so the history checker still
finds exactly one effect per task.

Each restart is appended to the report file as an ``OUTAGE`` line, beside
the ``CRASH`` and ``VIOLATION`` lines of :mod:`trace_testing.workers`; that
the worker carries on shows in its ``claimed`` counter.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

import anyio

from trace_core.errors import DatabaseUnavailable
from trace_core.outage import LoopHealth
from trace_testing.workers import CLAIMED, WorkerConfig, report_line, work_until_stopped

__all__ = ["run_worker_through_outages"]

log = logging.getLogger(__name__)


def run_worker_through_outages(config: WorkerConfig, stats: Any, stop: Any) -> None:
    """Process entry point (a :class:`~trace_testing.faults.WorkerFleet`
    target): :func:`~trace_testing.workers.run_worker`'s loop, started again
    with backoff after :class:`~trace_core.errors.DatabaseUnavailable`; exit
    1 on any other error."""
    health = LoopHealth(f"kit worker {config.name}", logger=log)
    try:
        claimed = -1
        while not stop.is_set():
            try:
                anyio.run(work_until_stopped, config, stats, stop)
                return
            except DatabaseUnavailable as exc:
                if stats[CLAIMED] != claimed:
                    # It claimed since the last failure: this is a new outage.
                    health.succeeded()
                    claimed = stats[CLAIMED]
                delay = health.failed(exc)
                report_line(config, f"OUTAGE {config.name} (retry {health.failures}): {exc}")
                # The fleet's polled stop flag, not an event (see StopFlag).
                stop.wait(delay)
    except BaseException:
        report_line(config, f"CRASH {config.name}\n{traceback.format_exc()}")
        raise SystemExit(1) from None
