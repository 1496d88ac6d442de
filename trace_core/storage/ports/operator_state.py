"""The operator-state area of the repository port: versioned per-job state rows.

Reached as ``tx.operator_state`` on any
:class:`~trace_core.storage.protocol.Transaction`. The optimistic-concurrency
rule (which version a write must name, what a conflict raises) is
:class:`~trace_core.dispatcher.operator_state.OperatorStateStore`'s; this
area only runs the guarded statements, whose guard holds on both engines
without locks (it is in the statement itself).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

__all__ = ["OperatorStateKey", "OperatorStateOps", "StoredState"]


@dataclass(frozen=True)
class OperatorStateKey:
    """Which state row: the job's state ``state_key`` in ``org_id``."""

    org_id: uuid.UUID
    job_id: uuid.UUID
    state_key: str


@dataclass(frozen=True)
class StoredState:
    """A stored state and its version."""

    state: dict[str, Any]
    version: int


class OperatorStateOps(Protocol):
    """Reads and guarded writes of ``operator_state`` rows, inside one transaction."""

    async def get(self, key: OperatorStateKey) -> StoredState | None:
        """The state stored under ``key`` and its version; ``None`` when there is none."""
        ...

    async def insert_if_absent(
        self, key: OperatorStateKey, state: Mapping[str, Any], *, now: datetime
    ) -> bool:
        """Store ``state`` as version 1 under ``key`` unless a row exists there;
        whether it wrote (an existing row is left as it is)."""
        ...

    async def update_if_version(
        self, key: OperatorStateKey, state: Mapping[str, Any], *, version: int, now: datetime
    ) -> int | None:
        """Replace the state under ``key`` if its stored version is ``version``,
        incrementing it; the new version, or ``None`` (nothing changed) when no
        row holds that version."""
        ...

    async def delete_if_version(self, key: OperatorStateKey, *, version: int | None) -> bool:
        """Delete the row under ``key`` (with ``version``, only if that is its
        stored version); whether a row was deleted."""
        ...
