"""The standalone area of the repository port: jobs outside any deployed DAG.

Reached as ``tx.standalone`` on any :class:`~trace_core.storage.protocol.Transaction`.
Embedders that use only the task queue get a job without deploying a DAG
(:func:`trace_core.standalone.ensure_standalone_job` derives the ids; the org
is :meth:`~trace_core.storage.ports.registry.RegistryOps.create_org_if_absent`'s).
Every write here is idempotent, so concurrent callers that derive the same
ids agree without a race.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

__all__ = ["StandaloneJob", "StandaloneOps"]


@dataclass(frozen=True)
class StandaloneJob:
    """A reactive job of the ``dispatcher`` runtime in a standalone DAG version."""

    job_id: uuid.UUID
    org_id: uuid.UUID
    name: str
    dag_name: str
    dag_version_id: uuid.UUID
    operator: str
    config_hash: str
    max_attempts: int


class StandaloneOps(Protocol):
    """Idempotent writes of standalone DAG versions and jobs, inside one transaction."""

    async def insert_current_version_if_absent(
        self, version_id: uuid.UUID, org_id: uuid.UUID, dag_name: str, *, now: datetime
    ) -> None:
        """Insert DAG version ``version_id`` of ``dag_name``, ``current`` from
        ``now`` and without YAML, unless one with that id (or that org, name
        and hash) exists; an existing row is left as it is."""
        ...

    async def insert_job_if_absent(self, job: StandaloneJob, *, now: datetime) -> None:
        """Insert ``job`` (no inputs, empty config, ``replace`` strategy) unless
        a job with its id (or its version and name) exists; an existing row is
        left as it is."""
        ...

    async def job_exists(self, job_id: uuid.UUID) -> bool:
        """Whether a job with id ``job_id`` exists."""
        ...
