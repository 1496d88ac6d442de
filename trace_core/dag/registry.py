"""The dataset registry and dataset versions, as deploy and activation use them.

- Orgs get the id derived from their slug (the same derivation as
  :mod:`trace_core.standalone`), so every creator agrees without a race.
- A dataset's producer ``(dag, job, output_index)`` is permanent: the
  registry enforces a single producer per dataset, and the schema makes the
  producer slot unique too, so an output cannot be renamed or moved to
  another index in place (name a new dataset instead).
- A dataset version is found or created by ``(dataset_uuid, config_hash,
  range_start, range_end)``; its id is derived from that tuple, so two
  concurrent deploys create one row. Storage locations:
  ``{storage_root}{org_slug}/dataset/{dataset_uuid}/version/{dataset_version}/``
  for Parquet (a version-addressed prefix, interface-contracts.md), and
  ``postgres_table:dataset_{dataset_uuid_hex}_{dataset_version_hex[:8]}`` for
  Postgres tables (a table per version so a rebuild never touches the table
  readers use; 8 hex digits keep the name under Postgres' 63-byte limit).
- Postgres serializes deploys, promotions and rollbacks of one DAG with a
  transaction-scoped advisory lock; SQLite's ``BEGIN IMMEDIATE`` already does.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from trace_core.dag.loader import DagDocument
from trace_core.dag.problems import Problem, format_field
from trace_core.storage import schema
from trace_core.storage.sql import SqlTransaction

__all__ = [
    "Pointers",
    "RegisteredDataset",
    "all_dataset_names",
    "current_version_id",
    "ensure_dataset_version",
    "ensure_org",
    "find_org",
    "lock_dag",
    "org_id_for_slug",
    "pointers",
    "producers_current_pointers",
    "registered_datasets",
    "registry_problems",
    "storage_location",
]

Pointers = dict[uuid.UUID, uuid.UUID]
"""dataset_uuid -> dataset_version."""


def _stable_id(*parts: str) -> uuid.UUID:
    return uuid.uuid5(uuid.NAMESPACE_URL, "trace:" + "/".join(parts))


def org_id_for_slug(slug: str) -> uuid.UUID:
    """The id an org gets when it is created by slug (as :mod:`trace_core.standalone` does)."""
    return _stable_id("org", slug)


async def find_org(conn: AsyncConnection, slug: str) -> uuid.UUID | None:
    """The id of the org with ``slug``, if any."""
    o = schema.orgs
    found: uuid.UUID | None = (
        await conn.execute(sa.select(o.c.id).where(o.c.slug == slug))
    ).scalar_one_or_none()
    return found


async def ensure_org(tx: SqlTransaction, slug: str, now: datetime) -> uuid.UUID:
    """The id of the org with ``slug``, created if missing."""
    await tx.connection.execute(
        tx.insert(schema.orgs)
        .values(id=org_id_for_slug(slug), name=slug, slug=slug, settings={}, created_at=now)
        .on_conflict_do_nothing()
    )
    found = await find_org(tx.connection, slug)
    assert found is not None  # inserted or already there, in this transaction
    return found


async def lock_dag(tx: SqlTransaction, org_id: uuid.UUID, dag_name: str) -> None:
    """Serialize version changes of one DAG until the transaction ends."""
    if tx.engine_name != "postgres":
        return  # SQLite write transactions are serialized by BEGIN IMMEDIATE
    digest = hashlib.sha256(f"trace:dag/{org_id}/{dag_name}".encode()).digest()
    key = int.from_bytes(digest[:8], "big", signed=True)
    await tx.connection.execute(sa.select(sa.func.pg_advisory_xact_lock(key)))


@dataclass(frozen=True)
class RegisteredDataset:
    """A row of the dataset registry."""

    dataset_uuid: uuid.UUID
    name: str
    producer_dag_name: str
    producer_job_name: str
    producer_output_index: int

    @property
    def producer(self) -> str:
        """``dag/job[index]``, as problems name it."""
        return f"{self.producer_dag_name}/{self.producer_job_name}[{self.producer_output_index}]"


def _registered(row: Sequence[Any]) -> RegisteredDataset:
    return RegisteredDataset(row[0], row[1], row[2], row[3], int(row[4]))


async def registered_datasets(
    conn: AsyncConnection,
    org_id: uuid.UUID,
    *,
    names: Collection[str] = (),
    producer_dag: str | None = None,
) -> list[RegisteredDataset]:
    """Registry rows of the org named in ``names`` or produced by ``producer_dag``."""
    d = schema.datasets
    wanted: list[sa.ColumnElement[bool]] = []
    if names:
        wanted.append(d.c.name.in_(sorted(names)))
    if producer_dag is not None:
        wanted.append(d.c.producer_dag_name == producer_dag)
    if not wanted:
        return []
    stmt = sa.select(
        d.c.id, d.c.name, d.c.producer_dag_name, d.c.producer_job_name, d.c.producer_output_index
    ).where(d.c.org_id == org_id, sa.or_(*wanted))
    return [_registered(row) for row in (await conn.execute(stmt)).all()]


async def all_dataset_names(conn: AsyncConnection, org_id: uuid.UUID) -> set[str]:
    """Every dataset name registered in the org."""
    d = schema.datasets
    return set((await conn.execute(sa.select(d.c.name).where(d.c.org_id == org_id))).scalars())


def storage_location(
    kind: str,
    *,
    storage_root: str,
    org_slug: str,
    dataset_uuid: uuid.UUID,
    dataset_version: uuid.UUID,
) -> str:
    """Where a dataset version's data lives (see the module docstring)."""
    if kind == "postgres_table":
        return f"postgres_table:dataset_{dataset_uuid.hex}_{dataset_version.hex[:8]}"
    root = storage_root if storage_root.endswith("/") else storage_root + "/"
    return f"{root}{org_slug}/dataset/{dataset_uuid}/version/{dataset_version}/"


def _same(column: sa.ColumnElement[int], value: int | None) -> sa.ColumnElement[bool]:
    # NULL ranges: the UNIQUE constraint treats NULLs as distinct, so find-or-create
    # must compare them itself.
    return column.is_(None) if value is None else column == value


async def ensure_dataset_version(
    tx: SqlTransaction,
    *,
    dataset_uuid: uuid.UUID,
    config_hash: str,
    range_start: int | None,
    range_end: int | None,
    kind: str,
    storage_root: str,
    org_slug: str,
    now: datetime,
) -> tuple[uuid.UUID, bool]:
    """The dataset version for this config and range, and whether this call created it."""
    v = schema.dataset_versions
    find = sa.select(v.c.id).where(
        v.c.dataset_uuid == dataset_uuid,
        v.c.config_hash == config_hash,
        _same(v.c.range_start, range_start),
        _same(v.c.range_end, range_end),
    )
    conn = tx.connection
    found: uuid.UUID | None = (await conn.execute(find)).scalars().first()
    if found is not None:
        return found, False
    version_id = _stable_id(
        "dataset_version", str(dataset_uuid), config_hash, str(range_start), str(range_end)
    )
    inserted = await conn.execute(
        tx.insert(v)
        .values(
            id=version_id,
            dataset_uuid=dataset_uuid,
            created_at=now,
            storage_location=storage_location(
                kind,
                storage_root=storage_root,
                org_slug=org_slug,
                dataset_uuid=dataset_uuid,
                dataset_version=version_id,
            ),
            config_hash=config_hash,
            range_start=range_start,
            range_end=range_end,
        )
        .on_conflict_do_nothing()
    )
    if inserted.rowcount:
        return version_id, True
    return (await conn.execute(find)).scalar_one(), False


async def pointers(conn: AsyncConnection, dag_version_id: uuid.UUID) -> Pointers:
    """The pointer set of a DAG version: dataset_uuid -> dataset_version."""
    p = schema.dag_version_datasets
    rows = await conn.execute(
        sa.select(p.c.dataset_uuid, p.c.dataset_version).where(p.c.dag_version_id == dag_version_id)
    )
    return {row[0]: row[1] for row in rows.all()}


async def current_version_id(
    conn: AsyncConnection, org_id: uuid.UUID, dag_name: str
) -> uuid.UUID | None:
    """The DAG's current version, if it has one."""
    c = schema.dag_current_versions
    found: uuid.UUID | None = (
        await conn.execute(
            sa.select(c.c.dag_version_id).where(c.c.org_id == org_id, c.c.dag_name == dag_name)
        )
    ).scalar_one_or_none()
    return found


async def producers_current_pointers(
    conn: AsyncConnection, org_id: uuid.UUID, dataset_uuids: Iterable[uuid.UUID]
) -> Mapping[uuid.UUID, uuid.UUID]:
    """For datasets of other DAGs: the version their producer DAG's current version points at."""
    wanted = list(dataset_uuids)
    if not wanted:
        return {}
    d, p, c = schema.datasets, schema.dag_version_datasets, schema.dag_current_versions
    stmt = (
        sa.select(p.c.dataset_uuid, p.c.dataset_version)
        .select_from(
            d.join(
                c,
                sa.and_(c.c.org_id == d.c.org_id, c.c.dag_name == d.c.producer_dag_name),
            ).join(
                p,
                sa.and_(p.c.dag_version_id == c.c.dag_version_id, p.c.dataset_uuid == d.c.id),
            )
        )
        .where(d.c.org_id == org_id, d.c.id.in_(wanted))
    )
    return {row[0]: row[1] for row in (await conn.execute(stmt)).all()}


def registry_problems(
    document: DagDocument, registered: Collection[RegisteredDataset]
) -> list[Problem]:
    """Single-producer violations of ``document`` against the org's registry rows.

    ``registered`` holds the rows named by the DAG and the rows whose producer
    is this DAG (to catch an output slot held by another dataset name).
    """
    spec = document.spec
    by_name = {r.name: r for r in registered}
    by_slot = {
        (r.producer_dag_name, r.producer_job_name, r.producer_output_index): r for r in registered
    }
    problems = []
    for i, job in enumerate(spec.jobs):
        for k, output in enumerate(job.outputs):
            path = ("jobs", i, "outputs", k, "dataset")
            here = f"{spec.dag}/{job.name}[{k}]"
            row = by_name.get(output.dataset)
            if row is not None and (
                row.producer_dag_name,
                row.producer_job_name,
                row.producer_output_index,
            ) != (spec.dag, job.name, k):
                message = (
                    f"dataset '{output.dataset}' is already produced by {row.producer} — a "
                    f"dataset has a single producer, and {here} is not it"
                )
            elif row is None and (holder := by_slot.get((spec.dag, job.name, k))) is not None:
                message = (
                    f"output {here} is registered as dataset '{holder.name}' — a producer "
                    "output keeps its dataset; add a new output (or job) for a new dataset"
                )
            else:
                continue
            problems.append(
                Problem(document.file, document.lines.line(path), format_field(path), message)
            )
    return problems
