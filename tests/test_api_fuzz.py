"""No request produces a 5xx: the OpenAPI document fuzzed with schemathesis.

Every operation of ``/openapi.json`` gets positive (schema-valid) and
negative (schema-violating) cases, on a deployed small DAG, on both engines.
Generated identifiers are swapped for real ones part of the time (task ids,
their lease tokens, dataset versions, streams, DAG and job names), so the
fuzz reaches claims, stale and duplicate reports and event acceptance, not
only "not found". The task-scoped routes (``/v1/task/*``) are mounted with
a verifier, a minter and a buffer; their cases carry the capability token of
the task they name, another task's token, garbage or none. Checks: no 5xx,
and the answer matches the documented response schema for its status.

The app and its database live on one event loop (a blocking portal this test
owns); schemathesis loads the schema from the ASGI app, generates the cases
and validates the answers, and the requests go through httpx's ASGI
transport on that loop.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import schemathesis
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import response_schema_conformance

from tests.api_fixtures import AUTH, DAG, DOWNSTREAM, OPERATORS, STREAM, TOKEN
from tests.capability_fixtures import HEADER, make_kit
from trace_core.api import ApiConfig, create_app
from trace_core.clock import ManualClock
from trace_core.dag import parse_dag
from trace_core.dispatcher.service import Dispatcher
from trace_core.storage.sql import SqlRepository

EXAMPLES = 25
"""Cases per operation and generation mode."""
BASE = "http://trace.test"
CHECKS = [not_a_server_error, response_schema_conformance]


@dataclass
class World:
    """The app on a deployed DAG with tasks in every state, and real identifiers."""

    repo: SqlRepository
    app: Any
    client: httpx.AsyncClient
    task_ids: list[str] = field(default_factory=list)
    leases: dict[str, tuple[int, str]] = field(default_factory=dict)
    datasets: list[tuple[str, str]] = field(default_factory=list)
    capabilities: dict[str, str] = field(default_factory=dict)
    """task id -> the capability token of its claimed attempt."""

    @classmethod
    async def create(cls, database_url: str) -> World:
        repo = SqlRepository(database_url)
        kit = make_kit(ManualClock())
        dispatcher = Dispatcher(
            repo, operators=OPERATORS, clock=kit.clock, capabilities=kit.issuer(repo)
        )
        deployed = await dispatcher.deploy(parse_dag(DAG, operators=OPERATORS.names()))
        # Short long-polls: a fuzzed claim that finds nothing must not wait 20 s.
        config = ApiConfig(max_wait_ms=50, claim_recheck_seconds=0.05)
        app = create_app(
            dispatcher,
            internal_token=TOKEN,
            config=config,
            jwks=kit.ring.jwks,
            verifier=kit.verifier,
            minter=kit.minter,
            buffer=kit.buffer,
        )
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE)
        world = cls(repo, app, client)
        world.datasets = [
            (str(v.dataset_uuid), str(v.dataset_version)) for v in deployed.datasets.values()
        ]
        for i in range(6):
            run = await dispatcher.manual.create_task("api/follow", f"fuzz-{i}")
            assert run.task_id is not None
            world.task_ids.append(str(run.task_id))
        for task_id in world.task_ids[:4]:  # Running, with known leases
            claimed = await dispatcher.control.claim(uuid.UUID(task_id), "fuzz-seed")
            lease = claimed.outcome.lease
            assert lease is not None and claimed.task is not None
            world.leases[task_id] = (lease.attempt, str(lease.lease_token))
            world.capabilities[task_id] = claimed.task["capability_token"]
        await dispatcher.tasks.cancel([uuid.UUID(world.task_ids[3])])
        return world

    async def send(self, request: dict[str, Any]) -> httpx.Response:
        """Send a serialized schemathesis case (``requests`` keyword shape)."""
        content: bytes | None = None
        if "json" in request:
            content = json.dumps(request["json"]).encode()
        elif request.get("data") is not None:
            data = request["data"]
            content = data.encode() if isinstance(data, str) else bytes(data)
        return await self.client.request(
            request["method"],
            request["url"],
            params=request.get("params"),
            headers=request.get("headers"),
            content=content,
        )

    async def close(self) -> None:
        await self.client.aclose()
        await self.repo.close()

    def realistic(self, case: Any, draw: Callable[[st.SearchStrategy[Any]], Any]) -> dict[str, str]:
        """Swap generated identifiers for real ones, part of the time; the headers."""
        if isinstance(case.query, dict):
            self._swap(case.query, draw)
        if isinstance(case.body, dict):
            self._swap(case.body, draw)
            result = case.body.get("result")
            if isinstance(result, dict):
                self._swap(result, draw)
        headers = dict(AUTH)
        if case.operation.path.startswith("/v1/task/"):
            choice = draw(st.sampled_from(["own", "own", "own", "other", "garbage", "none"]))
            if choice == "own":
                # The token of a claimed task, and (usually) a body naming that attempt.
                task_id = draw(st.sampled_from(sorted(self.capabilities)))
                headers[HEADER] = self.capabilities[task_id]
                if isinstance(case.body, dict) and draw(st.integers(0, 3)):
                    attempt, lease_token = self.leases[task_id]
                    case.body["task_id"], case.body["attempt"] = task_id, attempt
                    if "lease_token" in case.body or draw(st.booleans()):
                        case.body["lease_token"] = lease_token
            elif choice == "other":
                headers[HEADER] = draw(st.sampled_from(sorted(self.capabilities.values())))
            elif choice == "garbage":
                headers[HEADER] = draw(
                    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E))
                )
        return headers

    def _swap(self, doc: dict[str, Any], draw: Callable[[st.SearchStrategy[Any]], Any]) -> None:
        for key in ("task_id", "job_id"):
            if key in doc and draw(st.booleans()):
                task_id = draw(st.sampled_from(self.task_ids))
                doc[key] = task_id
                if task_id in self.leases and draw(st.booleans()):
                    attempt, token = self.leases[task_id]
                    for name, value in (("attempt", attempt), ("attempt_id", attempt)):
                        if name in doc:
                            doc[name] = value
                    if "lease_token" in doc:
                        doc["lease_token"] = token
        if isinstance(doc.get("streams"), list) and draw(st.booleans()):
            doc["streams"] = draw(st.permutations([STREAM, DOWNSTREAM]))
        if "dag" in doc and draw(st.booleans()):
            doc["dag"], doc["job"] = "api", draw(st.sampled_from(["follow", "double"]))
        if "job" in doc and "key" in doc and draw(st.booleans()):
            doc["job"] = draw(st.sampled_from(["api/follow", "follow", "double"]))
        if "records" in doc and "dataset_uuid" in doc and draw(st.booleans()):
            doc["dataset_uuid"] = draw(st.sampled_from(self.datasets))[0]
        events = doc.get("events")
        if isinstance(events, list):
            for event in events:
                if isinstance(event, dict) and draw(st.booleans()):
                    event["dataset_uuid"], event["dataset_version"] = draw(
                        st.sampled_from(self.datasets)
                    )


def _fuzz(operation: Any, mode: GenerationMode, world: World, portal: BlockingPortal) -> None:
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode), data=st.data())
    def run(case: Any, data: st.DataObject) -> None:
        headers = world.realistic(case, data.draw)
        request = case.as_transport_kwargs(base_url=BASE, headers=headers)
        response = portal.call(world.send, request)
        case.validate_response(response, checks=CHECKS, headers=headers)

    run()


def test_no_request_produces_a_server_error(database_url: str) -> None:
    with start_blocking_portal() as portal:
        world = portal.call(World.create, database_url)
        try:
            schema = schemathesis.openapi.from_asgi("/openapi.json", world.app)
            operations = []
            for result in schema.get_all_operations():
                assert isinstance(result, Ok), result  # the document itself is valid
                operations.append(result.ok())
            assert len(operations) == 25  # 16 internal, 2 health, 7 task-scoped
            for operation in operations:
                for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                    _fuzz(operation, mode, world, portal)
        finally:
            portal.call(world.close)


@pytest.mark.parametrize("engine", ["sqlite"])
def test_the_document_declares_400_not_422_and_the_bearer_scheme(database_url: str) -> None:
    with start_blocking_portal() as portal:
        world = portal.call(World.create, database_url)
        try:
            document = world.app.openapi()
        finally:
            portal.call(world.close)
    assert document["components"]["securitySchemes"]["internalBearer"]["scheme"] == "bearer"
    for path, item in document["paths"].items():
        for method, operation in item.items():
            assert "422" not in operation["responses"], (method, path)
            assert {"400", "401", "413", "503"} <= set(operation["responses"]), (method, path)
            scheme = "taskCapability" if path.startswith("/v1/task/") else "internalBearer"
            assert operation["security"] == [{scheme: []}]
