"""What a task capability token grants, and the one error a verifier raises.

The claims are the single source of truth for what a task attempt may read
and write (interface-contracts.md "UDF Data Access Token"): the pinned input
dataset versions with their storage locations, the output prefixes and the
scratch prefix. Prefixes must already be canonical ``s3://bucket/prefix/``
strings (dispatcher.md "Scope derivation", checked by
:mod:`trace_core.security.scopes`): nothing here normalizes, it only accepts
or rejects, so the signed text is exactly what policies are built from.

Two shapes follow from what a task can be:

* ``output_prefixes`` is a list: a job may have several outputs, each a
  dataset version with its own prefix, and no common prefix short of the
  whole org. It may be empty, when every output is a Postgres table (those
  are written through the dataset buffer, never with S3 credentials).
* An input's ``location`` is either a canonical S3 prefix or
  ``postgres_table:<table>`` (a Postgres-backed dataset version; the table
  name is a lowercase unquoted identifier). Both stay in ``inputs`` so the
  Query Service can attach every input the task may read; only S3 locations
  enter the credential :meth:`~CapabilityClaims.scope`.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, get_args

from trace_core.errors import InvalidInput, TraceError
from trace_core.security.scopes import InvalidScope, S3Prefix, Scope

__all__ = [
    "CAPABILITY_FAILURES",
    "POSTGRES_TABLE_SCHEME",
    "CapabilityClaims",
    "CapabilityFailure",
    "DatasetInput",
    "InvalidCapability",
    "task_subject",
]

POSTGRES_TABLE_SCHEME = "postgres_table:"
"""Location prefix of a Postgres-backed dataset version (``postgres_table:<table>``)."""
_TABLE_RE = re.compile(r"[a-z_][a-z0-9_]{0,62}")

CapabilityFailure = Literal[
    "oversized",
    "malformed",
    "unsupported_alg",
    "unknown_crit",
    "bad_header",
    "unknown_kid",
    "jwks_unavailable",
    "malformed_signature",
    "bad_signature",
    "missing_claim",
    "invalid_claim",
    "expired",
    "not_yet_valid",
    "wrong_audience",
    "wrong_issuer",
    "wrong_subject",
    "wrong_task",
]
"""Why a token was refused; ``jwks_unavailable`` alone is worth retrying."""

CAPABILITY_FAILURES: frozenset[str] = frozenset(get_args(CapabilityFailure))


class InvalidCapability(TraceError):
    """A capability token was refused; ``reason`` says why, machine-readably.

    The message is built from fixed text and claim names only: it never
    contains the token, a part of it, or a value taken from it.
    """

    def __init__(self, reason: CapabilityFailure, detail: str) -> None:
        super().__init__(f"invalid capability token ({reason}): {detail}")
        self.reason: CapabilityFailure = reason
        self.detail = detail


def task_subject(task_id: uuid.UUID, attempt: int) -> str:
    """The ``sub`` claim of a token for one task attempt: ``task:<task_id>:<attempt>``."""
    return f"task:{task_id}:{attempt}"


def _require_s3_prefix(url: object, field: str) -> str:
    """Return ``url`` if it is already a canonical ``s3://bucket/prefix/``.

    The rule is the one credential minting applies
    (:meth:`~trace_core.security.scopes.S3Prefix.parse_canonical`), so a
    token can only carry prefixes minting will accept verbatim.
    """
    return S3Prefix.parse_canonical(url, field=field).uri


def _require_location(location: object, field: str) -> S3Prefix | None:
    """Check an input location: a canonical S3 prefix (returned) or a Postgres table (None)."""
    if isinstance(location, str) and location.startswith(POSTGRES_TABLE_SCHEME):
        if not _TABLE_RE.fullmatch(location[len(POSTGRES_TABLE_SCHEME) :]):
            raise InvalidScope(
                field,
                "table-name",
                "a postgres_table location must name a lowercase unquoted identifier "
                "of 1-63 characters ([a-z_][a-z0-9_]*)",
            )
        return None
    return S3Prefix.parse_canonical(location, field=field)


def _claim_error(exc: InvalidInput, prefix: str = "") -> InvalidCapability:
    # Name the field and rule only: scope errors quote the offending value.
    rule = getattr(exc, "rule", "invalid")
    return InvalidCapability("invalid_claim", f"claim {prefix}{exc.field} breaks rule {rule}")


@dataclass(frozen=True)
class DatasetInput:
    """One input the task may read: a pinned dataset version at its location.

    ``location`` is a canonical ``s3://bucket/prefix/`` or
    ``postgres_table:<table>`` (see the module docstring).
    """

    dataset_uuid: uuid.UUID
    dataset_version: uuid.UUID
    location: str
    where: str | None = None
    """The edge's read-time filter predicate, if any (ADR 0007)."""

    def __post_init__(self) -> None:
        _require_location(self.location, "location")
        if self.where is not None and not isinstance(self.where, str):
            raise InvalidInput("where", "must be a string or None")

    @property
    def s3_prefix(self) -> S3Prefix | None:
        """The input's S3 prefix, or ``None`` for a Postgres table."""
        return _require_location(self.location, "location")

    @property
    def postgres_table(self) -> str | None:
        """The input's Postgres table name, or ``None`` for an S3 prefix."""
        if self.location.startswith(POSTGRES_TABLE_SCHEME):
            return self.location[len(POSTGRES_TABLE_SCHEME) :]
        return None

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this input inside the token."""
        return {
            "dataset_uuid": str(self.dataset_uuid),
            "dataset_version": str(self.dataset_version),
            "location": self.location,
            "where": self.where,
        }


@dataclass(frozen=True)
class CapabilityClaims:
    """The verified claims of a task capability token.

    Times are JWT NumericDates (integer Unix seconds). Constructing one
    validates every field (``InvalidInput`` otherwise), including that
    ``sub`` is :func:`task_subject` of ``task_id`` and ``attempt``.
    """

    iss: str
    aud: str
    sub: str
    task_id: uuid.UUID
    attempt: int
    exp: int
    nbf: int
    iat: int
    jti: str
    inputs: tuple[DatasetInput, ...]
    output_prefixes: tuple[str, ...]
    """One canonical S3 prefix per S3 output, in output order, no duplicates
    (empty when every output is a Postgres table)."""
    scratch_prefix: str

    def __post_init__(self) -> None:
        for name in ("iss", "aud", "jti"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise InvalidInput(name, "must be a non-empty string")
        if type(self.attempt) is not int or self.attempt < 1:
            raise InvalidInput("attempt", "must be an integer >= 1")
        if self.sub != task_subject(self.task_id, self.attempt):
            raise InvalidInput("sub", "must be task:<task_id>:<attempt>")
        for name in ("exp", "nbf", "iat"):
            if type(getattr(self, name)) is not int:
                raise InvalidInput(name, "must be an integer NumericDate")
        if not (self.iat <= self.exp and self.nbf <= self.exp):
            raise InvalidInput("exp", "must not precede iat or nbf")
        for index, item in enumerate(self.inputs):
            if not isinstance(item, DatasetInput):
                raise InvalidInput(f"inputs[{index}]", "must be a DatasetInput")
        if not isinstance(self.output_prefixes, tuple):
            raise InvalidInput("output_prefixes", "must be a tuple of s3:// prefixes")
        for index, prefix in enumerate(self.output_prefixes):
            _require_s3_prefix(prefix, f"output_prefixes[{index}]")
        if len(set(self.output_prefixes)) != len(self.output_prefixes):
            raise InvalidScope("output_prefixes", "duplicate", "must not repeat a prefix")
        _require_s3_prefix(self.scratch_prefix, "scratch_prefix")

    @property
    def expires_at(self) -> datetime:
        """``exp`` as a timezone-aware UTC datetime."""
        return datetime.fromtimestamp(self.exp, UTC)

    def scope(self) -> Scope:
        """What the token grants in S3: read the S3 inputs and scratch, write the
        outputs and scratch (Postgres inputs are read through the Query Service)."""
        scratch = S3Prefix.parse_canonical(self.scratch_prefix, field="scratch_prefix")
        reads = [p for p in (item.s3_prefix for item in self.inputs) if p is not None]
        writes = [
            S3Prefix.parse_canonical(p, field="output_prefixes") for p in self.output_prefixes
        ]
        return Scope(read=(*reads, scratch), write=(*writes, scratch))

    def to_payload(self) -> dict[str, Any]:
        """The JWT payload (JSON object) carrying these claims."""
        return {
            "iss": self.iss,
            "aud": self.aud,
            "sub": self.sub,
            "iat": self.iat,
            "nbf": self.nbf,
            "exp": self.exp,
            "jti": self.jti,
            "task_id": str(self.task_id),
            "attempt": self.attempt,
            "inputs": [item.to_json() for item in self.inputs],
            "output_prefixes": list(self.output_prefixes),
            "scratch_prefix": self.scratch_prefix,
        }

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> CapabilityClaims:
        """Parse a verified payload strictly; raise :class:`InvalidCapability`.

        ``wrong_subject`` if ``sub`` does not name ``task_id``/``attempt``;
        ``invalid_claim`` for any other missing, mistyped or non-canonical
        field. Unknown top-level claims are ignored (JWT practice); unknown
        members inside an input are refused, as they could only widen scope.
        """
        task_id = _uuid(payload.get("task_id"), "task_id")
        attempt = payload.get("attempt")
        if type(attempt) is not int or attempt < 1:
            raise InvalidCapability("invalid_claim", "claim attempt must be an integer >= 1")
        if payload.get("sub") != task_subject(task_id, attempt):
            raise InvalidCapability("wrong_subject", "sub does not name task_id and attempt")
        raw_inputs = payload.get("inputs")
        if not isinstance(raw_inputs, list):
            raise InvalidCapability("invalid_claim", "claim inputs must be a list")
        raw_outputs = payload.get("output_prefixes")
        if not isinstance(raw_outputs, list):
            raise InvalidCapability("invalid_claim", "claim output_prefixes must be a list")
        try:
            return cls(
                iss=payload["iss"],
                aud=payload["aud"],
                sub=payload["sub"],
                task_id=task_id,
                attempt=attempt,
                exp=payload["exp"],
                nbf=payload["nbf"],
                iat=payload["iat"],
                jti=payload["jti"],
                inputs=tuple(_input(item, i) for i, item in enumerate(raw_inputs)),
                output_prefixes=tuple(
                    _require_s3_prefix(p, f"output_prefixes[{i}]")
                    for i, p in enumerate(raw_outputs)
                ),
                scratch_prefix=_require_s3_prefix(payload.get("scratch_prefix"), "scratch_prefix"),
            )
        except KeyError as exc:
            raise InvalidCapability("missing_claim", f"claim {exc.args[0]} is missing") from None
        except InvalidInput as exc:
            raise _claim_error(exc) from None


_INPUT_MEMBERS = frozenset({"dataset_uuid", "dataset_version", "location", "where"})


def _uuid(value: object, field: str) -> uuid.UUID:
    # Only the canonical spelling: one token text per grant.
    if isinstance(value, str):
        try:
            parsed = uuid.UUID(value)
        except ValueError:
            pass
        else:
            if str(parsed) == value:
                return parsed
    raise InvalidCapability("invalid_claim", f"claim {field} must be a canonical UUID")


def _input(item: object, index: int) -> DatasetInput:
    field = f"inputs[{index}]"
    if not isinstance(item, Mapping) or set(item) != _INPUT_MEMBERS:
        members = ", ".join(sorted(_INPUT_MEMBERS))
        raise InvalidCapability("invalid_claim", f"claim {field} must have exactly {members}")
    where = item["where"]
    if where is not None and not isinstance(where, str):
        raise InvalidCapability("invalid_claim", f"claim {field}.where must be a string or null")
    try:
        return DatasetInput(
            dataset_uuid=_uuid(item["dataset_uuid"], f"{field}.dataset_uuid"),
            dataset_version=_uuid(item["dataset_version"], f"{field}.dataset_version"),
            location=item["location"],
            where=where,
        )
    except InvalidInput as exc:
        raise _claim_error(exc, f"{field}.") from None
