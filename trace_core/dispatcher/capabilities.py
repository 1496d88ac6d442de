"""Capability tokens for claimed tasks: what each attempt may read and write.

When a task is claimed, :class:`CapabilityIssuer` turns its payload into the
grants of one capability token (interface-contracts.md "UDF Data Access
Token"), signed by a :class:`~trace_core.security.TokenIssuer` for exactly
that ``(task_id, attempt)``:

``inputs``
    every pinned input of the payload (``dataset_uuid``, ``dataset_version``,
    the version's ``location`` and the edge's ``where``). An S3 location is a
    read grant; a ``postgres_table:<table>`` location stays in ``inputs`` so
    the Query Service can attach it, and is never an S3 grant.
``output_prefixes``
    the location of each output dataset version that lives in S3, in output
    order. Outputs stored as Postgres tables get no prefix: they are written
    through ``/v1/task/buffer-publish``.
``scratch_prefix``
    a prefix of the attempt's own, from a template such as
    ``s3://trace-lite/{org}/scratch/{task_id}/{attempt}/``: a retried attempt
    never reads or writes the scratch of the attempt it replaces.

A payload the token cannot describe (an input whose version row is gone, a
location that is not a canonical S3 prefix or a table, a token over the
size limit) raises :class:`~trace_core.errors.InvalidInput`: issuing again
would fail again.

Refresh. Tokens expire (their TTL), attempts may hold their lease far
longer (an always-on source). :meth:`CapabilityIssuer.renew_if_due` re-signs
a verified token's grants unchanged, with a fresh ``jti``/``iat``/``nbf``/``exp``,
once less than ``refresh_fraction`` of its lifetime is left; the caller is
the attempt's fenced heartbeat, so only the current lease holder gets one.
"""

from __future__ import annotations

import logging
import string
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trace_core.clock import Clock
from trace_core.dispatcher.bounded import BoundedMemo
from trace_core.errors import ConfigurationError, InvalidInput, NotFound
from trace_core.security.claims import (
    POSTGRES_TABLE_SCHEME,
    CapabilityClaims,
    DatasetInput,
    InvalidCapability,
)
from trace_core.security.jwks import KeyRing
from trace_core.security.scopes import S3Prefix
from trace_core.security.tokens import TokenIssuer
from trace_core.security.verifier import TokenVerifier
from trace_core.storage.protocol import Repository

__all__ = [
    "DEFAULT_REFRESH_FRACTION",
    "DEFAULT_SCRATCH_TEMPLATE",
    "TASK_TOKEN_AUDIENCE",
    "TASK_TOKEN_TTL_SECONDS",
    "CapabilityGrants",
    "CapabilityIssuer",
    "signing_capability_issuer",
    "task_token_verifier",
]

log = logging.getLogger(__name__)

DEFAULT_SCRATCH_TEMPLATE = "s3://trace-lite/{org}/scratch/{task_id}/{attempt}/"
"""Where an attempt's scratch prefix lives by default (the lite profile's bucket)."""

DEFAULT_REFRESH_FRACTION = 1 / 3
"""A token is renewed once less than this fraction of its lifetime is left."""

TASK_TOKEN_AUDIENCE = "trace-task"
"""The audience of every profile's capability tokens."""
TASK_TOKEN_TTL_SECONDS = 3600
"""Capability tokens last an hour (the key ring's default retention covers it)."""

_FIELDS = frozenset({"org", "task_id", "attempt"})
_ORG_CACHE = 4096  # jobs; a job's org never changes, so entries never go stale


@dataclass(frozen=True)
class CapabilityGrants:
    """What one attempt's token grants (the signed claims minus the JWT bookkeeping)."""

    task_id: uuid.UUID
    attempt: int
    inputs: tuple[DatasetInput, ...]
    output_prefixes: tuple[str, ...]
    scratch_prefix: str


def _template_fields(template: str) -> set[str]:
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ConfigurationError(f"scratch template {template!r}: {exc}") from None
    fields = set()
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if spec or conversion:
            raise ConfigurationError(
                f"scratch template {template!r}: fields take no format spec or conversion"
            )
        fields.add(name)
    return fields


class CapabilityIssuer:
    """Issues the capability token of a claimed task's attempt (module docstring).

    ``scratch_template`` is a ``str.format`` template over ``{org}`` (the
    task's org slug, read from ``repo`` once per job), ``{task_id}`` and
    ``{attempt}``; the last two are required, and the result must be a
    canonical ``s3://bucket/prefix/``. A template with ``{org}`` needs ``repo``.

    ``verifier`` checks the tokens presented for renewal (:meth:`refresh`);
    without one, only already-verified claims are renewed (:meth:`renew_if_due`).
    """

    def __init__(
        self,
        token_issuer: TokenIssuer,
        *,
        repo: Repository | None = None,
        scratch_template: str = DEFAULT_SCRATCH_TEMPLATE,
        verifier: TokenVerifier | None = None,
        refresh_fraction: float = DEFAULT_REFRESH_FRACTION,
    ) -> None:
        if not 0 < refresh_fraction < 1:
            raise ConfigurationError("CapabilityIssuer.refresh_fraction must be within (0, 1)")
        fields = _template_fields(scratch_template)
        if not fields <= _FIELDS or not {"task_id", "attempt"} <= fields:
            raise ConfigurationError(
                f"scratch template {scratch_template!r} must use {{task_id}} and {{attempt}}, "
                "and may use {org}; no other field"
            )
        if "org" in fields and repo is None:
            raise ConfigurationError("a scratch template with {org} needs the repository")
        sample = scratch_template.format(org="org", task_id=uuid.UUID(int=0), attempt=1)
        try:
            S3Prefix.parse_canonical(sample, field="scratch_template")
        except InvalidInput as exc:
            raise ConfigurationError(f"scratch template {scratch_template!r}: {exc}") from None
        self._tokens = token_issuer
        self._repo = repo
        self._template = scratch_template
        self._uses_org = "org" in fields
        self._orgs: BoundedMemo[uuid.UUID, str] = BoundedMemo(_ORG_CACHE)
        self._verifier = verifier
        self._refresh_fraction = refresh_fraction

    async def issue_for(self, payload: Mapping[str, Any]) -> str:
        """The signed token of the payload's ``(task_id, attempt)``.

        ``payload`` is a task payload as claimed (``task_id``, ``attempt``,
        ``job.id``, ``inputs`` with their ``location``, ``outputs``).
        Raises :class:`InvalidInput` when the payload cannot be granted.
        """
        grants = await self.grants_for(payload)
        return await self._tokens.issue(
            grants.task_id,
            grants.attempt,
            grants.inputs,
            grants.output_prefixes,
            grants.scratch_prefix,
        )

    async def grants_for(self, payload: Mapping[str, Any]) -> CapabilityGrants:
        """What :meth:`issue_for` would grant for ``payload`` (validated, unsigned)."""
        task_id = _uuid(payload.get("task_id"), "task_id")
        attempt = payload.get("attempt")
        if type(attempt) is not int or attempt < 1:
            raise InvalidInput("attempt", "must be an integer >= 1")
        inputs = tuple(_inputs(payload.get("inputs") or ()))
        outputs = _output_prefixes(payload.get("outputs") or ())
        org = await self._org_of(payload) if self._uses_org else ""
        scratch = self._template.format(org=org, task_id=task_id, attempt=attempt)
        S3Prefix.parse_canonical(scratch, field="scratch_prefix")
        return CapabilityGrants(task_id, attempt, inputs, outputs, scratch)

    async def _org_of(self, payload: Mapping[str, Any]) -> str:
        job = payload.get("job")
        job_id = _uuid(job.get("id") if isinstance(job, Mapping) else None, "job.id")
        slug = self._orgs.get(job_id)
        if slug is not None:
            return slug
        assert self._repo is not None  # checked at construction
        async with self._repo.read() as tx:
            found = await tx.registry.org_slug_of_job(job_id)
        if found is None:
            raise NotFound(f"job {job_id} of the claimed task does not exist")
        return self._orgs.put(job_id, found)

    def due(self, claims: CapabilityClaims) -> bool:
        """Whether less than ``refresh_fraction`` of the token's lifetime is left."""
        now = self._tokens.clock.now().timestamp()
        lifetime = claims.exp - claims.iat
        return claims.exp - now < self._refresh_fraction * lifetime

    async def renew_if_due(self, claims: CapabilityClaims) -> str | None:
        """A renewed token for verified ``claims`` when :meth:`due`; else ``None``.

        The caller must have fenced the attempt (its heartbeat succeeded)."""
        if not self.due(claims):
            return None
        return await self._tokens.renew(claims)

    async def refresh(self, token: str, task_id: uuid.UUID, attempt: int) -> str | None:
        """:meth:`renew_if_due` for a presented ``token`` of ``(task_id, attempt)``,
        verified first; ``None`` without a verifier or when it does not verify
        (an expired token cannot be renewed)."""
        if self._verifier is None:
            return None
        try:
            claims = await self._verifier.verify_for_task(token, task_id, attempt)
        except InvalidCapability as exc:
            log.info(
                "task %s attempt %d: capability not renewed (%s)", task_id, attempt, exc.reason
            )
            return None
        return await self.renew_if_due(claims)


def _uuid(value: object, field: str) -> uuid.UUID:
    try:
        return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))
    except ValueError:
        raise InvalidInput(field, "must be a UUID") from None


def _inputs(items: Sequence[Any]) -> list[DatasetInput]:
    granted = []
    for index, item in enumerate(items):
        field = f"inputs[{index}]"
        if not isinstance(item, Mapping):
            raise InvalidInput(field, "must be an object")
        location = item.get("location")
        if location is None:
            raise InvalidInput(
                f"{field}.location", "the pinned dataset version has no storage location"
            )
        where = item.get("where")
        try:
            granted.append(
                DatasetInput(
                    _uuid(item.get("dataset_uuid"), f"{field}.dataset_uuid"),
                    _uuid(item.get("dataset_version"), f"{field}.dataset_version"),
                    location,
                    where,
                )
            )
        except InvalidInput as exc:
            if exc.field.startswith(field):
                raise
            raise InvalidInput(f"{field}.{exc.field}", exc.reason) from None
    return granted


def _output_prefixes(items: Sequence[Any]) -> tuple[str, ...]:
    prefixes: list[str] = []
    for index, item in enumerate(items):
        location = item.get("location") if isinstance(item, Mapping) else None
        # An output without a version has nothing to write to: no grant.
        if location is None or (
            isinstance(location, str) and location.startswith(POSTGRES_TABLE_SCHEME)
        ):
            continue
        prefix = S3Prefix.parse_canonical(location, field=f"outputs[{index}].location").uri
        if prefix not in prefixes:
            prefixes.append(prefix)
    return tuple(prefixes)


def task_token_verifier(ring: KeyRing, clock: Clock, *, issuer: str) -> TokenVerifier:
    """Verifies the capability tokens :func:`signing_capability_issuer` signs
    with ``ring`` as ``issuer``."""
    return TokenVerifier(ring, issuer, TASK_TOKEN_AUDIENCE, clock)


def signing_capability_issuer(
    ring: KeyRing, repo: Repository, clock: Clock, storage_root: str, *, issuer: str
) -> CapabilityIssuer:
    """A profile's issuer: signs each claimed attempt's token with ``ring``
    as ``issuer`` (audience :data:`TASK_TOKEN_AUDIENCE`, an hour), with the
    attempt's scratch prefix under ``<storage_root>{org}/scratch/``, and
    verifies the tokens heartbeats present for renewal against the same ring."""
    root = storage_root if storage_root.endswith("/") else storage_root + "/"
    return CapabilityIssuer(
        TokenIssuer(ring, issuer, TASK_TOKEN_AUDIENCE, TASK_TOKEN_TTL_SECONDS, clock),
        repo=repo,
        scratch_template=root + "{org}/scratch/{task_id}/{attempt}/",
        verifier=task_token_verifier(ring, clock, issuer=issuer),
    )
