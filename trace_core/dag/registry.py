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
- Deploys, promotions and rollbacks of one DAG are serialized by the
  port's DAG lock (``tx.deploy.lock_dag_versions``).
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from datetime import datetime

from trace_core.dag.loader import DagDocument
from trace_core.dag.problems import Problem, format_field
from trace_core.storage.ports import (
    NewDatasetVersion,
    Pointers,
    RegisteredDataset,
)
from trace_core.storage.protocol import Transaction

__all__ = [
    "Pointers",
    "RegisteredDataset",
    "all_dataset_names",
    "ensure_dataset_version",
    "ensure_org",
    "find_org",
    "org_id_for_slug",
    "registered_datasets",
    "registry_problems",
    "storage_location",
]


def _stable_id(*parts: str) -> uuid.UUID:
    return uuid.uuid5(uuid.NAMESPACE_URL, "trace:" + "/".join(parts))


def org_id_for_slug(slug: str) -> uuid.UUID:
    """The id an org gets when it is created by slug (as :mod:`trace_core.standalone` does)."""
    return _stable_id("org", slug)


async def find_org(tx: Transaction, slug: str) -> uuid.UUID | None:
    """The id of the org with ``slug``, if any."""
    return await tx.registry.find_org(slug)


async def ensure_org(tx: Transaction, slug: str, now: datetime) -> uuid.UUID:
    """The id of the org with ``slug``, created if missing."""
    await tx.registry.create_org_if_absent(org_id_for_slug(slug), slug, now=now)
    found = await tx.registry.find_org(slug)
    assert found is not None  # inserted or already there, in this transaction
    return found


async def registered_datasets(
    tx: Transaction,
    org_id: uuid.UUID,
    *,
    names: Collection[str] = (),
    producer_dag: str | None = None,
) -> list[RegisteredDataset]:
    """Registry rows of the org named in ``names`` or produced by ``producer_dag``."""
    return await tx.registry.datasets_named_or_produced_by(
        org_id, names=names, producer_dag=producer_dag
    )


async def all_dataset_names(tx: Transaction, org_id: uuid.UUID) -> set[str]:
    """Every dataset name registered in the org."""
    return await tx.registry.dataset_names(org_id)


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


async def ensure_dataset_version(
    tx: Transaction,
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
    registry = tx.registry

    async def find() -> uuid.UUID | None:
        return await registry.find_dataset_version(
            dataset_uuid, config_hash=config_hash, range_start=range_start, range_end=range_end
        )

    found = await find()
    if found is not None:
        return found, False
    version_id = _stable_id(
        "dataset_version", str(dataset_uuid), config_hash, str(range_start), str(range_end)
    )
    location = storage_location(
        kind,
        storage_root=storage_root,
        org_slug=org_slug,
        dataset_uuid=dataset_uuid,
        dataset_version=version_id,
    )
    new = NewDatasetVersion(
        version_id, dataset_uuid, config_hash, range_start, range_end, location, now
    )
    if await registry.insert_dataset_version_if_absent(new):
        return version_id, True
    # A concurrent deploy created it between our look and our insert.
    again = await find()
    assert again is not None  # the insert conflicted with this very row
    return again, False


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
