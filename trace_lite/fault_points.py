"""Fault points a test process arms through ``trace-lite serve``'s configuration.

``--fault-point between-commit-and-ack`` (hidden from ``--help``: for tests
only) makes the control plane SIGKILL itself after a worker's report
committed and before its stream message is acknowledged
(:mod:`trace_core.api.report_acks`), so that a process test kills it exactly
there and not merely "some time after the commit". Nothing is armed unless
the option is given.
"""

from __future__ import annotations

import os
import signal

from trace_core.errors import ConfigurationError
from trace_core.ports import StreamMessage

__all__ = [
    "BETWEEN_COMMIT_AND_ACK",
    "FAULT_POINTS",
    "check_fault_point",
    "kill_between_commit_and_ack",
]

BETWEEN_COMMIT_AND_ACK = "between-commit-and-ack"
FAULT_POINTS = (BETWEEN_COMMIT_AND_ACK,)
"""The names ``--fault-point`` accepts."""


async def kill_between_commit_and_ack(message: StreamMessage) -> None:
    """SIGKILL this process: the report committed, its ack never happens."""
    os.kill(os.getpid(), signal.SIGKILL)


def check_fault_point(name: str | None, *, redis_url: str | None) -> None:
    """Refuse an unknown fault point, or one that has nothing to arm."""
    if name is None:
        return
    if name not in FAULT_POINTS:
        raise ConfigurationError(f"--fault-point: {name!r} is not one of {list(FAULT_POINTS)}")
    if redis_url is None:
        raise ConfigurationError(f"--fault-point {name}: needs --redis-url (a stream transport)")
