"""What a DAG has done so far: datasets, their versions and coverage, tasks by state.

Read-only queries over the state database (and the object store and data
database for row counts), shared by ``trace-lite run``'s live progress and
summary and by the ``status``, ``datasets`` and ``tasks`` commands.
"""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

from trace_core.dag.coverage import Coverage
from trace_core.storage.protocol import Repository
from trace_lite.buffered import DataDatabase, table_name_of

__all__ = [
    "DatasetStatus",
    "TaskCounts",
    "dataset_statuses",
    "object_rows",
    "table_rows",
    "task_counts",
]

OPEN_STATES = frozenset({"Queued", "Running", "Failed"})
"""Task states with work still to come (a Failed task waits for its retry)."""


@dataclass(frozen=True)
class DatasetStatus:
    """One dataset version a DAG version points at."""

    name: str
    dataset_uuid: uuid.UUID
    dataset_version: uuid.UUID
    dag_version_status: str
    location: str
    range_start: int | None
    range_end: int | None
    coverage: Coverage
    events: int

    @property
    def blocks_covered(self) -> int:
        """Blocks inside the recorded partitions."""
        return sum(end - start + 1 for start, end in self.coverage.ranges)

    @property
    def complete(self) -> bool:
        """Whether the coverage holds the version's whole block range."""
        if self.range_start is None or self.range_end is None:
            return False
        return self.coverage.ranges == ((self.range_start, self.range_end),)


@dataclass(frozen=True)
class TaskCounts:
    """Tasks per job and state."""

    by_job: dict[str, Counter[str]]

    @property
    def total(self) -> Counter[str]:
        """Tasks per state over every job."""
        total: Counter[str] = Counter()
        for counts in self.by_job.values():
            total.update(counts)
        return total

    def open_except(self, jobs: frozenset[str]) -> int:
        """Tasks with work to come, not counting the jobs in ``jobs`` (sources)."""
        return sum(
            n
            for job, counts in self.by_job.items()
            if job not in jobs
            for state, n in counts.items()
            if state in OPEN_STATES
        )


async def dataset_statuses(
    repo: Repository, dag_name: str, *, org_slug: str = "default"
) -> list[DatasetStatus]:
    """The datasets of the DAG's current and building versions, with coverage."""
    async with repo.read() as tx:
        found = await tx.status.dag_datasets(org_slug, dag_name)
    return [
        DatasetStatus(
            name=d.name,
            dataset_uuid=d.dataset_uuid,
            dataset_version=d.dataset_version,
            dag_version_status=d.dag_version_status,
            location=d.location,
            range_start=d.range_start,
            range_end=d.range_end,
            coverage=Coverage.of(d.ranges, d.max_cursor),
            events=d.events,
        )
        for d in found
    ]


async def task_counts(repo: Repository, dag_name: str, *, org_slug: str = "default") -> TaskCounts:
    """Tasks per job name and state, over every version of the DAG."""
    async with repo.read() as tx:
        found = await tx.status.task_counts_by_job(org_slug, dag_name)
    return TaskCounts({job: Counter(counts) for job, counts in found.items()})


def object_rows(objects_root: Path, location: str) -> tuple[int, int]:
    """``(objects, rows)`` of the Parquet objects under an ``s3://`` location of
    the local object store (rows from the Parquet footers, no data read)."""
    import pyarrow.parquet as pq

    bucket, _, prefix = location.removeprefix("s3://").partition("/")
    directory = objects_root / bucket / prefix
    files = [
        f for f in sorted(directory.glob("*.parquet")) if f.is_file() and not f.name.startswith(".")
    ]
    return len(files), sum(pq.read_metadata(f).num_rows for f in files)


async def table_rows(data: DataDatabase, location: str) -> int:
    """Rows of a buffered dataset's table (0 before the sink created it)."""
    table = sa.table(table_name_of(location))
    async with data.engine.connect() as conn:
        exists = await conn.run_sync(lambda sync: sa.inspect(sync).has_table(table.name))
        if not exists:
            return 0
        return int(await conn.scalar(sa.select(sa.func.count()).select_from(table)) or 0)
