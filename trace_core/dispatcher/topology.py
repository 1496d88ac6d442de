"""The live DAG as the router sees it: who reads which dataset version.

Built on :func:`trace_core.dag.live_jobs` (jobs of current DAG versions, plus
jobs of building versions that build a new dataset version), reduced to what
routing needs: each reactive job's input edges resolved to the pinned dataset
version of its DAG version, with their ``where`` filters.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from trace_core.dag import LiveJob, live_jobs
from trace_core.storage.protocol import Transaction

__all__ = [
    "Dependent",
    "InputEdge",
    "dependents_by_dataset",
    "every_reactive_dependent",
    "reactive_dependents",
    "reactive_dependents_of",
]


@dataclass(frozen=True)
class InputEdge:
    """One input of a job: the dataset, the version its DAG version pins, the filter."""

    dataset_uuid: uuid.UUID
    dataset_version: uuid.UUID
    where: str | None

    @cached_property
    def pinned(self) -> dict[str, Any]:
        """The edge as a task's ``input_versions`` entry (formatted once)."""
        return {
            "dataset_uuid": str(self.dataset_uuid),
            "dataset_version": str(self.dataset_version),
            "where": self.where,
        }


@dataclass(frozen=True)
class Dependent:
    """A live reactive job, as routing needs it."""

    job_id: uuid.UUID
    job_name: str
    dag_name: str
    execution_strategy: str
    inputs: tuple[InputEdge, ...]
    max_attempts: int
    priority_tier: str

    @cached_property
    def partition_prefix(self) -> str:
        """``partition:{first input}:{its version}:`` — a PerPartition task's key prefix."""
        driver = self.inputs[0]
        return f"partition:{driver.dataset_uuid}:{driver.dataset_version}:"


def _dependent(job: LiveJob) -> Dependent:
    return Dependent(
        job_id=job.job_id,
        job_name=job.job_name,
        dag_name=job.dag_name,
        execution_strategy=job.execution_strategy or "PerUpdate",
        inputs=tuple(
            InputEdge(ds, job.input_pointers[ds], job.where.get(ds)) for ds in job.input_datasets
        ),
        max_attempts=job.max_attempts,
        priority_tier=job.priority_tier,
    )


async def reactive_dependents(
    tx: Transaction, dataset_uuids: set[uuid.UUID]
) -> dict[uuid.UUID, list[tuple[Dependent, InputEdge]]]:
    """For each of ``dataset_uuids``, the live reactive jobs reading it and the edge."""
    return dependents_by_dataset(await every_reactive_dependent(tx), dataset_uuids)


def dependents_by_dataset(
    dependents: Sequence[Dependent], dataset_uuids: set[uuid.UUID]
) -> dict[uuid.UUID, list[tuple[Dependent, InputEdge]]]:
    """For each of ``dataset_uuids``, the ``dependents`` reading it and the edge."""
    found: dict[uuid.UUID, list[tuple[Dependent, InputEdge]]] = {}
    for dependent in dependents:
        for edge in dependent.inputs:
            if edge.dataset_uuid in dataset_uuids:
                found.setdefault(edge.dataset_uuid, []).append((dependent, edge))
    return found


async def reactive_dependents_of(tx: Transaction, job_ids: set[uuid.UUID]) -> list[Dependent]:
    """The live reactive jobs among ``job_ids``."""
    return [job for job in await every_reactive_dependent(tx) if job.job_id in job_ids]


async def every_reactive_dependent(tx: Transaction) -> list[Dependent]:
    """Every live reactive job with inputs."""
    return [
        _dependent(job)
        for job in await live_jobs(tx)
        if job.activation == "reactive" and job.input_datasets
    ]
