"""Operator state as operators see it: the :class:`OperatorStateAccess` port.

Operators that keep bookkeeping between tasks (a source's position, an
aggregator's ranges) read a :class:`StateSnapshot` and write it back naming
the version they read; a write whose version is no longer current changes
nothing and raises :class:`StateConflict`, so the loser re-reads and retries.

Two implementations keep the same contract: the Dispatcher's
:class:`~trace_core.dispatcher.operator_state.OperatorStateStore` on the
state database (in-process runs), and
:class:`~trace_core.worker.http_state.HttpOperatorState` over the control
plane's ``/v1/task/state`` routes, for workers that hold no database
credentials. Part of :mod:`trace_core.authoring`: it imports nothing from
the control plane or the storage layer.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from trace_core.errors import TraceError

__all__ = ["DEFAULT_STATE_KEY", "OperatorStateAccess", "StateConflict", "StateSnapshot"]

DEFAULT_STATE_KEY = "default"


class StateConflict(TraceError):
    """A versioned write of operator state lost: the stored version differs.

    ``expected_version`` is what the writer named (``None``: "create, it must
    not exist"); ``actual_version`` is what is stored (``None``: no row).
    """

    def __init__(
        self,
        org_id: uuid.UUID,
        job_id: uuid.UUID,
        state_key: str,
        expected_version: int | None,
        actual_version: int | None,
    ) -> None:
        expected = (
            "no state (create)" if expected_version is None else f"version {expected_version}"
        )
        actual = "no state" if actual_version is None else f"version {actual_version}"
        super().__init__(
            f"operator state conflict for org {org_id}, job {job_id}, key {state_key!r}: "
            f"expected {expected}, found {actual}"
        )
        self.org_id = org_id
        self.job_id = job_id
        self.state_key = state_key
        self.expected_version = expected_version
        self.actual_version = actual_version


@dataclass(frozen=True)
class StateSnapshot:
    """A state as read or written, with the version to name in the next write."""

    state: dict[str, Any]
    version: int


class OperatorStateAccess(Protocol):
    """Reads and versioned writes of one job's operator state (the port)."""

    async def get(
        self, org_id: uuid.UUID, job_id: uuid.UUID, state_key: str = DEFAULT_STATE_KEY
    ) -> StateSnapshot | None:
        """The stored state and its version, or ``None`` if there is none."""
        ...

    async def put(
        self,
        org_id: uuid.UUID,
        job_id: uuid.UUID,
        state: Mapping[str, Any],
        *,
        state_key: str = DEFAULT_STATE_KEY,
        expected_version: int | None,
    ) -> StateSnapshot:
        """Write ``state`` if the stored version is ``expected_version`` (``None``:
        create, none may exist); the new snapshot. :class:`StateConflict` otherwise."""
        ...
