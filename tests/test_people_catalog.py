"""The catalog area of the port (``tx.catalog``), on both engines: org-scoped in SQL.

Two orgs deploy the same DAG (same DAG, dataset and job names); every read
of one org answers only that org's objects, in the documented order.
"""

from __future__ import annotations

import uuid

import pytest

from tests.api_fixtures import DAG, OPERATORS
from trace_core.clock import ManualClock
from trace_core.dag import parse_dag
from trace_core.dispatcher.service import Dispatcher
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio


async def _deployed(repo: SqlRepository, clock: ManualClock) -> tuple[uuid.UUID, uuid.UUID]:
    dispatcher = Dispatcher(repo, operators=OPERATORS, clock=clock)
    for org in ("acme", "globex"):
        await dispatcher.deploy(parse_dag(DAG, operators=OPERATORS.names()), org_slug=org)
    clock.advance(5)
    changed = DAG.replace("operator: double", "operator: double\n    max_attempts: 5")
    await dispatcher.deploy(parse_dag(changed, operators=OPERATORS.names()), org_slug="acme")
    async with repo.read() as tx:
        acme, globex = await tx.registry.find_org("acme"), await tx.registry.find_org("globex")
    assert acme is not None and globex is not None
    async with repo.read() as tx:
        jobs = await tx.catalog.jobs(acme)
    (live,) = [j for j in jobs if j.name == "follow" and j.version_status == "current"]
    for i in range(6):
        clock.advance(1)
        await dispatcher.manual.create_task(live.job_id, f"k{i}")
    async with repo.read() as tx:
        other = [j for j in await tx.catalog.jobs(globex) if j.name == "follow"]
    await dispatcher.manual.create_task(other[0].job_id, "theirs")
    return acme, globex


async def test_every_read_is_scoped_to_its_org(repo: SqlRepository, clock: ManualClock) -> None:
    acme, globex = await _deployed(repo, clock)
    async with repo.read() as tx:
        catalog = tx.catalog
        (dag,) = await catalog.dags(acme)
        assert (dag.name, dag.versions) == ("api", 2)
        (theirs,) = await catalog.dags(globex)
        assert theirs.versions == 1 and theirs.current_version_id != dag.current_version_id
        assert await catalog.dags(uuid.uuid4()) == []

        versions = await catalog.dag_versions(acme, "api")
        assert [v.created_at for v in versions] == sorted(
            (v.created_at for v in versions), reverse=True
        )
        assert {v.status for v in versions} <= {"current", "building", "superseded"}
        assert dag.current_version_id in {v.version_id for v in versions}
        assert await catalog.dag_versions(acme, "nosuch") == []
        their_versions = await catalog.dag_versions(globex, "api")
        assert {v.version_id for v in versions}.isdisjoint(v.version_id for v in their_versions)

        datasets = await catalog.datasets(acme)
        assert [d.name for d in datasets] == ["blocks", "doubled"]
        assert all(d.read_roles == () and d.current_version is not None for d in datasets)
        assert all(d.location and d.location.startswith("s3://") for d in datasets)
        their_datasets = await catalog.datasets(globex)
        assert {d.dataset_uuid for d in datasets}.isdisjoint(d.dataset_uuid for d in their_datasets)
        blocks = datasets[0]
        (version,) = await catalog.dataset_versions(acme, blocks.dataset_uuid)
        assert version.version_id == blocks.current_version
        assert (version.ranges, version.max_cursor, version.events) == ([], None, 0)
        assert await catalog.dataset_versions(globex, blocks.dataset_uuid) == []

        jobs = await catalog.jobs(acme)
        assert sorted(j.name for j in jobs) == ["double", "double", "follow", "follow"]
        double = next(j for j in jobs if j.name == "double")
        assert double.inputs == (blocks.dataset_uuid,)
        assert double.outputs == (datasets[1].dataset_uuid,)
        job_ids = [j.job_id for j in jobs]

        tasks = await catalog.tasks(acme, job_ids, status=None, limit=100)
        assert len(tasks) == 6
        assert [t.queued_at for t in tasks] == sorted((t.queued_at for t in tasks), reverse=True)
        assert [t.task_id for t in await catalog.tasks(acme, job_ids, status=None, limit=2)] == [
            t.task_id for t in tasks[:2]
        ]
        many = [*(uuid.uuid4() for _ in range(1200)), *job_ids]  # several IN lists
        assert [t.task_id for t in await catalog.tasks(acme, many, status=None, limit=3)] == [
            t.task_id for t in tasks[:3]
        ]
        assert await catalog.tasks(acme, job_ids, status="Running", limit=10) == []
        assert await catalog.tasks(acme, [], status=None, limit=10) == []
        their_jobs = [j.job_id for j in await catalog.jobs(globex)]
        # Another org's job ids match nothing, even when asked for.
        assert await catalog.tasks(acme, their_jobs, status=None, limit=10) == []
        (their_task,) = await catalog.tasks(globex, their_jobs, status=None, limit=10)
        assert await catalog.task(acme, their_task.task_id) is None
        found = await catalog.task(acme, tasks[0].task_id)
        assert found == tasks[0] and found.status == "Queued" and found.attempt == 1
