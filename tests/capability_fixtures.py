"""Shared helpers of the capability tests: keys, issuer, verifier, minter, buffer, a DAG.

The DAG has a manual source ``follow`` with three outputs (two in S3, one a
Postgres table) and a reactive ``enrich`` that reads an S3 input (filtered)
and the Postgres one, and writes one S3 and one Postgres output: between
them they cover multi-output tokens, table inputs and buffered outputs.
Nothing runs them in-process; the tests are the workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trace_core.authoring.operators import OperatorRegistry, OperatorSpec
from trace_core.clock import ManualClock
from trace_core.dispatcher.buffer import InMemoryDatasetBuffer
from trace_core.dispatcher.capabilities import CapabilityIssuer
from trace_core.security import (
    KeyRing,
    LocalCredentialMinter,
    PrivateKeySigner,
    RotationPolicy,
    TokenIssuer,
    TokenVerifier,
)
from trace_core.storage.protocol import Repository

ISSUER = "trace-test"
AUDIENCE = "trace-task"
TTL = 600
LEEWAY = 30
HEADER = "X-Trace-Task-Capability"

CAPS_DAG = """
dag: caps
jobs:
  - name: follow
    activation: source
    runtime: ecs_udf
    operator: follow
    source: { kind: manual }
    heartbeat_timeout_seconds: 60
    outputs:
      - { dataset: blocks }
      - { dataset: alerts, kind: postgres_table }
      - { dataset: logs }
  - name: enrich
    activation: reactive
    runtime: ecs_udf
    operator: enrich
    execution_strategy: PerUpdate
    inputs:
      - from: { dataset: blocks }
        where: "number > 10"
      - from: { dataset: alerts }
    outputs:
      - { dataset: enriched }
      - { dataset: flags, kind: postgres_table }
"""


def _not_in_process(ctx: Any) -> None:
    raise AssertionError("ecs_udf tasks are run by the test, not in-process")


CAPS_OPERATORS = OperatorRegistry(
    [
        OperatorSpec("follow", _not_in_process, source=True),
        OperatorSpec("enrich", _not_in_process),
    ]
)


@dataclass
class Kit:
    """One issuer's keys and everything built on them, on one manual clock."""

    clock: ManualClock
    ring: KeyRing
    tokens: TokenIssuer
    verifier: TokenVerifier
    minter: LocalCredentialMinter
    buffer: InMemoryDatasetBuffer

    def issuer(self, repo: Repository) -> CapabilityIssuer:
        """A capability issuer with the default scratch layout, on ``repo``."""
        return CapabilityIssuer(self.tokens, repo=repo)


def make_kit(clock: ManualClock) -> Kit:
    """A fresh key ring (one bootstrap key) and its issuer, verifier, minter and buffer."""
    ring = KeyRing(clock, RotationPolicy(verifier_cache_seconds=300, max_token_ttl_seconds=3600))
    ring.bootstrap(PrivateKeySigner.generate())
    return Kit(
        clock=clock,
        ring=ring,
        tokens=TokenIssuer(ring, ISSUER, AUDIENCE, TTL, clock),
        verifier=TokenVerifier(ring, ISSUER, AUDIENCE, clock, leeway_seconds=LEEWAY),
        minter=LocalCredentialMinter(clock=clock),
        buffer=InMemoryDatasetBuffer(),
    )
