"""The payload area of the repository port: what a task's full payload is built from.

Reached as ``tx.payload`` on any :class:`~trace_core.storage.protocol.Transaction`.
Every claim reads through it (a hot path): each operation is one statement
for any number of tasks or versions. What the payload says is
:mod:`trace_core.dispatcher.payload`'s.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from trace_core.storage.ports.registry import VersionProgress

__all__ = ["ClaimedView", "PayloadOps", "VersionPointer"]


@dataclass(frozen=True)
class VersionPointer:
    """A DAG version's pointer to one dataset version, with what a payload shows of it."""

    dag_version_id: uuid.UUID
    dataset_uuid: uuid.UUID
    dataset_version: uuid.UUID
    location: str
    range_start: int | None
    range_end: int | None
    dataset_name: str


@dataclass(frozen=True)
class ClaimedView:
    """What a claim reads after leasing a task, for its payload: the task's
    status and attempt as they are now, its DAG version's pointers and, when
    asked for (a source task), the recorded progress of the pointed versions."""

    status: str | None
    """``None``: the task no longer exists."""
    attempt: int
    pointers: list[VersionPointer]
    progress: dict[uuid.UUID, VersionProgress]


class PayloadOps(Protocol):
    """Reads for task payloads, inside one transaction."""

    async def task_rows(self, task_ids: Sequence[uuid.UUID]) -> list[dict[str, Any]]:
        """One dict per existing task among ``task_ids`` (unknown ids are skipped;
        order unspecified; empty for an empty input), keyed by column: the
        task's ``id``, ``attempt``, ``status``, ``partitions`` and
        ``input_versions``, and its job's ``job_id``, ``org_id``, ``name``,
        ``dag_name``, ``dag_version_id``, ``operator``, ``runtime``,
        ``config``, ``output_datasets``, ``activation``, ``scaling``,
        ``heartbeat_timeout_seconds`` and ``source``."""
        ...

    async def version_pointers(self, dag_versions: Collection[uuid.UUID]) -> list[VersionPointer]:
        """Every pointer of the DAG versions in ``dag_versions``, with the pointed
        version's location and range and the dataset's name (order unspecified;
        empty for an empty input)."""
        ...

    async def storage_locations(self, versions: Collection[uuid.UUID]) -> dict[uuid.UUID, str]:
        """``storage_location`` of each dataset version of ``versions`` that exists."""
        ...

    async def claimed_view(
        self, task_id: uuid.UUID, dag_version_id: uuid.UUID, *, progress: bool
    ) -> ClaimedView:
        """The reads a claim makes after leasing ``task_id``: its status and
        attempt, the pointers of ``dag_version_id`` (as :meth:`version_pointers`)
        and, with ``progress``, the recorded progress of every pointed version
        that has some, in one statement (ONE round trip). When the task is
        gone (``status`` ``None``) the pointers and progress may be empty: the
        caller has nothing to build."""
        ...
