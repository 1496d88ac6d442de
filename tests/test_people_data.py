"""People's data routes under /v1 on both engines: every field, visibility, role checks.

A real app (``create_app`` with the people routes) over a real database, the
lite key ring as the local issuer; the small DAG of :mod:`tests.api_fixtures`
(``follow`` a manual source writing ``blocks``, ``double`` reading ``blocks``
and writing ``doubled``).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.api_fixtures import AUTH, DAG, OPERATORS, TOKEN
from trace_core.api import create_app
from trace_core.authoring.events import DatasetEvent
from trace_core.clock import ManualClock
from trace_core.dag import parse_dag
from trace_core.dispatcher.service import Dispatcher
from trace_core.people import Caller, PeopleService, PlatformRole
from trace_core.security import KeyRing, PrivateKeySigner
from trace_core.storage.ports import NewLineageEdge
from trace_core.storage.sql import SqlRepository
from trace_lite.people_keys import issue_person_token, people_api

pytestmark = pytest.mark.anyio


@dataclass
class World:
    """An app with the people routes, its Dispatcher and the people service."""

    client: httpx.AsyncClient
    dispatcher: Dispatcher
    service: PeopleService
    ring: KeyRing
    clock: ManualClock
    repo: SqlRepository

    async def user(self, sub: str, role: str, org: str = "default", *roles: str) -> uuid.UUID:
        """A user of ``org`` with platform ``role``, member of org ``roles`` (created)."""
        record = await self.service.bootstrap_user(org, sub, PlatformRole(role))
        admin = await self.service.operator(org)
        known = {r.slug for r in await self.service.list_roles(admin)}
        for slug in roles:
            if slug not in known:
                await self.service.create_role(admin, slug, None)
                known.add(slug)
            await self.service.add_member(admin, slug, record.user_id)
        return record.user_id

    async def auth(self, sub: str) -> dict[str, str]:
        token = await issue_person_token(self.ring, sub, self.clock, ttl_seconds=600)
        return {"Authorization": f"Bearer {token}"}

    async def get(self, sub: str, path: str, **params: Any) -> httpx.Response:
        return await self.client.get(path, params=params, headers=await self.auth(sub))

    async def post(self, sub: str, path: str, body: Any = None) -> httpx.Response:
        return await self.client.post(path, json=body or {}, headers=await self.auth(sub))

    async def operator(self, org: str = "default") -> Caller:
        return await self.service.operator(org)


@asynccontextmanager
async def world_of(
    repo: SqlRepository, clock: ManualClock, **app_options: Any
) -> AsyncIterator[World]:
    """The app with ``DAG`` deployed in org ``default`` (``app_options``: more of
    ``create_app``'s, e.g. a query service and its verifier)."""
    dispatcher = Dispatcher(repo, operators=OPERATORS, clock=clock)
    await dispatcher.deploy(parse_dag(DAG, operators=OPERATORS.names()))
    ring = KeyRing(clock)
    ring.bootstrap(PrivateKeySigner.generate())
    api = people_api(repo, clock, ring=ring, environ={})
    app = create_app(dispatcher, internal_token=TOKEN, people=api, **app_options)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://trace.test") as client:
        yield World(client, dispatcher, api.service, ring, clock, repo)


async def _ids(repo: SqlRepository, org: str = "default") -> dict[str, uuid.UUID]:
    """Dataset and job ids of org ``org`` by name (jobs as ``job:<name>``)."""
    async with repo.read() as tx:
        org_id = await tx.registry.find_org(org)
        assert org_id is not None
        found = {d.name: d.dataset_uuid for d in await tx.catalog.datasets(org_id)}
        found |= {f"job:{j.name}": j.job_id for j in await tx.catalog.jobs(org_id)}
    return found


async def _record_lineage(world: World) -> None:
    """``doubled.value`` is computed from ``blocks.value``, filtered by ``blocks.ok``."""
    ids = await _ids(world.repo)
    async with world.repo.transaction() as tx:
        await tx.lineage.record(
            ids["doubled"],
            ids["job:double"],
            [
                NewLineageEdge("value", ids["blocks"], "value"),
                NewLineageEdge("*", ids["blocks"], "ok", kind="FILTER"),
            ],
        )


def _missing_like(response: httpx.Response, missing: httpx.Response, swap: tuple[str, str]) -> None:
    """``response`` is exactly the 404 of a missing object (its name swapped in)."""
    assert response.status_code == missing.status_code == 404
    assert (
        response.json() == httpx.Response(404, content=missing.text.replace(*swap).encode()).json()
    )


async def test_every_read_answers_its_fields(repo: SqlRepository, clock: ManualClock) -> None:
    async with world_of(repo, clock) as world:
        await world.user("rita", "reader")
        ids = await _ids(repo)
        run = await world.dispatcher.manual.create_task("api/follow", "k1")
        await _record_lineage(world)

        dags = (await world.get("rita", "/v1/dags")).json()
        assert len(dags) == 1
        (dag,) = dags
        assert dag["name"] == "api" and dag["versions"] == 1
        assert uuid.UUID(dag["current_version_id"])
        assert dag["last_deployed_at"].startswith(clock.now().date().isoformat())

        detail = (await world.get("rita", "/v1/dags/api")).json()
        assert detail["name"] == "api"
        (version,) = detail["versions"]
        assert version["version_id"] == dag["current_version_id"]
        assert version["status"] == "current"
        assert len(version["yaml_hash"]) >= 16
        assert version["activated_at"] is not None and version["created_at"]
        assert version["datasets"] == ["blocks", "doubled"]

        listed = (await world.get("rita", "/v1/datasets")).json()
        assert [d["name"] for d in listed] == ["blocks", "doubled"]
        blocks = listed[0]
        assert blocks["dataset_uuid"] == str(ids["blocks"])
        assert (blocks["producer_dag"], blocks["producer_job"]) == ("api", "follow")
        assert blocks["read_roles"] == []
        assert uuid.UUID(blocks["current_version"]) and blocks["created_at"]

        one = (await world.get("rita", "/v1/datasets/blocks")).json()
        assert {k: one[k] for k in blocks} == blocks
        (dv,) = one["versions"]
        assert dv["version_id"] == blocks["current_version"]
        assert dv["location"].startswith("s3://") and dv["config_hash"]
        assert dv["ranges"] == [] and dv["blocks_covered"] == 0
        assert dv["max_cursor"] is None and dv["events"] == 0
        assert dv["range_start"] is None and dv["range_end"] is None and dv["created_at"]

        tasks = (await world.get("rita", "/v1/tasks")).json()
        assert [t["task_id"] for t in tasks] == [str(run.task_id)]
        (task,) = tasks
        assert (task["dag"], task["job"], task["status"]) == ("api", "follow", "Queued")
        assert task["job_id"] == str(ids["job:follow"]) and task["dag_version_id"]
        assert (task["attempt"], task["max_attempts"]) == (1, 3)
        assert task["partitions"] == [] and task["queued_at"]
        assert task["started_at"] is task["completed_at"] is task["next_retry_at"] is None
        assert task["error_message"] is None
        assert (await world.get("rita", "/v1/tasks", status="Running")).json() == []
        assert (await world.get("rita", "/v1/tasks", job="double")).json() == []
        assert len((await world.get("rita", "/v1/tasks", dag="api", job="follow")).json()) == 1

        got = (await world.get("rita", f"/v1/tasks/{run.task_id}")).json()
        assert {k: got[k] for k in task} == task
        assert got["attempts"] == []
        # One failed attempt: the task, its attempt and its error.
        claimed = await world.client.post(
            "/internal/task-claim",
            json={"task_id": str(run.task_id), "worker_id": "w-1"},
            headers=AUTH,
        )
        lease = claimed.json()
        failed = await world.client.post(
            "/internal/task-complete",
            json={
                "task_id": str(run.task_id),
                "attempt": lease["attempt"],
                "lease_token": lease["lease_token"],
                "status": "Failed",
                "error_message": "boom",
                "retryable": True,
            },
            headers=AUTH,
        )
        assert failed.status_code == 200, failed.text
        got = (await world.get("rita", f"/v1/tasks/{run.task_id}")).json()
        assert got["status"] == "Failed" and got["error_message"] == "boom"
        assert got["started_at"] is not None and got["next_retry_at"] is not None
        (attempt,) = got["attempts"]
        assert (attempt["attempt"], attempt["worker_id"]) == (1, "w-1")
        assert attempt["status"] == "Failed" and attempt["ended_at"] is not None
        assert attempt["started_at"] and uuid.UUID(attempt["attempt_id"])
        assert attempt["error"] is not None and "boom" in str(attempt["error"])
        assert attempt["result"] is None
        assert (attempt["stream"], attempt["message_id"]) == (None, None)

        explained = (await world.get("rita", "/v1/dags/api/jobs/follow/explain")).json()
        assert (explained["dag_name"], explained["job_name"]) == ("api", "follow")
        assert explained["job_id"] == str(ids["job:follow"])
        assert explained["tasks_by_status"] == {"Failed": 1}
        assert [f["error"] for f in explained["failures"]] == ["boom"]

        up = (await world.get("rita", "/v1/lineage", dataset="doubled")).json()
        assert (up["dataset"], up["column"], up["direction"]) == ("doubled", None, "both")
        versions = {edge.pop("dataset_version") for edge in up["upstream"]}
        assert len(versions) == 1 and uuid.UUID(versions.pop())  # the version recorded for
        assert up["upstream"] == [
            {
                "depth": 1,
                "output_dataset": "doubled",
                "output_column": "*",
                "input_dataset": "blocks",
                "input_column": "ok",
                "kind": "FILTER",
            },
            {
                "depth": 1,
                "output_dataset": "doubled",
                "output_column": "value",
                "input_dataset": "blocks",
                "input_column": "value",
                "kind": "TRANSFORMATION",
            },
        ]
        assert up["downstream"] == []
        down = (await world.get("rita", "/v1/lineage", dataset="blocks", direction="down")).json()
        assert down["upstream"] == [] and len(down["downstream"]) == 2


async def test_bad_input_is_a_400_naming_the_field(repo: SqlRepository, clock: ManualClock) -> None:
    async with world_of(repo, clock) as world:
        await world.user("wendy", "writer")
        for path, params, field in [
            ("/v1/tasks", {"limit": 0}, "limit"),
            ("/v1/tasks", {"limit": 1001}, "limit"),
            ("/v1/tasks", {"status": "Sleeping"}, "status"),
            ("/v1/lineage", {}, "dataset"),
            ("/v1/lineage", {"dataset": "blocks", "depth": 0}, "depth"),
            ("/v1/lineage", {"dataset": "blocks", "direction": "sideways"}, "direction"),
            ("/v1/tasks/not-a-uuid", {}, "task_id"),
        ]:
            response = await world.get("wendy", path, **params)
            assert response.status_code == 400, (path, params, response.text)
            body = response.json()
            assert body["error"] == "invalid_request" and field in body["field"], body
        bad = await world.post("wendy", "/v1/dags", {"yaml": "dag: x\njobs: nope\n"})
        assert bad.status_code == 400 and bad.json()["error"] == "invalid_request"
        blank = await world.post("wendy", "/v1/dags", {"yaml": "  "})
        assert blank.status_code == 400 and blank.json()["field"] == "yaml"
        other_org = await world.post("wendy", "/v1/dags", {"yaml": f"org: acme\n{DAG}"})
        assert other_org.status_code == 400 and other_org.json()["field"] == "yaml"
        no_key = await world.post("wendy", "/v1/dags/api/jobs/follow/trigger", {})
        assert no_key.status_code == 400 and no_key.json()["field"] == "key"
        not_manual = await world.post("wendy", "/v1/dags/api/jobs/double/trigger", {"key": "k"})
        assert not_manual.status_code == 404  # not a live source job


async def test_read_roles_hide_a_dataset_its_jobs_tasks_explain_and_lineage(
    repo: SqlRepository, clock: ManualClock
) -> None:
    async with world_of(repo, clock) as world:
        await world.user("rita", "reader")
        await world.user("fiona", "reader", "default", "finance")
        await world.user("ada", "admin")
        run = await world.dispatcher.manual.create_task("api/follow", "k1")
        await _record_lineage(world)
        await world.service.set_read_roles(await world.operator(), "blocks", ["finance"])
        ids = await _ids(repo)

        for who, sees in (("rita", False), ("fiona", True), ("ada", True)):
            names = [d["name"] for d in (await world.get(who, "/v1/datasets")).json()]
            assert names == (["blocks", "doubled"] if sees else ["doubled"]), who
            version = (await world.get(who, "/v1/dags/api")).json()["versions"][0]
            assert version["datasets"] == (["blocks", "doubled"] if sees else ["doubled"])
            tasks = (await world.get(who, "/v1/tasks")).json()
            assert len(tasks) == (1 if sees else 0), who
            lineage = (await world.get(who, "/v1/lineage", dataset="doubled")).json()
            assert len(lineage["upstream"]) == (2 if sees else 0), who
            if sees:
                continue
            for path, missing, swap in [
                ("/v1/datasets/blocks", "/v1/datasets/nosuch", ("nosuch", "blocks")),
                (
                    f"/v1/tasks/{run.task_id}",
                    f"/v1/tasks/{uuid.UUID(int=7)}",
                    (str(uuid.UUID(int=7)), str(run.task_id)),
                ),
                (
                    "/v1/dags/api/jobs/follow/explain",
                    "/v1/dags/api/jobs/nosuch/explain",
                    ("nosuch", "follow"),
                ),
                (
                    "/v1/dags/api/jobs/double/explain",  # it reads blocks
                    "/v1/dags/api/jobs/nosuch/explain",
                    ("nosuch", "double"),
                ),
            ]:
                _missing_like(await world.get(who, path), await world.get(who, missing), swap)
            _missing_like(
                await world.get(who, "/v1/lineage", dataset="blocks"),
                await world.get(who, "/v1/lineage", dataset="nosuch"),
                ("nosuch", "blocks"),
            )
            text = " ".join(
                [
                    (await world.get(who, p)).text
                    for p in ("/v1/datasets", "/v1/dags/api", "/v1/tasks", "/v1/dags")
                ]
            )
            assert str(ids["blocks"]) not in text and '"blocks"' not in text
            assert str(run.task_id) not in text


async def test_writers_deploy_roll_back_and_trigger_readers_get_403_and_change_nothing(
    repo: SqlRepository, clock: ManualClock
) -> None:
    async with world_of(repo, clock) as world:
        await world.user("rita", "reader")
        await world.user("wendy", "writer")
        changed = DAG.replace("operator: double", "operator: double\n    max_attempts: 5")

        async def state() -> Any:
            caller = await world.operator()
            async with repo.read() as tx:
                versions = await tx.catalog.dag_versions(caller.org_id, "api")
                jobs = await tx.catalog.jobs(caller.org_id)
                tasks = await tx.catalog.tasks(
                    caller.org_id, [j.job_id for j in jobs], status=None, limit=100
                )
            return versions, jobs, tasks

        before = await state()
        for path, body in [
            ("/v1/dags", {"yaml": changed}),
            ("/v1/dags/api/rollback", {}),
            ("/v1/dags/api/jobs/follow/trigger", {"key": "k"}),
            ("/v1/dags/nosuch/rollback", {}),  # 403 before anything is looked up
        ]:
            refused = await world.post("rita", path, body)
            assert refused.status_code == 403, (path, refused.text)
            assert refused.json()["error"] == "forbidden"
            assert "write" in refused.json()["reason"]
        assert await state() == before

        deployed = await world.post("wendy", "/v1/dags", {"yaml": changed})
        assert deployed.status_code == 200, deployed.text
        body = deployed.json()
        assert body["dag_name"] == "api" and body["changed"] is True
        assert body["status"] in ("current", "building")
        assert body["abandoned_version_ids"] == [] and body["canceled_task_ids"] == []
        again = (await world.post("wendy", "/v1/dags", {"yaml": changed})).json()
        assert again["changed"] is False and again["dag_version_id"] == body["dag_version_id"]

        rolled = await world.post("wendy", "/v1/dags/api/rollback")
        assert rolled.status_code == 200, rolled.text
        back = rolled.json()
        assert back["dag_name"] == "api"
        assert back["abandoned_version_ids"] == [body["dag_version_id"]]
        assert (
            back["current_version_id"] == before[0][0].version_id.hex
            or uuid.UUID(back["current_version_id"]) == before[0][0].version_id
        )
        missing = await world.post("wendy", "/v1/dags/nosuch/rollback")
        assert missing.status_code == 404 and missing.json()["reason"] == "no DAG 'nosuch'"

        triggered = await world.post("wendy", "/v1/dags/api/jobs/follow/trigger", {"key": "k"})
        assert triggered.status_code == 200, triggered.text
        run = triggered.json()
        assert run["created"] is True and run["refused"] is None and run["task_id"]
        same = (await world.post("wendy", "/v1/dags/api/jobs/follow/trigger", {"key": "k"})).json()
        assert same["task_id"] == run["task_id"] and same["created"] is False

        # Hidden from the writer: its job reads as missing, its name as unknown.
        await world.service.create_role(await world.operator(), "finance", None)
        await world.service.set_read_roles(await world.operator(), "blocks", ["finance"])
        _missing_like(
            await world.post("wendy", "/v1/dags/api/jobs/follow/trigger", {"key": "k2"}),
            await world.post("wendy", "/v1/dags/api/jobs/nosuch/trigger", {"key": "k2"}),
            ("nosuch", "follow"),
        )
        reader = "dag: peek\njobs:\n  - {name: p, activation: reactive, runtime: ecs_platform, "
        reader += "operator: double, execution_strategy: PerPartition, "
        reader += "inputs: [{from: {dataset: %s}}], outputs: [{dataset: peeked}]}\n"
        hidden = await world.post("wendy", "/v1/dags", {"yaml": reader % "blocks"})
        unknown = await world.post("wendy", "/v1/dags", {"yaml": reader % "nosuch"})
        assert hidden.status_code == unknown.status_code == 400
        assert (
            hidden.json()
            == httpx.Response(400, content=unknown.text.replace("nosuch", "blocks").encode()).json()
        )
        # Nor may a new version read a hidden dataset into a visible one.
        produces = reader.replace("dag: peek", "dag: other") % "doubled"
        produces = produces.replace("dataset: peeked", "dataset: blocks")
        taken = await world.post("wendy", "/v1/dags", {"yaml": produces})
        assert taken.status_code == 400 and taken.json()["field"] == "yaml"
        assert taken.json()["reason"] == "dataset 'blocks' is not one you may see"
        again = await world.post("wendy", "/v1/dags", {"yaml": changed})  # names blocks
        assert again.json()["reason"] == "dataset 'blocks' is not one you may see"
        # A version of api without blocks: api produces it today, so not by this writer.
        without = DAG.split("  - name: double")[0].replace("dataset: blocks", "dataset: fresh")
        redeploy = await world.post("wendy", "/v1/dags", {"yaml": without})
        assert redeploy.status_code == 400 and redeploy.json()["field"] == "yaml"
        assert "blocks" not in redeploy.text and "may not see" in redeploy.text
        no_rollback = await world.post("wendy", "/v1/dags/api/rollback")
        assert no_rollback.status_code == 400 and no_rollback.json()["field"] == "dag"
        assert "blocks" not in no_rollback.text
        fine = await world.post("wendy", "/v1/dags", {"yaml": reader % "doubled"})
        assert fine.status_code == 200 and fine.json()["dag_name"] == "peek"


async def test_another_orgs_objects_do_not_exist(repo: SqlRepository, clock: ManualClock) -> None:
    async with world_of(repo, clock) as world:
        await world.user("olga", "admin", "acme")
        run = await world.dispatcher.manual.create_task("api/follow", "k1")
        assert (await world.get("olga", "/v1/dags")).json() == []
        assert (await world.get("olga", "/v1/datasets")).json() == []
        assert (await world.get("olga", "/v1/tasks")).json() == []
        _missing_like(
            await world.get("olga", "/v1/dags/api"),
            await world.get("olga", "/v1/dags/nosuch"),
            ("nosuch", "api"),
        )
        _missing_like(
            await world.get("olga", f"/v1/tasks/{run.task_id}"),
            await world.get("olga", f"/v1/tasks/{uuid.UUID(int=7)}"),
            (str(uuid.UUID(int=7)), str(run.task_id)),
        )
        explain = await world.get("olga", "/v1/dags/api/jobs/follow/explain")
        assert explain.status_code == 404
        assert explain.json()["reason"] == "no job 'follow' in DAG 'api' of org 'acme'"
        trigger = await world.post("olga", "/v1/dags/api/jobs/follow/trigger", {"key": "k"})
        assert trigger.status_code == 404
        # The same DAG deployed in acme is acme's own.
        mine = await world.post("olga", "/v1/dags", {"yaml": DAG})
        assert mine.status_code == 200 and mine.json()["changed"] is True
        assert [d["name"] for d in (await world.get("olga", "/v1/datasets")).json()] == [
            "blocks",
            "doubled",
        ]
        acme = await _ids(repo, "acme")
        default = await _ids(repo)
        assert acme["blocks"] != default["blocks"]


async def test_the_internal_token_does_not_open_the_data_routes(
    repo: SqlRepository, clock: ManualClock
) -> None:
    async with world_of(repo, clock) as world:
        for path in ("/v1/dags", "/v1/datasets", "/v1/tasks", "/v1/lineage?dataset=blocks"):
            response = await world.client.get(path, headers={"Authorization": f"Bearer {TOKEN}"})
            assert response.status_code == 401, path
        document = (
            await world.client.get("/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"})
        ).json()
        for path in ("/v1/dags", "/v1/datasets/{name}", "/v1/tasks/{task_id}", "/v1/lineage"):
            for operation in document["paths"][path].values():
                assert operation["security"] == [{"personBearer": []}], path


async def test_a_datasets_coverage_is_answered(repo: SqlRepository, clock: ManualClock) -> None:
    async with world_of(repo, clock) as world:
        await world.user("rita", "reader")
        blocks = (await world.get("rita", "/v1/datasets/blocks")).json()
        version = uuid.UUID(blocks["current_version"])
        dataset = uuid.UUID(blocks["dataset_uuid"])
        await world.dispatcher.manual.emit(
            [
                DatasetEvent(dataset, version, partition_key=f"{a}-{b}", start=a, end=b)
                for a, b in ((0, 9), (10, 19), (40, 49))
            ]
        )
        (dv,) = (await world.get("rita", "/v1/datasets/blocks")).json()["versions"]
        assert dv["ranges"] == [[0, 19], [40, 49]]
        assert dv["blocks_covered"] == 30 and dv["events"] == 3
