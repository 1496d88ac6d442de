"""The request and answer models of people's data routes (:mod:`trace_core.api.people_data`)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, Field

from trace_core.api.fields import Name, Request, check_text
from trace_core.api.query import DEFAULT_QUERY_LIMIT, MAX_QUERY_LIMIT, MAX_SQL_LENGTH
from trace_core.api.task_attempts import AttemptView
from trace_core.dag.coverage import Coverage
from trace_core.dispatcher.manual_pause import PauseChange
from trace_core.people.catalog import DagDetail, DatasetDetail, TaskDetail
from trace_core.storage.ports import LineageRow
from trace_core.storage.ports.catalog import (
    CatalogDag,
    CatalogDataset,
    CatalogDatasetVersion,
    CatalogJob,
    CatalogTask,
)

__all__ = [
    "DagOut",
    "DagVersionOut",
    "DagVersionsOut",
    "DatasetOut",
    "DatasetVersionOut",
    "DatasetVersionsOut",
    "DeployIn",
    "DeployOut",
    "JobPauseOut",
    "LineageEdgeOut",
    "LineageOut",
    "PauseOut",
    "PersonQuery",
    "RematerializeOut",
    "RollbackOut",
    "TaskDetailOut",
    "TaskOut",
    "TriggerIn",
]

MAX_DAG_BYTES = 256 * 1024
"""The longest DAG YAML a deploy accepts (characters)."""


class DagOut(BaseModel):
    """A DAG of the caller's org."""

    name: str
    current_version_id: uuid.UUID | None
    versions: int
    last_deployed_at: datetime

    @classmethod
    def of(cls, dag: CatalogDag) -> DagOut:
        """The view of ``dag``."""
        return cls(
            name=dag.name,
            current_version_id=dag.current_version_id,
            versions=dag.versions,
            last_deployed_at=dag.last_deployed_at,
        )


class DagVersionOut(BaseModel):
    """One version of a DAG and the datasets (that the caller may see) it points at."""

    version_id: uuid.UUID
    status: str
    yaml_hash: str
    created_at: datetime
    activated_at: datetime | None
    datasets: list[str]


class DagVersionsOut(BaseModel):
    """A DAG and its versions, newest first."""

    name: str
    versions: list[DagVersionOut]

    @classmethod
    def of(cls, detail: DagDetail) -> DagVersionsOut:
        """The view of ``detail``."""
        return cls(
            name=detail.name,
            versions=[
                DagVersionOut(
                    version_id=v.version_id,
                    status=v.status,
                    yaml_hash=v.yaml_hash,
                    created_at=v.created_at,
                    activated_at=v.activated_at,
                    datasets=sorted(detail.dataset_names[d] for d in v.datasets),
                )
                for v in detail.versions
            ],
        )


class DatasetOut(BaseModel):
    """A dataset the caller may see."""

    name: str
    dataset_uuid: uuid.UUID
    producer_dag: str
    producer_job: str
    read_roles: list[str]
    """Empty: every member of the org may see it."""
    created_at: datetime
    current_version: uuid.UUID | None
    """The version its producer DAG's current version points at."""

    @classmethod
    def of(cls, dataset: CatalogDataset) -> DatasetOut:
        """The view of ``dataset``."""
        return cls(
            name=dataset.name,
            dataset_uuid=dataset.dataset_uuid,
            producer_dag=dataset.producer_dag_name,
            producer_job=dataset.producer_job_name,
            read_roles=list(dataset.read_roles),
            created_at=dataset.created_at,
            current_version=dataset.current_version,
        )


class DatasetVersionOut(BaseModel):
    """One version of a dataset and its coverage."""

    version_id: uuid.UUID
    config_hash: str
    location: str
    range_start: int | None
    range_end: int | None
    created_at: datetime
    ranges: list[tuple[int, int]]
    """The covered block ranges, merged, inclusive."""
    max_cursor: int | None
    blocks_covered: int
    events: int

    @classmethod
    def of(cls, version: CatalogDatasetVersion) -> DatasetVersionOut:
        """The view of ``version``."""
        coverage = Coverage.of(version.ranges, version.max_cursor)
        return cls(
            version_id=version.version_id,
            config_hash=version.config_hash,
            location=version.location,
            range_start=version.range_start,
            range_end=version.range_end,
            created_at=version.created_at,
            ranges=list(coverage.ranges),
            max_cursor=coverage.max_cursor,
            blocks_covered=sum(end - start + 1 for start, end in coverage.ranges),
            events=version.events,
        )


class DatasetVersionsOut(DatasetOut):
    """A dataset with its versions, newest first."""

    versions: list[DatasetVersionOut]

    @classmethod
    def detail(cls, found: DatasetDetail) -> DatasetVersionsOut:
        """The view of ``found``."""
        return cls(
            **DatasetOut.of(found.dataset).model_dump(),
            versions=[DatasetVersionOut.of(v) for v in found.versions],
        )


class TaskOut(BaseModel):
    """A task the caller may see."""

    task_id: uuid.UUID
    dag: str
    job: str
    job_id: uuid.UUID
    dag_version_id: uuid.UUID
    status: str
    attempt: int
    max_attempts: int
    partitions: list[str]
    queued_at: datetime
    started_at: datetime | None
    completed_at: datetime | None
    next_retry_at: datetime | None
    error_message: str | None

    @classmethod
    def of(cls, task: CatalogTask, job: CatalogJob) -> TaskOut:
        """The view of ``task`` of ``job``."""
        return cls(
            task_id=task.task_id,
            dag=job.dag_name,
            job=job.name,
            job_id=job.job_id,
            dag_version_id=job.dag_version_id,
            status=task.status,
            attempt=task.attempt,
            max_attempts=task.max_attempts,
            partitions=list(task.partitions),
            queued_at=task.queued_at,
            started_at=task.started_at,
            completed_at=task.completed_at,
            next_retry_at=task.next_retry_at,
            error_message=task.error_message,
        )


class TaskDetailOut(TaskOut):
    """A task with its attempts (oldest first), their results and errors."""

    attempts: list[AttemptView]

    @classmethod
    def detail(cls, found: TaskDetail) -> TaskDetailOut:
        """The view of ``found``."""
        return cls(
            **TaskOut.of(found.task, found.job).model_dump(),
            attempts=[AttemptView.of(a) for a in found.attempts],
        )


def _text(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be blank")
    return check_text(value)


class DeployIn(Request):
    """``POST /v1/dags``: a DAG file's YAML, deployed into the caller's org."""

    yaml: Annotated[str, Field(min_length=1, max_length=MAX_DAG_BYTES), AfterValidator(_text)]


class DeployOut(BaseModel):
    """What a deploy did (``changed`` false: the same YAML was already live)."""

    dag_version_id: uuid.UUID
    dag_name: str
    yaml_hash: str
    status: str
    changed: bool
    abandoned_version_ids: list[uuid.UUID]
    canceled_task_ids: list[uuid.UUID]


class RollbackOut(BaseModel):
    """What a rollback did."""

    dag_name: str
    current_version_id: uuid.UUID
    abandoned_version_ids: list[uuid.UUID]
    canceled_task_ids: list[uuid.UUID]


class TriggerIn(Request):
    """``POST /v1/dags/{dag}/jobs/{job}/trigger``: start the manual source's task for ``key``."""

    key: Name


class JobPauseOut(BaseModel):
    """One live job's pause state after a manual pause or resume."""

    job_id: uuid.UUID
    paused: bool
    reason: str | None
    """``manual by <who>`` for a manual pause, the monitor's words for backpressure."""
    changed: bool
    """Whether this request changed it (a resume leaves a backpressure pause)."""


class PauseOut(BaseModel):
    """``POST /v1/dags/{dag}/jobs/{job}/pause`` or ``/resume``: every live
    version's job of that name (current, and building during a rebuild)."""

    dag_name: str
    job_name: str
    jobs: list[JobPauseOut]

    @classmethod
    def of(cls, dag: str, job: str, changes: list[PauseChange]) -> PauseOut:
        """The answer for ``changes`` of the live jobs ``dag/job``."""
        return cls(
            dag_name=dag,
            job_name=job,
            jobs=[
                JobPauseOut(job_id=c.job_id, paused=c.paused, reason=c.reason, changed=c.changed)
                for c in changes
            ],
        )


class RematerializeOut(DeployOut):
    """``POST /v1/datasets/{name}/rematerialize``: the deploy that rebuilds it."""

    dataset: str


class PersonQuery(Request):
    """``POST /v1/query``: one read-only SQL query over the datasets the caller may see."""

    sql: Annotated[str, Field(min_length=1, max_length=MAX_SQL_LENGTH), AfterValidator(_text)]
    limit: Annotated[int, Field(strict=True, ge=1, le=MAX_QUERY_LIMIT)] = DEFAULT_QUERY_LIMIT


class LineageEdgeOut(BaseModel):
    """``output_dataset.output_column`` is computed from ``input_dataset.input_column``
    (``*`` as the output column: what decides the output's rows)."""

    depth: int
    output_dataset: str
    output_column: str
    input_dataset: str
    input_column: str
    kind: str
    """How the input is used (OpenLineage's subtypes: ``IDENTITY``,
    ``TRANSFORMATION``, ``AGGREGATION``, ``FILTER``, ``JOIN``, ``GROUP_BY`` …)."""
    dataset_version: uuid.UUID | None
    """The output's dataset version the edge was recorded for."""

    @classmethod
    def of(cls, row: LineageRow) -> LineageEdgeOut:
        """The view of ``row``."""
        return cls(
            depth=row.depth,
            output_dataset=row.output_name,
            output_column=row.output_column,
            input_dataset=row.input_name,
            input_column=row.input_column,
            kind=row.kind,
            dataset_version=row.dataset_version,
        )


class LineageOut(BaseModel):
    """A dataset's (or column's) lineage through the datasets the caller may see."""

    dataset: str
    column: str | None
    direction: Literal["up", "down", "both"]
    upstream: list[LineageEdgeOut]
    downstream: list[LineageEdgeOut]
