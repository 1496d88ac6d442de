"""A small world for the events, routing and journal areas' parity tests.

An org with dataset ``a`` (versions ``a1`` and ``a2``), made by job ``make``
of DAG ``up`` (version ``up``, ``current``, pointing at ``a1``), and read by
job ``read`` of the same version.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import sqlalchemy as sa

from tests.factories import wait_until
from trace_core.clock import ManualClock
from trace_core.storage.ports import JobRecord, NewDagVersion, NewDataset, NewDatasetVersion
from trace_core.storage.sql import SqlRepository


@dataclass
class World:
    """Ids of what :func:`make_world` created."""

    org_id: uuid.UUID
    dataset: uuid.UUID
    versions: dict[str, uuid.UUID] = field(default_factory=dict)
    dag_version: uuid.UUID = field(default_factory=uuid.uuid4)
    jobs: dict[str, uuid.UUID] = field(default_factory=dict)


def _job(
    w: World,
    name: str,
    *,
    input_datasets: tuple[uuid.UUID, ...] = (),
    output_datasets: tuple[uuid.UUID, ...] = (),
) -> JobRecord:
    return JobRecord(
        job_id=uuid.uuid4(),
        org_id=w.org_id,
        name=name,
        dag_name="up",
        dag_version_id=w.dag_version,
        activation="reactive",
        runtime="lambda",
        operator="op",
        config_hash="c",
        update_strategy="replace",
        input_datasets=input_datasets,
        output_datasets=output_datasets,
    )


async def make_world(repo: SqlRepository, clock: ManualClock) -> World:
    """Create the world (see the module docstring) in one transaction."""
    w = World(uuid.uuid4(), uuid.uuid4())
    now = clock.now()
    make = _job(w, "make", output_datasets=(w.dataset,))
    read = _job(w, "read", input_datasets=(w.dataset,))
    async with repo.transaction() as tx:
        await tx.registry.create_org_if_absent(w.org_id, "acme", now=now)
        await tx.registry.register_datasets_if_absent(
            [NewDataset(w.dataset, w.org_id, "a", "up", "make", 0, now)]
        )
        for n in (1, 2):
            v = NewDatasetVersion(uuid.uuid4(), w.dataset, f"h{n}", None, None, "x", now)
            await tx.registry.insert_dataset_version_if_absent(v)
            w.versions[f"a{n}"] = v.version_id
        await tx.deploy.insert_version(
            NewDagVersion(w.dag_version, w.org_id, "up", "h", "dag: up\n", now)
        )
        await tx.deploy.insert_pointers(w.dag_version, {w.dataset: w.versions["a1"]})
        await tx.deploy.mark_version_current(w.dag_version, now=now)
        await tx.deploy.insert_jobs([make, read], now=now)
    w.jobs = {"make": make.job_id, "read": read.job_id}
    return w


async def _lock_waiters(repo: SqlRepository) -> int:
    async with repo.read() as tx:
        query = sa.text(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE wait_event_type = 'Lock' AND datname = current_database()"
        )
        return int((await tx.connection.execute(query)).scalar_one())


async def wait_for_lock_waiter(repo: SqlRepository) -> None:
    """Until a statement of the test's database waits on a lock (Postgres; 30 s at most)."""
    await wait_until(
        "a statement waiting on a row lock",
        lambda: _lock_waiters(repo),
        time.monotonic() + 30,
        describe=lambda: "no backend waits on a lock",
    )
