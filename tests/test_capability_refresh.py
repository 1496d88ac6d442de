"""Capability tokens renewed for attempts that outlive them, on both engines.

A capability token lasts ``TTL`` seconds; an always-on source holds its lease
far longer. The fenced heartbeat answers with a renewed token (same task,
attempt and grants; new jti/iat/nbf/exp) once less than a third of the
presented token's lifetime is left, and the worker wrapper swaps it into the
task context with credentials minted from it. All on the injected clock: the
operators below move it themselves, and every ``ctx.directive()`` is a
heartbeat because the clock moved past the directive's freshness.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.capability_fixtures import (
    AUDIENCE,
    CAPS_DAG,
    CAPS_OPERATORS,
    HEADER,
    ISSUER,
    LEEWAY,
    TTL,
    Kit,
    make_kit,
)
from tests.test_worker_wrapper import no_heartbeat
from trace_core.api import create_app
from trace_core.authoring.context import OperatorResult, TaskContext
from trace_core.authoring.operators import OperatorRegistry, OperatorSpec
from trace_core.clock import ManualClock
from trace_core.dag import DeployResult, parse_dag
from trace_core.dispatcher.capabilities import CapabilityIssuer
from trace_core.dispatcher.inprocess_client import InProcessClient
from trace_core.dispatcher.service import Dispatcher
from trace_core.errors import ConfigurationError, InvalidInput, StaleClaim
from trace_core.model import Fence
from trace_core.security import (
    InvalidCapability,
    KeyRing,
    PrivateKeySigner,
    RotationPolicy,
    TokenIssuer,
    TokenVerifier,
)
from trace_core.security.claims import CapabilityClaims
from trace_core.storage.sql import SqlRepository
from trace_core.worker import (
    COMPLETED,
    ClaimResult,
    ControlPlaneClient,
    CredentialSource,
    HttpControlPlaneClient,
    HttpCredentialSource,
    WorkerWrapper,
)
from trace_lite.credentials import CredentialBroker
from trace_lite.object_store import LocalObjectStore

pytestmark = pytest.mark.anyio

TOKEN = "refresh-test-internal-token-0123456789"
BASE = "http://trace.test"
STEP = 50.0
"""Seconds between heartbeats: under the ``follow`` job's 60 s lease."""
DUE_AFTER = TTL * 2 / 3
"""A token is renewed once less than a third of its lifetime is left."""


@dataclass
class Refreshing:
    """A Dispatcher that issues and renews capabilities, with both worker clients."""

    dispatcher: Dispatcher
    deployed: DeployResult
    kit: Kit
    http: httpx.AsyncClient

    @property
    def clock(self) -> ManualClock:
        return self.kit.clock

    def client(self, kind: str) -> ControlPlaneClient:
        """The worker's client: calling the Dispatcher directly, or over HTTP."""
        if kind == "in-process":
            return InProcessClient(self.dispatcher.control)
        return HttpControlPlaneClient(BASE, TOKEN, http=self.http)

    def credentials(self, kind: str) -> CredentialSource:
        """How each kind of worker gets its scoped credentials from a token."""
        if kind == "in-process":
            return CredentialBroker(self.kit.verifier, self.kit.minter)
        return HttpCredentialSource(BASE, self.http)

    async def task(self, key: str = "k1") -> uuid.UUID:
        run = await self.dispatcher.manual.create_task("caps/follow", key)
        assert run.task_id is not None
        return run.task_id

    async def claimed(self, client: ControlPlaneClient) -> tuple[ClaimResult, uuid.UUID, str]:
        """A new task claimed through ``client``: the claim, its lease token and
        the capability token it carried."""
        claim = await client.claim(await self.task(), "w1")
        assert claim.task is not None and claim.lease_token is not None
        return claim, claim.lease_token, str(claim.task["capability_token"])

    async def verify(self, token: str, task_id: uuid.UUID, attempt: int = 1) -> CapabilityClaims:
        return await self.kit.verifier.verify_for_task(token, task_id, attempt)


@pytest.fixture
async def refreshing(repo: SqlRepository, clock: ManualClock) -> AsyncIterator[Refreshing]:
    kit = make_kit(clock)
    capabilities = CapabilityIssuer(kit.tokens, repo=repo, verifier=kit.verifier)
    dispatcher = Dispatcher(repo, operators=CAPS_OPERATORS, clock=clock, capabilities=capabilities)
    deployed = await dispatcher.deploy(parse_dag(CAPS_DAG, operators=CAPS_OPERATORS.names()))
    app = create_app(
        dispatcher,
        internal_token=TOKEN,
        jwks=kit.ring.jwks,
        verifier=kit.verifier,
        minter=kit.minter,
    )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE) as http:
        yield Refreshing(dispatcher, deployed, kit, http)


KINDS = pytest.mark.parametrize("kind", ["in-process", "http"])


# --- the heartbeat ------------------------------------------------------------


@KINDS
async def test_a_heartbeat_renews_the_token_once_a_third_of_its_life_is_left(
    refreshing: Refreshing, kind: str
) -> None:
    client = refreshing.client(kind)
    claim, lease_token, first = await refreshing.claimed(client)
    task_id = claim.task_id
    original = await refreshing.verify(first, task_id)

    fresh = await client.heartbeat(Fence(task_id, 1, lease_token), first)
    assert fresh.capability_token is None  # a fresh token is not renewed
    beat, elapsed = fresh, 0.0
    while beat.capability_token is None:
        assert elapsed <= DUE_AFTER, "no renewal although the token was due"
        refreshing.clock.advance(STEP)
        elapsed += STEP
        beat = await client.heartbeat(Fence(task_id, 1, lease_token), first)
    assert elapsed > DUE_AFTER - STEP  # not renewed while two thirds were left

    renewed = await refreshing.verify(beat.capability_token, task_id)
    assert (renewed.inputs, renewed.output_prefixes, renewed.scratch_prefix) == (
        original.inputs,
        original.output_prefixes,
        original.scratch_prefix,
    )
    assert (renewed.iss, renewed.aud, renewed.sub) == (original.iss, original.aud, original.sub)
    assert renewed.jti != original.jti
    now = int(refreshing.clock.now().timestamp())
    assert (renewed.iat, renewed.nbf, renewed.exp) == (now, now, now + TTL)


@KINDS
async def test_the_old_token_is_refused_after_its_expiry_and_the_renewed_one_is_not(
    refreshing: Refreshing, kind: str
) -> None:
    client = refreshing.client(kind)
    claim, lease_token, first = await refreshing.claimed(client)
    task_id, current = claim.task_id, first
    renewals = 0
    for _ in range(int((TTL + LEEWAY) / STEP) + 1):  # past the first token's expiry
        refreshing.clock.advance(STEP)
        beat = await client.heartbeat(Fence(task_id, 1, lease_token), current)
        if beat.capability_token is not None:
            current, renewals = beat.capability_token, renewals + 1
    assert renewals >= 1
    with pytest.raises(InvalidCapability) as refused:
        await refreshing.verify(first, task_id)
    assert refused.value.reason == "expired"
    await refreshing.verify(current, task_id)
    # The task-scoped API agrees: the old token is refused, the renewed one works.
    body = {"task_id": str(task_id), "attempt": 1, "lease_token": str(lease_token)}
    old = await refreshing.http.post("/v1/task/heartbeat", json=body, headers={HEADER: first})
    assert old.status_code == 401 and old.json()["reason"] == "expired"
    new = await refreshing.http.post("/v1/task/heartbeat", json=body, headers={HEADER: current})
    assert new.status_code == 200, new.text


async def test_the_task_scoped_heartbeat_renews_its_header_token(refreshing: Refreshing) -> None:
    task_id = await refreshing.task()
    claimed = await refreshing.dispatcher.control.claim(task_id, "w1")
    assert claimed.task is not None and claimed.outcome.lease is not None
    token = str(claimed.task["capability_token"])
    body = {
        "task_id": str(task_id),
        "attempt": 1,
        "lease_token": str(claimed.outcome.lease.lease_token),
    }
    fresh = await refreshing.http.post("/v1/task/heartbeat", json=body, headers={HEADER: token})
    assert fresh.status_code == 200 and fresh.json()["capability_token"] is None
    for _ in range(int(DUE_AFTER / STEP) + 1):
        refreshing.clock.advance(STEP)
        due = await refreshing.http.post("/v1/task/heartbeat", json=body, headers={HEADER: token})
        assert due.status_code == 200, due.text
    renewed = due.json()["capability_token"]
    assert renewed and renewed != token
    assert (await refreshing.verify(renewed, task_id)).scratch_prefix == (
        await refreshing.verify(token, task_id)
    ).scratch_prefix
    # The body of the task-scoped route has no token field: the header is the token.
    extra = await refreshing.http.post(
        "/v1/task/heartbeat", json={**body, "capability_token": token}, headers={HEADER: token}
    )
    assert extra.status_code == 400 and extra.json()["field"] == "capability_token"


@KINDS
async def test_a_stale_attempt_gets_its_409_and_no_token(refreshing: Refreshing, kind: str) -> None:
    client = refreshing.client(kind)
    dispatcher, clock = refreshing.dispatcher, refreshing.clock
    first, first_lease, old_token = await refreshing.claimed(client)
    task_id = first.task_id
    for _ in range(int(DUE_AFTER / STEP)):  # the first attempt's token becomes due
        clock.advance(STEP)
        await client.heartbeat(Fence(task_id, 1, first_lease))
    clock.advance(61)  # its lease lapses; the reaper fails it, a retry claims again
    await dispatcher.reaper.run_once()
    second = None
    while second is None or not second.claimed:
        assert clock.now().timestamp() < (await refreshing.verify(old_token, task_id)).exp
        clock.advance(10)
        await dispatcher.retries.run_once()
        second = await client.claim(task_id, "w2")
    assert second.attempt == 2 and second.lease_token is not None

    # The old attempt, presenting its still valid and due token: refused, nothing issued.
    with pytest.raises(StaleClaim):
        await client.heartbeat(Fence(task_id, 1, first_lease), old_token)
    answer = await refreshing.http.post(
        "/internal/heartbeat",
        json={
            "task_id": str(task_id),
            "attempt": 1,
            "lease_token": str(first_lease),
            "capability_token": old_token,
        },
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert answer.status_code == 409 and answer.json()["error"] == "stale"
    assert "capability_token" not in answer.json()
    # The current holder presenting the old attempt's token gets no renewal either.
    beat = await client.heartbeat(Fence(task_id, 2, second.lease_token), old_token)
    assert beat.capability_token is None


async def test_a_heartbeat_without_a_token_is_answered_without_one(
    refreshing: Refreshing,
) -> None:
    task_id = await refreshing.task()
    client = refreshing.client("http")
    claim = await client.claim(task_id, "w1")
    assert claim.lease_token is not None
    refreshing.clock.advance(DUE_AFTER + STEP / 2)
    beat = await client.heartbeat(Fence(task_id, 1, claim.lease_token))
    assert beat.capability_token is None


async def test_the_openapi_document_describes_the_renewal(refreshing: Refreshing) -> None:
    schemas = (await refreshing.http.get("/openapi.json")).json()["components"]["schemas"]
    assert (
        "renewed one"
        in schemas["HeartbeatRequest"]["properties"]["capability_token"]["description"]
    )
    assert "capability_token" in schemas["HeartbeatResponse"]["properties"]
    assert "capability_token" not in schemas["TaskHeartbeatRequest"]["properties"]


def test_the_refresh_fraction_is_checked(clock: ManualClock) -> None:
    tokens = make_kit(clock).tokens
    for fraction in (0.0, 1.0, -0.5):
        with pytest.raises(ConfigurationError, match="refresh_fraction"):
            CapabilityIssuer(tokens, refresh_fraction=fraction)


async def test_a_larger_refresh_fraction_renews_earlier(clock: ManualClock) -> None:
    kit = make_kit(clock)
    tokens = TokenIssuer(kit.ring, ISSUER, AUDIENCE, TTL, clock)
    early = CapabilityIssuer(
        tokens,
        scratch_template="s3://trace-lite/scratch/{task_id}/{attempt}/",
        verifier=kit.verifier,
        refresh_fraction=0.9,
    )
    task_id = uuid.uuid4()
    token = await tokens.issue(task_id, 1, (), (), f"s3://trace-lite/scratch/{task_id}/1/")
    assert await early.refresh(token, task_id, 1) is None
    clock.advance(TTL * 0.1 + 1)
    assert await early.refresh(token, task_id, 1) is not None
    assert await early.refresh(token, task_id, 2) is None  # another attempt's token


class FlakySigner:
    """A signer whose backend can go down (``down = True``) and come back."""

    def __init__(self) -> None:
        self.inner = PrivateKeySigner.generate()
        self.kid = self.inner.kid
        self.down = False

    async def sign(self, message: bytes) -> bytes:
        if self.down:
            raise RuntimeError("signing service unavailable")
        return await self.inner.sign(message)

    def public_jwk(self) -> dict[str, str]:
        return self.inner.public_jwk()


async def test_a_signer_outage_during_renewal_keeps_the_lease_and_retries(
    repo: SqlRepository, clock: ManualClock
) -> None:
    signer = FlakySigner()
    ring = KeyRing(clock, RotationPolicy(verifier_cache_seconds=300, max_token_ttl_seconds=3600))
    ring.bootstrap(signer)
    verifier = TokenVerifier(ring, ISSUER, AUDIENCE, clock, leeway_seconds=LEEWAY)
    tokens = TokenIssuer(signer, ISSUER, AUDIENCE, TTL, clock)
    dispatcher = Dispatcher(
        repo,
        operators=CAPS_OPERATORS,
        clock=clock,
        capabilities=CapabilityIssuer(tokens, repo=repo, verifier=verifier),
    )
    await dispatcher.deploy(parse_dag(CAPS_DAG, operators=CAPS_OPERATORS.names()))
    run = await dispatcher.manual.create_task("caps/follow", "k1")
    assert run.task_id is not None
    client = InProcessClient(dispatcher.control)
    claim = await client.claim(run.task_id, "w1")
    assert claim.task is not None and claim.lease_token is not None
    token = str(claim.task["capability_token"])
    for _ in range(int(DUE_AFTER / STEP) + 1):
        clock.advance(STEP)
        await client.heartbeat(Fence(run.task_id, 1, claim.lease_token))
    signer.down = True
    beat = await client.heartbeat(Fence(run.task_id, 1, claim.lease_token), token)
    assert beat.capability_token is None  # the lease was extended all the same
    assert beat.expires_at > clock.now()
    signer.down = False
    beat = await client.heartbeat(Fence(run.task_id, 1, claim.lease_token), token)
    assert beat.capability_token is not None
    await verifier.verify_for_task(beat.capability_token, run.task_id, 1)


# --- the wrapper: a long attempt keeps its data access -------------------------


@KINDS
async def test_a_long_running_source_keeps_opening_the_object_store(
    refreshing: Refreshing, kind: str, tmp_path: Path
) -> None:
    store = LocalObjectStore(tmp_path / "objects", refreshing.kit.minter)
    steps = int(4000 / STEP)  # past the first credentials' hour, and the first token's TTL
    seen: dict[str, Any] = {"tokens": [], "written": []}

    async def follow(ctx: TaskContext) -> OperatorResult:
        seen["first_credentials"] = dict(ctx.credentials)
        prefix = ctx.outputs[0]["location"]
        for step in range(steps):
            refreshing.clock.advance(STEP)
            assert await ctx.directive() == "run"  # a heartbeat: the clock moved
            uri = f"{prefix}part-{step:04d}"
            # As the lite operators do: a handle from the context's credentials.
            store.handle_for(ctx.credentials).put(uri, b"%d" % step)
            seen["tokens"].append(ctx.capability_token)
            seen["written"].append(uri)
        return OperatorResult()

    wrapper = WorkerWrapper(
        refreshing.client(kind),
        OperatorRegistry([OperatorSpec("follow", follow, source=True)]),
        worker_id="long",
        credentials=refreshing.credentials(kind),
        clock=refreshing.clock,
        sleep=no_heartbeat,
    )
    task_id = await refreshing.task()
    assert await wrapper.handle_wakeup(task_id) == COMPLETED
    assert len(seen["written"]) == steps

    tokens: list[str] = seen["tokens"]
    distinct = list(dict.fromkeys(tokens))
    assert len(distinct) >= int(steps * STEP / TTL)  # renewed about every 2/3 of a TTL
    for token in distinct[:-2]:  # the early ones have expired...
        with pytest.raises(InvalidCapability):
            await refreshing.verify(token, task_id)
    await refreshing.verify(distinct[-1], task_id)  # ...the last one has not
    # Every put succeeded (an AccessDenied or expired set would have failed the
    # attempt), the last ones long after the first credentials expired.
    with pytest.raises(InvalidInput):
        store.handle_for(seen["first_credentials"])
    assert len(list((tmp_path / "objects").rglob("part-*"))) == steps
