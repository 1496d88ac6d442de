"""The full task payload: what ``/internal/task-fetch`` returns and what a
Lambda is invoked with, so an operator runs without state-DB credentials.

Shape (interface-contracts.md): ``task_id``, ``attempt``, ``status``,
``job {dag_name, name, id, org_id}``, ``operator``, ``config``, ``inputs`` (pinned dataset
versions with the dataset's ``name``, their resolved storage ``location``,
their ``where`` filters and the unit of work), ``outputs`` (dataset, its
``name``, version, version-addressed location and the version's block
``range`` when it has one, and for a source job the ``coverage`` already
materialized, by output index) and ``partitions``.

An input's ``location`` is the ``storage_location`` of its pinned dataset
version (``None`` only if that version row is gone). Pinned versions are
normally among the task's DAG version pointers, already read for the
outputs; any other is looked up in one more query. Dataset names come with
the pointers (another query only for a dataset outside them).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trace_core.dag.coverage import coverages, read_coverage
from trace_core.dag.validate import INPUTS_WHERE_KEY
from trace_core.storage.ports import ClaimedView, VersionPointer
from trace_core.storage.protocol import Transaction

__all__ = ["build_payloads", "task_payloads", "task_rows"]


async def task_payloads(
    tx: Transaction, task_ids: Sequence[uuid.UUID]
) -> dict[uuid.UUID, dict[str, Any]]:
    """The payload of each existing task among ``task_ids`` (two queries, one
    more for source tasks, and rarely one for inputs outside the pointers)."""
    return await build_payloads(tx, await task_rows(tx, task_ids))


async def task_rows(tx: Transaction, task_ids: Sequence[uuid.UUID]) -> list[dict[str, Any]]:
    """The task and job columns a payload is built from, one row per existing
    task (also the job's claim settings: ``scaling``, ``heartbeat_timeout_seconds``
    and ``source``)."""
    return await tx.payload.task_rows(task_ids)


async def build_payloads(
    tx: Transaction, tasks: Sequence[Mapping[str, Any]], *, view: ClaimedView | None = None
) -> dict[uuid.UUID, dict[str, Any]]:
    """The payloads of rows read by :func:`task_rows` (whose ``attempt`` and
    ``status`` a caller may have replaced by what its claim just set).

    ``view``: the pointers and progress of the tasks' one DAG version, read
    already (:meth:`~trace_core.storage.ports.PayloadOps.claimed_view`)."""
    if view is None:
        read = await tx.payload.version_pointers({r["dag_version_id"] for r in tasks})
    else:
        read = view.pointers
    locations = _output_locations(read)
    stored = await _input_locations(tx, tasks, locations)
    names = await _dataset_names(tx, tasks, locations)
    versions = _source_output_versions(tasks, locations)
    found = await read_coverage(tx, versions) if view is None else coverages(view.progress)
    coverage = {
        version: [list(r) for r in c.ranges] for version, c in found.items() if version in versions
    }
    payloads = {}
    for row in tasks:
        pointers = locations.get(row["dag_version_id"], {})
        outputs = []
        for index, dataset in enumerate(row["output_datasets"] or ()):
            pointer = pointers.get(uuid.UUID(dataset))
            outputs.append(
                {
                    "output_index": index,
                    "dataset_uuid": dataset,
                    "dataset": names.get(str(dataset)),
                    "dataset_version": None if pointer is None else str(pointer.version),
                    "location": None if pointer is None else pointer.location,
                    "range": None if pointer is None else pointer.range,
                    **(
                        {"coverage": coverage.get(pointer.version, [])}
                        if pointer is not None and row["activation"] == "source"
                        else {}
                    ),
                }
            )
        inputs = [
            {
                **item,
                "dataset": names.get(str(item.get("dataset_uuid"))),
                "location": stored.get(version) if (version := _version_of(item)) else None,
            }
            for item in (row["input_versions"] or {}).get("inputs", [])
        ]
        config = {k: v for k, v in (row["config"] or {}).items() if k != INPUTS_WHERE_KEY}
        payloads[row["id"]] = {
            "task_id": str(row["id"]),
            "attempt": row["attempt"],
            "status": row["status"],
            "job": {
                "dag_name": row["dag_name"],
                "name": row["name"],
                "id": str(row["job_id"]),
                "org_id": str(row["org_id"]),
            },
            "operator": row["operator"],
            "runtime": row["runtime"],
            "config": config,
            "inputs": inputs,
            "outputs": outputs,
            "partitions": list(row["partitions"] or ()),
            "bootstrap": (row["input_versions"] or {}).get("bootstrap"),
        }
    return payloads


@dataclass(frozen=True)
class _Pointer:
    """A DAG version's pointer to one dataset version."""

    version: uuid.UUID
    location: str
    range: dict[str, int] | None
    name: str


def _output_locations(
    pointers: Sequence[VersionPointer],
) -> dict[uuid.UUID, dict[uuid.UUID, _Pointer]]:
    found: dict[uuid.UUID, dict[uuid.UUID, _Pointer]] = {}
    for p in pointers:
        start, end = p.range_start, p.range_end
        span = None if start is None or end is None else {"start": start, "end": end}
        found.setdefault(p.dag_version_id, {})[p.dataset_uuid] = _Pointer(
            p.dataset_version, p.location, span, p.dataset_name
        )
    return found


def _source_output_versions(
    tasks: Sequence[Mapping[str, Any]],
    pointers: dict[uuid.UUID, dict[uuid.UUID, _Pointer]],
) -> set[uuid.UUID]:
    """The output versions of source tasks, whose block ranges already
    materialized the payload shows: a source run of a new DAG version whose
    outputs kept their version resumes after them instead of writing them
    again."""
    return {
        pointer.version
        for row in tasks
        if row["activation"] == "source"
        for dataset in row["output_datasets"] or ()
        if (pointer := pointers.get(row["dag_version_id"], {}).get(uuid.UUID(str(dataset))))
    }


async def _dataset_names(
    tx: Transaction,
    tasks: Sequence[Mapping[str, Any]],
    pointers: dict[uuid.UUID, dict[uuid.UUID, _Pointer]],
) -> dict[str, str]:
    """``{dataset_uuid (str): name}`` of every dataset ``tasks`` read or write:
    from the DAG versions' pointers, and one query for any other (an input
    pinned outside its task's DAG version)."""
    known = {
        str(dataset): pointer.name
        for by_dataset in pointers.values()
        for dataset, pointer in by_dataset.items()
    }
    wanted: set[uuid.UUID] = set()
    for row in tasks:
        wanted.update(uuid.UUID(str(d)) for d in row["output_datasets"] or ())
        for item in (row["input_versions"] or {}).get("inputs", []):
            try:
                wanted.add(uuid.UUID(str(item["dataset_uuid"])))
            except (KeyError, TypeError, ValueError):
                continue
    missing = sorted(w for w in wanted if str(w) not in known)
    if missing:
        found = await tx.registry.dataset_names_by_id(missing)
        known.update({str(dataset): name for dataset, name in found.items()})
    return known


def _version_of(item: Any) -> uuid.UUID | None:
    """The pinned dataset version of a stored input entry (``None`` if unreadable)."""
    try:
        return uuid.UUID(str(item["dataset_version"]))
    except (KeyError, TypeError, ValueError):
        return None


async def _input_locations(
    tx: Transaction,
    tasks: Sequence[Mapping[str, Any]],
    pointers: dict[uuid.UUID, dict[uuid.UUID, _Pointer]],
) -> dict[uuid.UUID, str]:
    """``storage_location`` of every pinned input version of ``tasks``."""
    known = {
        pointer.version: pointer.location
        for by_dataset in pointers.values()
        for pointer in by_dataset.values()
    }
    wanted = {
        version
        for row in tasks
        for item in (row["input_versions"] or {}).get("inputs", [])
        if (version := _version_of(item)) is not None
    }
    missing = wanted - known.keys()
    if missing:
        known.update(await tx.payload.storage_locations(missing))
    return known
