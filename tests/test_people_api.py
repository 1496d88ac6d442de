"""The people routes under /v1 on both engines: tokens, platform roles, org isolation.

A real app (``create_app`` with the people routes) over a real database, a
key ring as the local issuer, and ``trace-lite token`` for the CLI path.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.api_fixtures import DAG, OPERATORS, TOKEN
from trace_core.api import create_app
from trace_core.api.people import PeopleApi
from trace_core.clock import ManualClock, SystemClock
from trace_core.dag import parse_dag
from trace_core.dispatcher.service import Dispatcher
from trace_core.people import PeopleService, PlatformRole
from trace_core.security import JwksCache, KeyRing, PrivateKeySigner
from trace_core.security.people_tokens import PeopleTokenVerifier
from trace_core.storage.sql import SqlRepository
from trace_lite.cli import main as trace_lite
from trace_lite.people_keys import (
    LOCAL_AUDIENCE,
    LOCAL_ISSUER,
    issue_person_token,
    open_people_keys,
    people_api,
)

pytestmark = pytest.mark.anyio


@dataclass
class People:
    client: httpx.AsyncClient
    service: PeopleService
    ring: KeyRing
    clock: ManualClock
    repo: SqlRepository

    async def user(self, sub: str, role: str, org: str = "default") -> uuid.UUID:
        record = await self.service.bootstrap_user(org, sub, PlatformRole(role))
        return record.user_id

    async def auth(self, sub: str) -> dict[str, str]:
        token = await issue_person_token(self.ring, sub, self.clock, ttl_seconds=600)
        return {"Authorization": f"Bearer {token}"}

    async def snapshot(self, org: str) -> Any:
        caller = await self.service.operator(org)
        users = [
            (u.external_id, u.role, u.disabled_at) for u in await self.service.list_users(caller)
        ]
        roles = [(r.slug, r.members) for r in await self.service.list_roles(caller)]
        visibility = await self.service.read_roles(caller, "doubled") if org == "default" else []
        return users, roles, visibility


@asynccontextmanager
async def people_app(repo: SqlRepository, clock: ManualClock) -> AsyncIterator[People]:
    dispatcher = Dispatcher(repo, operators=OPERATORS, clock=clock)
    await dispatcher.deploy(parse_dag(DAG, operators=OPERATORS.names()))
    ring = KeyRing(clock)
    ring.bootstrap(PrivateKeySigner.generate())
    api = people_api(repo, clock, ring=ring, environ={})
    app = create_app(dispatcher, internal_token=TOKEN, people=api)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://trace.test") as client:
        yield People(client, api.service, ring, clock, repo)


async def test_me_and_what_401_means(repo: SqlRepository, clock: ManualClock) -> None:
    async with people_app(repo, clock) as p:
        await p.user("alice", "writer")
        admin = await p.auth("admin")  # not a user yet
        await p.user("admin", "admin")
        await p.client.post("/v1/org-roles", json={"slug": "finance"}, headers=admin)
        listed = await p.client.get("/v1/users", headers=admin)
        assert listed.status_code == 200, listed.text
        alice_id = next(u["id"] for u in listed.json() if u["external_id"] == "alice")
        await p.client.put(f"/v1/org-roles/finance/members/{alice_id}", headers=admin)

        me = await p.client.get("/v1/me", headers=await p.auth("alice"))
        assert me.status_code == 200, me.text
        body = me.json()
        assert (body["external_id"], body["role"], body["org"]) == ("alice", "writer", "default")
        assert body["org_roles"] == ["finance"] and body["disabled"] is False

        for headers in (
            {},
            {"Authorization": "Bearer not.a.token"},
            {"Authorization": f"Bearer {TOKEN}"},  # the internal token opens no people route
            await p.auth("nobody"),
        ):
            answer = await p.client.get("/v1/me", headers=headers)
            assert answer.status_code == 401, headers
            assert answer.json()["error"] == "unauthorized"
            assert answer.headers["WWW-Authenticate"].startswith("Bearer")
        # nothing is learnt without a person's token, not even which paths exist
        for path in ("/v1/users/x/y/z", "/v1/datasets/any/thing"):
            assert (await p.client.get(path)).status_code == 401
        # a person's token opens no internal route, the internal token still does
        assert (await p.client.get("/healthz", headers=await p.auth("alice"))).status_code == 401
        assert (
            await p.client.get("/healthz", headers={"Authorization": f"Bearer {TOKEN}"})
        ).status_code == 200

        disabled = await p.client.post(f"/v1/users/{alice_id}/disable", headers=admin)
        assert disabled.status_code == 200 and disabled.json()["disabled"] is True
        assert (await p.client.get("/v1/me", headers=await p.auth("alice"))).status_code == 401


async def test_admin_manages_people_and_bad_input_names_the_field(
    repo: SqlRepository, clock: ManualClock
) -> None:
    async with people_app(repo, clock) as p:
        await p.user("root", "admin")
        admin = await p.auth("root")
        created = await p.client.post(
            "/v1/users", json={"external_id": "bob", "role": "reader"}, headers=admin
        )
        assert created.status_code == 201, created.text
        bob = created.json()["id"]
        assert (
            await p.client.post(
                "/v1/users", json={"external_id": "bob", "role": "reader"}, headers=admin
            )
        ).status_code == 409
        bad = await p.client.post(
            "/v1/users", json={"external_id": "carl", "role": "boss"}, headers=admin
        )
        assert (bad.status_code, bad.json()["field"]) == (400, "role")
        assert (
            await p.client.post("/v1/org-roles", json={"slug": "Not A Slug"}, headers=admin)
        ).json()["field"] == "slug"
        changed = await p.client.patch(f"/v1/users/{bob}", json={"role": "writer"}, headers=admin)
        assert changed.json()["role"] == "writer"
        assert (
            await p.client.post("/v1/org-roles", json={"slug": "ops"}, headers=admin)
        ).status_code == 201
        assert (
            await p.client.put(f"/v1/org-roles/ops/members/{bob}", headers=admin)
        ).status_code == 204
        roles = (await p.client.get("/v1/org-roles", headers=admin)).json()
        assert roles == [{"slug": "ops", "name": "ops", "members": 1}]
        set_roles = await p.client.put(
            "/v1/datasets/doubled/read-roles", json={"read_roles": ["ops"]}, headers=admin
        )
        assert set_roles.json() == {"read_roles": ["ops"]}
        unknown = await p.client.put(
            "/v1/datasets/doubled/read-roles", json={"read_roles": ["ghost"]}, headers=admin
        )
        assert (unknown.status_code, unknown.json()["field"]) == (400, "read_roles[0]")
        assert (await p.client.get("/v1/datasets/doubled/read-roles", headers=admin)).json() == {
            "read_roles": ["ops"]
        }
        assert (
            await p.client.get("/v1/datasets/missing/read-roles", headers=admin)
        ).status_code == 404
        assert (
            await p.client.delete(f"/v1/org-roles/ops/members/{bob}", headers=admin)
        ).status_code == 204
        assert (await p.client.delete("/v1/org-roles/ops", headers=admin)).status_code == 204
        assert (await p.client.delete("/v1/org-roles/ops", headers=admin)).status_code == 404


def _writes(user_id: str) -> list[tuple[str, str, dict[str, Any] | None]]:
    """Every writing people route, with a valid body."""
    return [
        ("POST", "/v1/users", {"external_id": "mallory", "role": "admin"}),
        ("PATCH", f"/v1/users/{user_id}", {"role": "admin"}),
        ("POST", f"/v1/users/{user_id}/disable", None),
        ("POST", "/v1/org-roles", {"slug": "sneaky"}),
        ("DELETE", "/v1/org-roles/finance", None),
        ("PUT", f"/v1/org-roles/finance/members/{user_id}", None),
        ("DELETE", f"/v1/org-roles/finance/members/{user_id}", None),
        ("PUT", "/v1/datasets/doubled/read-roles", {"read_roles": []}),
    ]


async def test_readers_and_writers_may_not_manage(repo: SqlRepository, clock: ManualClock) -> None:
    async with people_app(repo, clock) as p:
        await p.user("root", "admin")
        admin = await p.auth("root")
        await p.client.post("/v1/org-roles", json={"slug": "finance"}, headers=admin)
        reader_id = await p.user("rita", "reader")
        await p.user("walt", "writer")
        await p.client.put(f"/v1/org-roles/finance/members/{reader_id}", headers=admin)
        await p.client.put(
            "/v1/datasets/doubled/read-roles", json={"read_roles": ["finance"]}, headers=admin
        )
        before = await p.snapshot("default")
        for sub in ("rita", "walt"):
            headers = await p.auth(sub)
            for method, path, body in _writes(str(reader_id)):
                answer = await p.client.request(method, path, json=body, headers=headers)
                assert answer.status_code == 403, (sub, method, path, answer.text)
                assert answer.json()["error"] == "forbidden"
            for path in ("/v1/users", "/v1/org-roles", "/v1/datasets/doubled/read-roles"):
                assert (await p.client.get(path, headers=headers)).status_code == 403
        assert await p.snapshot("default") == before


ORG_A, ORG_B = "default", "umbrella"


@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    subs=st.lists(
        st.tuples(
            st.from_regex(r"[a-z]{1,8}", fullmatch=True), st.sampled_from(list(PlatformRole))
        ),
        min_size=1,
        max_size=4,
        unique_by=lambda t: t[0],
    ),
    slugs=st.lists(st.from_regex(r"[a-z]{1,6}", fullmatch=True), max_size=3, unique=True),
)
async def test_another_orgs_people_are_invisible(
    repo: SqlRepository, clock: ManualClock, subs: list[tuple[str, PlatformRole]], slugs: list[str]
) -> None:
    async with people_app(repo, clock) as p:
        run = uuid.uuid4().hex[:8]  # examples share the database: fresh subjects each time
        a_ids = []
        for sub, role in subs:
            a_ids.append(await p.user(f"a-{run}-{sub}", role.value, ORG_A))
        a_operator = await p.service.operator(ORG_A)
        for slug in slugs:
            await p.service.create_role(a_operator, f"{run[:4]}{slug}")
            await p.service.add_member(a_operator, f"{run[:4]}{slug}", a_ids[0])
        b_admin = f"b-{run}"
        await p.user(b_admin, "admin", ORG_B)
        headers = await p.auth(b_admin)
        before = await p.snapshot(ORG_A)

        users = (await p.client.get("/v1/users", headers=headers)).json()
        assert not {u["external_id"] for u in users} & {f"a-{run}-{sub}" for sub, _ in subs}
        assert {u["id"] for u in users}.isdisjoint({str(i) for i in a_ids})
        roles = (await p.client.get("/v1/org-roles", headers=headers)).json()
        assert not {r["slug"] for r in roles} & {f"{run[:4]}{s}" for s in slugs}
        for user_id in a_ids:
            for method, path, body in _writes(str(user_id)):
                path = path.replace("finance", f"{run[:4]}{slugs[0]}" if slugs else "finance")
                answer = await p.client.request(method, path, json=body, headers=headers)
                if method == "POST" and path in ("/v1/users", "/v1/org-roles"):
                    continue  # creates in B, never in A (checked by the snapshot)
                assert answer.status_code == 404, (method, path, answer.text)
        assert (
            await p.client.get("/v1/datasets/doubled/read-roles", headers=headers)
        ).status_code == 404
        assert await p.snapshot(ORG_A) == before


async def test_openapi_describes_the_person_scheme(repo: SqlRepository, clock: ManualClock) -> None:
    async with people_app(repo, clock) as p:
        document = (await p.client.get("/openapi.json")).json()
    assert document["paths"]["/v1/me"]["get"]["security"] == [{"personBearer": []}]
    assert document["paths"]["/v1/users"]["post"]["responses"]["403"]
    assert document["components"]["securitySchemes"]["personBearer"]["scheme"] == "bearer"
    assert document["paths"]["/healthz"]["get"]["security"] == [{"internalBearer": []}]


async def test_trace_lite_token_opens_v1_me(
    database_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data_dir = tmp_path / "data"
    # The CLI runs its own event loop: from a worker thread, as from a shell.
    add = ["people", "user", "add", "--db", database_url, "--user", "ada", "--role", "reader"]
    assert await anyio.to_thread.run_sync(trace_lite, add) == 0
    token_cmd = ["token", "--user", "ada", "--data-dir", str(data_dir), "--ttl", "120"]
    assert await anyio.to_thread.run_sync(trace_lite, token_cmd) == 0
    token = capsys.readouterr().out.strip().splitlines()[-1]
    clock = SystemClock()
    repo = SqlRepository(database_url)
    try:
        dispatcher = Dispatcher(repo, operators=OPERATORS, clock=clock)
        ring = open_people_keys(data_dir, clock)  # what `trace-lite serve` opens
        app = create_app(
            dispatcher, internal_token=TOKEN, people=people_api(repo, clock, ring=ring, environ={})
        )
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://trace.test"
        ) as client:
            me = await client.get("/v1/me", headers={"Authorization": f"Bearer {token}"})
    finally:
        await repo.close()
    assert me.status_code == 200, me.text
    assert (me.json()["external_id"], me.json()["role"]) == ("ada", "reader")


async def test_an_unreachable_issuer_is_503(repo: SqlRepository, clock: ManualClock) -> None:
    async def down() -> dict[str, Any]:
        raise OSError("connection refused")

    dispatcher = Dispatcher(repo, operators=OPERATORS, clock=clock)
    service = PeopleService(repo, clock)
    verifier = PeopleTokenVerifier(
        JwksCache(down, clock), issuer=LOCAL_ISSUER, audience=LOCAL_AUDIENCE, clock=clock
    )
    app = create_app(
        dispatcher, internal_token=TOKEN, people=PeopleApi(verifier=verifier, service=service)
    )
    ring = KeyRing(clock)
    ring.bootstrap(PrivateKeySigner.generate())
    token = await issue_person_token(ring, "ada", clock)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://trace.test"
    ) as client:
        answer = await client.get("/v1/me", headers={"Authorization": f"Bearer {token}"})
    assert (answer.status_code, answer.json()["error"]) == (503, "unavailable")
