"""Capability tokens issued at claim time, on both engines.

What a claimed attempt's token grants is derived from its payload: every
pinned input with its location (tables included, for the Query Service),
one output prefix per S3 output, and a scratch prefix of the attempt's own.
A token that cannot be issued fails the fresh attempt instead of letting a
worker run it unauthorized.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import sqlalchemy as sa

from tests.capability_fixtures import CAPS_DAG, CAPS_OPERATORS, Kit, make_kit
from trace_core.authoring.events import DatasetEvent
from trace_core.clock import ManualClock
from trace_core.dag import DeployResult, parse_dag
from trace_core.dispatcher.capabilities import DEFAULT_SCRATCH_TEMPLATE, CapabilityIssuer
from trace_core.dispatcher.service import Dispatcher
from trace_core.errors import ConfigurationError, InvalidInput
from trace_core.model import NotClaimedReason
from trace_core.security import InvalidCapability, PrivateKeySigner, TokenIssuer
from trace_core.storage import schema
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio

EXPIRE = 3600.0  # past any lease of the DAG's jobs
BACKOFF = 3600.0  # past any retry backoff


class Platform:
    """A Dispatcher issuing capabilities, with the capability DAG deployed."""

    def __init__(self, dispatcher: Dispatcher, deployed: DeployResult, kit: Kit) -> None:
        self.dispatcher = dispatcher
        self.deployed = deployed
        self.kit = kit

    def location(self, dataset: str) -> str:
        """The storage location of ``dataset``'s deployed version."""
        pointer = self.deployed.datasets[dataset]
        if dataset in ("alerts", "flags"):
            table = f"dataset_{pointer.dataset_uuid.hex}_{pointer.dataset_version.hex[:8]}"
            return f"postgres_table:{table}"
        return (
            f"s3://trace-lite/default/dataset/{pointer.dataset_uuid}"
            f"/version/{pointer.dataset_version}/"
        )

    async def source_task(self, key: str = "k1") -> uuid.UUID:
        run = await self.dispatcher.manual.create_task("caps/follow", key)
        assert run.task_id is not None
        return run.task_id

    async def enrich_task(self) -> uuid.UUID:
        """A task of ``enrich``, routed from an event on ``blocks``."""
        source = await self.source_task("feeder")
        claimed = await self.dispatcher.control.claim(source, "feeder")
        assert claimed.outcome.lease is not None
        blocks = self.deployed.datasets["blocks"]
        event = DatasetEvent(blocks.dataset_uuid, blocks.dataset_version, cursor=7)
        await self.dispatcher.control.emit(source, 1, [event])
        await self.dispatcher.run_once()
        t = schema.tasks
        async with self.dispatcher.repo.read() as tx:
            found = (
                await tx.connection.execute(
                    sa.select(t.c.id).where(t.c.job_id == self.deployed.jobs["enrich"])
                )
            ).scalar_one()
        assert isinstance(found, uuid.UUID)
        return found

    async def reclaim(self, task_id: uuid.UUID) -> dict[str, Any]:
        """Let the current attempt's lease expire, retry the task and claim again."""
        self.kit.clock.advance(EXPIRE)
        await self.dispatcher.reaper.run_once()
        self.kit.clock.advance(BACKOFF)
        await self.dispatcher.retries.run_once()
        claimed = await self.dispatcher.control.claim(task_id, "worker-2")
        assert claimed.task is not None, claimed.outcome
        return claimed.task


async def _platform(repo: SqlRepository, clock: ManualClock, **issuer: Any) -> Platform:
    kit = make_kit(clock)
    capabilities = CapabilityIssuer(kit.tokens, repo=repo, **issuer)
    dispatcher = Dispatcher(repo, operators=CAPS_OPERATORS, clock=clock, capabilities=capabilities)
    deployed = await dispatcher.deploy(parse_dag(CAPS_DAG, operators=CAPS_OPERATORS.names()))
    return Platform(dispatcher, deployed, kit)


@pytest.fixture
async def platform(repo: SqlRepository, clock: ManualClock) -> Platform:
    return await _platform(repo, clock)


# --- the payload ----------------------------------------------------------------


async def test_payload_inputs_carry_their_versions_location(platform: Platform) -> None:
    task_id = await platform.enrich_task()
    payload = await platform.dispatcher.control.fetch(task_id)
    blocks, alerts = platform.deployed.datasets["blocks"], platform.deployed.datasets["alerts"]
    assert [
        (i["dataset_uuid"], i["dataset_version"], i["location"]) for i in payload["inputs"]
    ] == [
        (str(blocks.dataset_uuid), str(blocks.dataset_version), platform.location("blocks")),
        (str(alerts.dataset_uuid), str(alerts.dataset_version), platform.location("alerts")),
    ]
    assert payload["inputs"][0]["where"] == "number > 10"
    assert payload["inputs"][0]["cursor"] == "7"  # the unit of work stays
    assert "capability_token" not in payload  # only a claim issues one


# --- tokens at claim time -------------------------------------------------------


async def test_a_claim_carries_a_token_for_its_attempt(platform: Platform) -> None:
    task_id = await platform.enrich_task()
    claimed = await platform.dispatcher.control.claim(task_id, "worker-1")
    assert claimed.outcome.lease is not None and claimed.task is not None
    token = claimed.task["capability_token"]
    claims = await platform.kit.verifier.verify_for_task(token, task_id, 1)
    blocks, alerts = platform.deployed.datasets["blocks"], platform.deployed.datasets["alerts"]
    assert [(i.dataset_uuid, i.dataset_version, i.location, i.where) for i in claims.inputs] == [
        (blocks.dataset_uuid, blocks.dataset_version, platform.location("blocks"), "number > 10"),
        (alerts.dataset_uuid, alerts.dataset_version, platform.location("alerts"), None),
    ]
    # The Postgres output ('flags') is written through the buffer: no prefix.
    assert claims.output_prefixes == (platform.location("enriched"),)
    assert claims.scratch_prefix == f"s3://trace-lite/default/scratch/{task_id}/1/"
    # The table input is for the Query Service; S3 credentials never cover it.
    assert claims.scope().as_dict() == {
        "read": sorted([platform.location("blocks"), claims.scratch_prefix]),
        "write": sorted([platform.location("enriched"), claims.scratch_prefix]),
    }


async def test_a_multi_output_task_gets_one_prefix_per_s3_output(platform: Platform) -> None:
    task_id = await platform.source_task()
    claimed = await platform.dispatcher.control.claim(task_id, "worker-1")
    assert claimed.task is not None
    claims = await platform.kit.verifier.verify(claimed.task["capability_token"])
    assert claims.inputs == ()
    assert claims.output_prefixes == (platform.location("blocks"), platform.location("logs"))


async def test_a_reclaimed_attempt_gets_a_new_token_and_scratch(platform: Platform) -> None:
    task_id = await platform.source_task()
    first = await platform.dispatcher.control.claim(task_id, "worker-1")
    assert first.task is not None
    old = first.task["capability_token"]
    second = await platform.reclaim(task_id)
    assert second["attempt"] == 2
    claims = await platform.kit.verifier.verify_for_task(second["capability_token"], task_id, 2)
    assert claims.scratch_prefix == f"s3://trace-lite/default/scratch/{task_id}/2/"
    with pytest.raises(InvalidCapability) as caught:
        await platform.kit.verifier.verify_for_task(old, task_id, 2)
    assert caught.value.reason in ("wrong_task", "expired")


async def test_a_refused_claim_issues_nothing(platform: Platform) -> None:
    task_id = await platform.source_task()
    assert (await platform.dispatcher.control.claim(task_id, "worker-1")).task is not None
    again = await platform.dispatcher.control.claim(task_id, "worker-2")
    assert again.task is None and again.outcome.reason is NotClaimedReason.ALREADY_RUNNING


async def test_an_ungrantable_payload_fails_the_attempt_for_good(
    repo: SqlRepository, clock: ManualClock
) -> None:
    # A token over the size verifiers accept would be refused at every try:
    # the attempt is failed terminally, not retried.
    kit = make_kit(clock)
    tiny = TokenIssuer(kit.ring, "trace-test", "trace-task", 600, clock, max_token_bytes=256)
    dispatcher = Dispatcher(
        repo,
        operators=CAPS_OPERATORS,
        clock=clock,
        capabilities=CapabilityIssuer(tiny, repo=repo),
    )
    deployed = await dispatcher.deploy(parse_dag(CAPS_DAG, operators=CAPS_OPERATORS.names()))
    task_id = await Platform(dispatcher, deployed, kit).source_task()
    claimed = await dispatcher.control.claim(task_id, "worker-1")
    assert claimed.task is None and claimed.outcome.lease is None
    assert claimed.outcome.reason is NotClaimedReason.DEAD_LETTERED
    state = await dispatcher.tasks.leases.inspect(task_id)
    assert state.retry_at is None and state.status != "Running"
    assert state.last_error is not None and "capability token not issued" in state.last_error
    again = await dispatcher.control.claim(task_id, "worker-2")
    assert again.task is None


class BrokenSigner:
    """A signer whose backend (KMS, say) is down."""

    def __init__(self) -> None:
        self.inner = PrivateKeySigner.generate()
        self.kid = self.inner.kid

    async def sign(self, message: bytes) -> bytes:
        raise RuntimeError("signing service unavailable")

    def public_jwk(self) -> dict[str, str]:
        return self.inner.public_jwk()


async def test_a_signer_outage_fails_the_attempt_with_a_retry(
    repo: SqlRepository, clock: ManualClock
) -> None:
    kit = make_kit(clock)
    broken = TokenIssuer(BrokenSigner(), "trace-test", "trace-task", 600, clock)
    dispatcher = Dispatcher(
        repo,
        operators=CAPS_OPERATORS,
        clock=clock,
        capabilities=CapabilityIssuer(broken, repo=repo),
    )
    deployed = await dispatcher.deploy(parse_dag(CAPS_DAG, operators=CAPS_OPERATORS.names()))
    platform = Platform(dispatcher, deployed, kit)
    task_id = await platform.source_task()
    claimed = await dispatcher.control.claim(task_id, "worker-1")
    assert claimed.task is None and claimed.outcome.reason is NotClaimedReason.NOT_READY
    state = await dispatcher.tasks.leases.inspect(task_id)
    assert state.attempt == 1 and state.retry_at is not None
    assert state.last_error is not None and "signing service unavailable" in state.last_error


async def test_without_an_issuer_a_claim_carries_no_token(
    repo: SqlRepository, clock: ManualClock
) -> None:
    dispatcher = Dispatcher(repo, operators=CAPS_OPERATORS, clock=clock)
    await dispatcher.deploy(parse_dag(CAPS_DAG, operators=CAPS_OPERATORS.names()))
    run = await dispatcher.manual.create_task("caps/follow", "k1")
    assert run.task_id is not None
    claimed = await dispatcher.control.claim(run.task_id, "worker-1")
    assert claimed.task is not None and "capability_token" not in claimed.task


# --- grants from a payload (no database) ----------------------------------------

TASK = uuid.UUID("6f1d7c1e-2a4b-4c6d-8e0f-1a2b3c4d5e6f")
JOB = uuid.UUID("0a0b0c0d-1e1f-4a2b-8c3d-4e5f6a7b8c9d")
DS = uuid.UUID("11111111-2222-4333-8444-555555555555")
VER = uuid.UUID("66666666-7777-4888-9999-aaaaaaaaaaaa")


def _payload(**changes: Any) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "task_id": str(TASK),
        "attempt": 3,
        "job": {"id": str(JOB)},
        "inputs": [
            {
                "dataset_uuid": str(DS),
                "dataset_version": str(VER),
                "where": None,
                "location": "s3://trace-data/in/",
            }
        ],
        "outputs": [
            {"output_index": 0, "location": "s3://trace-data/out/a/"},
            {"output_index": 1, "location": "postgres_table:dataset_x"},
            {"output_index": 2, "location": None},
            {"output_index": 3, "location": "s3://trace-data/out/a/"},
        ],
    }
    payload.update(changes)
    return payload


def _issuer(template: str = "s3://trace-scratch/{task_id}/{attempt}/") -> CapabilityIssuer:
    return CapabilityIssuer(make_kit(ManualClock()).tokens, scratch_template=template)


async def test_grants_follow_the_payload() -> None:
    grants = await _issuer().grants_for(_payload())
    assert grants.task_id == TASK and grants.attempt == 3
    assert [i.location for i in grants.inputs] == ["s3://trace-data/in/"]
    # Tables and version-less outputs get no prefix; a repeated one is granted once.
    assert grants.output_prefixes == ("s3://trace-data/out/a/",)
    assert grants.scratch_prefix == f"s3://trace-scratch/{TASK}/3/"


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"task_id": "nope"}, "task_id"),
        ({"attempt": 0}, "attempt"),
        ({"attempt": "3"}, "attempt"),
        (
            {"inputs": [{"dataset_uuid": str(DS), "dataset_version": str(VER), "location": None}]},
            "inputs[0].location",
        ),
        (
            {
                "inputs": [
                    {
                        "dataset_uuid": str(DS),
                        "dataset_version": str(VER),
                        "location": "s3://trace-data/a/../b/",
                    }
                ]
            },
            "inputs[0].location",
        ),
        ({"inputs": ["not an object"]}, "inputs[0]"),
        ({"outputs": [{"location": "s3://trace-data/out/*"}]}, "outputs[0].location"),
        ({"outputs": [{"location": "file:///tmp/out/"}]}, "outputs[0].location"),
    ],
)
async def test_an_ungrantable_payload_names_the_field(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        await _issuer().grants_for(_payload(**changes))
    assert caught.value.field == field


@pytest.mark.parametrize(
    "template",
    [
        "s3://trace-scratch/{task_id}/",  # every attempt needs its own scratch
        "s3://trace-scratch/{attempt}/",
        "s3://trace-scratch/{task_id}/{attempt}/{user}/",
        "s3://trace-scratch/{task_id!r}/{attempt}/",
        "s3://trace-scratch/{task_id:>40}/{attempt}/",
        "s3://trace-scratch/{task_id/{attempt}/",
        "s3://trace-scratch/../{task_id}/{attempt}/",
        "https://trace-scratch/{task_id}/{attempt}/",
        "s3://trace-scratch/{task_id}/{attempt}",  # not canonical: no trailing '/'
        DEFAULT_SCRATCH_TEMPLATE,  # {org} needs the repository
    ],
)
def test_a_bad_scratch_template_is_refused(template: str) -> None:
    with pytest.raises(ConfigurationError):
        _issuer(template)


async def test_issue_for_signs_exactly_the_grants() -> None:
    kit = make_kit(ManualClock())
    issuer = CapabilityIssuer(
        kit.tokens, scratch_template="s3://trace-scratch/{task_id}/{attempt}/"
    )
    token = await issuer.issue_for(_payload())
    claims = await kit.verifier.verify_for_task(token, TASK, 3)
    grants = await issuer.grants_for(_payload())
    assert (claims.inputs, claims.output_prefixes, claims.scratch_prefix) == (
        grants.inputs,
        grants.output_prefixes,
        grants.scratch_prefix,
    )
