"""People's control routes on both engines: pause and resume a job by hand, rematerialize.

The world of :mod:`tests.test_people_data` (the ``api`` DAG: ``follow`` a
manual source writing ``blocks``, ``double`` reading it and writing
``doubled``). Pausing takes effect where backpressure's pause does (routing
creates no task, the manual trigger refuses); backpressure never lifts a
manual pause and a manual resume never lifts backpressure's.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from tests.api_fixtures import AUTH, DAG
from tests.test_people_data import World, _ids, _missing_like, world_of
from trace_core.authoring.events import DatasetEvent
from trace_core.clock import ManualClock
from trace_core.dispatcher.backpressure import PAUSE_PREFIX
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio

PAUSE = "/v1/dags/api/jobs/double/pause"
RESUME = "/v1/dags/api/jobs/double/resume"


async def _pause_state(repo: SqlRepository, job_id: uuid.UUID) -> tuple[bool, str | None]:
    async with repo.read() as tx:
        return await tx.job_states.pause_state(job_id)


async def _route_a_block(world: World) -> Any:
    """Emit one ``blocks`` event and route it: the report of that routing pass."""
    blocks = (await world.get("wendy", "/v1/datasets/blocks")).json()
    start = 10 * len(blocks["versions"][0]["ranges"] or [])
    accepted = await world.dispatcher.manual.emit(
        [
            DatasetEvent(
                uuid.UUID(blocks["dataset_uuid"]),
                uuid.UUID(blocks["current_version"]),
                partition_key=f"{start}-{start + 9}",
                start=start,
                end=start + 9,
            )
        ]
    )
    return await world.dispatcher.router.route(list(accepted.event_ids))


async def test_a_manual_pause_holds_the_job_until_a_person_resumes_it(
    repo: SqlRepository, clock: ManualClock
) -> None:
    async with world_of(repo, clock) as world:
        await world.user("wendy", "writer")
        double = (await _ids(repo))["job:double"]

        paused = await world.post("wendy", PAUSE)
        assert paused.status_code == 200, paused.text
        body = paused.json()
        assert (body["dag_name"], body["job_name"]) == ("api", "double")
        assert body["jobs"] == [
            {"job_id": str(double), "paused": True, "reason": "manual by wendy", "changed": True}
        ]
        assert await _pause_state(repo, double) == (True, "manual by wendy")
        again = (await world.post("wendy", PAUSE)).json()["jobs"][0]
        assert again["changed"] is False and again["reason"] == "manual by wendy"

        # The Dispatcher creates no task for it: its event is held.
        held = await _route_a_block(world)
        assert held.deferred == 1 and held.tasks_created == 0
        # Backpressure (no queue over a limit) does not lift a pause it did not set.
        report = await world.dispatcher.backpressure.run_once()
        assert report.resumed == []
        assert await _pause_state(repo, double) == (True, "manual by wendy")

        resumed = await world.post("wendy", RESUME)
        assert resumed.status_code == 200, resumed.text
        assert resumed.json()["jobs"] == [
            {"job_id": str(double), "paused": False, "reason": None, "changed": True}
        ]
        assert await _pause_state(repo, double) == (False, None)
        routed = await _route_a_block(world)
        assert routed.deferred == 0 and routed.tasks_created == 1
        async with repo.read() as tx:
            kinds = [e.kind for e in await tx.journal.newest(double, limit=10)]
        assert kinds.count("paused") == 1 and kinds.count("resumed") == 1


async def test_a_manual_resume_leaves_a_backpressure_pause_and_a_manual_pause_takes_it_over(
    repo: SqlRepository, clock: ManualClock
) -> None:
    async with world_of(repo, clock) as world:
        await world.user("wendy", "writer")
        follow = (await _ids(repo))["job:follow"]
        reason = PAUSE_PREFIX + "queue depth 1200 > 1000"
        async with repo.transaction() as tx:
            await tx.job_states.update_if_matches(
                follow, {"paused": True, "pause_reason": reason}, now=clock.now()
            )

        kept = await world.post("wendy", "/v1/dags/api/jobs/follow/resume")
        assert kept.status_code == 200
        assert kept.json()["jobs"][0] == {
            "job_id": str(follow),
            "paused": True,
            "reason": reason,
            "changed": False,
        }
        assert await _pause_state(repo, follow) == (True, reason)
        refused = await world.post("wendy", "/v1/dags/api/jobs/follow/trigger", {"key": "k"})
        assert refused.json()["refused"] == "paused by backpressure"

        taken = (await world.post("wendy", "/v1/dags/api/jobs/follow/pause")).json()["jobs"][0]
        assert taken["changed"] is True and taken["reason"] == "manual by wendy"
        # Backpressure's round sees no pressure, yet the pause is no longer its own.
        assert (await world.dispatcher.backpressure.run_once()).resumed == []
        assert await _pause_state(repo, follow) == (True, "manual by wendy")
        refused = await world.post("wendy", "/v1/dags/api/jobs/follow/trigger", {"key": "k"})
        assert refused.json()["refused"] == "paused by hand (manual by wendy)"

        await world.post("wendy", "/v1/dags/api/jobs/follow/resume")
        run = (await world.post("wendy", "/v1/dags/api/jobs/follow/trigger", {"key": "k"})).json()
        assert run["created"] is True and run["refused"] is None


async def test_readers_get_403_and_invisible_or_foreign_jobs_and_datasets_read_as_missing(
    repo: SqlRepository, clock: ManualClock
) -> None:
    async with world_of(repo, clock) as world:
        await world.user("rita", "reader")
        await world.user("wendy", "writer")
        await world.user("olga", "admin", "acme")
        double = (await _ids(repo))["job:double"]
        before = await world.get("rita", "/v1/datasets/doubled")
        for path in (PAUSE, RESUME, "/v1/datasets/doubled/rematerialize"):
            refused = await world.post("rita", path)
            assert refused.status_code == 403, (path, refused.text)
            assert refused.json()["error"] == "forbidden"
        assert await _pause_state(repo, double) == (False, None)
        assert (await world.get("rita", "/v1/datasets/doubled")).json() == before.json()

        # Another org's job and dataset do not exist for olga.
        for path, missing, swap in [
            (PAUSE, "/v1/dags/api/jobs/nosuch/pause", ("nosuch", "double")),
            (RESUME, "/v1/dags/api/jobs/nosuch/resume", ("nosuch", "double")),
            (
                "/v1/datasets/doubled/rematerialize",
                "/v1/datasets/nosuch/rematerialize",
                ("nosuch", "doubled"),
            ),
        ]:
            _missing_like(await world.post("olga", path), await world.post("olga", missing), swap)
        assert await _pause_state(repo, double) == (False, None)

        # Hidden from the writer by read_roles: missing too, and nothing changes.
        admin = await world.operator()
        await world.service.create_role(admin, "finance", None)
        await world.service.set_read_roles(admin, "doubled", ["finance"])
        _missing_like(
            await world.post("wendy", PAUSE),
            await world.post("wendy", "/v1/dags/api/jobs/nosuch/pause"),
            ("nosuch", "double"),
        )
        _missing_like(
            await world.post("wendy", "/v1/datasets/doubled/rematerialize"),
            await world.post("wendy", "/v1/datasets/nosuch/rematerialize"),
            ("nosuch", "doubled"),
        )
        assert await _pause_state(repo, double) == (False, None)
        assert (await world.get("olga", "/v1/datasets")).json() == []


async def test_rematerialize_deploys_a_new_version_of_the_dataset_and_what_follows(
    repo: SqlRepository, clock: ManualClock
) -> None:
    async with world_of(repo, clock) as world:
        await world.user("wendy", "writer")
        before = {
            name: (await world.get("wendy", f"/v1/datasets/{name}")).json()
            for name in ("blocks", "doubled")
        }
        clock.advance(1)  # versions are ordered by creation time
        done = await world.post("wendy", "/v1/datasets/doubled/rematerialize")
        assert done.status_code == 200, done.text
        body = done.json()
        assert body["dataset"] == "doubled" and body["dag_name"] == "api"
        assert body["changed"] is True and body["status"] in ("building", "current")
        # A new version of doubled is built beside the current one; blocks is unchanged.
        doubled = (await world.get("wendy", "/v1/datasets/doubled")).json()
        assert len(doubled["versions"]) == 2
        assert doubled["versions"][1]["version_id"] == before["doubled"]["current_version"]
        blocks = (await world.get("wendy", "/v1/datasets/blocks")).json()
        assert len(blocks["versions"]) == 1
        assert blocks["current_version"] == before["blocks"]["current_version"]
        dag = (await world.get("wendy", "/v1/dags/api")).json()
        assert dag["versions"][0]["version_id"] == body["dag_version_id"]
        # A second one is another rebuild (a fresh token), not the same deploy.
        clock.advance(1)
        again = (await world.post("wendy", "/v1/datasets/doubled/rematerialize")).json()
        assert again["changed"] is True and again["dag_version_id"] != body["dag_version_id"]


async def test_the_machine_routes_pause_and_resume_with_the_internal_token(
    repo: SqlRepository, clock: ManualClock
) -> None:
    async with world_of(repo, clock) as world:
        double = (await _ids(repo))["job:double"]
        body = {"dag": "api", "job": "double", "by": "ops-bot"}
        person = await world.client.post("/internal/pause", json=body)
        assert person.status_code == 401  # no internal token, nothing changes
        assert await _pause_state(repo, double) == (False, None)

        paused = await world.client.post("/internal/pause", json=body, headers=AUTH)
        assert paused.status_code == 200, paused.text
        assert paused.json()["jobs"] == [
            {"job_id": str(double), "paused": True, "reason": "manual by ops-bot", "changed": True}
        ]
        assert (await world.dispatcher.backpressure.run_once()).resumed == []
        resumed = await world.client.post("/internal/resume", json=body, headers=AUTH)
        assert resumed.json()["jobs"][0]["paused"] is False
        assert await _pause_state(repo, double) == (False, None)

        other_org = await world.client.post(
            "/internal/pause", json={**body, "org": "acme"}, headers=AUTH
        )
        assert other_org.status_code == 404
        assert other_org.json()["reason"] == "no job 'double' in DAG 'api' of org 'acme'"
        blank = await world.client.post("/internal/pause", json={**body, "by": " "}, headers=AUTH)
        assert blank.status_code == 400 and blank.json()["field"] == "by"
        assert await _pause_state(repo, double) == (False, None)


async def test_rematerializing_a_dataset_its_live_dag_no_longer_produces_is_a_400(
    repo: SqlRepository, clock: ManualClock
) -> None:
    async with world_of(repo, clock) as world:
        await world.user("wendy", "writer")
        without = DAG.split("  - name: double")[0]
        assert (await world.post("wendy", "/v1/dags", {"yaml": without})).status_code == 200
        dag = (await world.get("wendy", "/v1/dags/api")).json()
        refused = await world.post("wendy", "/v1/datasets/doubled/rematerialize")
        assert refused.status_code == 400, refused.text
        assert refused.json()["field"] == "name"
        assert refused.json()["reason"] == "no live version of DAG 'api' produces it"
        assert (await world.get("wendy", "/v1/dags/api")).json() == dag
