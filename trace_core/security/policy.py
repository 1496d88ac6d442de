"""Deny-by-default STS session policies derived from a :class:`~trace_core.security.scopes.Scope`.

The policy grants only what a task needs, on canonical directory prefixes
(SECURITY-NOTES, "Credential minting"): object ARNs always end in ``/*`` so
``t1/`` never matches ``t10/``, and ``s3:ListBucket`` is granted per bucket
only under a ``StringLike s3:prefix`` condition on the same prefixes.

What is deliberately not granted: ``s3:DeleteObject`` (outputs are committed
by writing, never by deleting), bucket-level actions other than listing, and
any KMS action (buckets encrypted with a customer KMS key need the minter's
role to add those separately).

:class:`PolicyEvaluator` (in :mod:`trace_core.security.evaluator`, re-exported
here) decides requests against such a policy; it is the test oracle, since
moto does not enforce session policies, and the lite object store's engine.

The output is deterministic (fixed statement order, sorted resources and
keys) so it can be compared with golden files, and :func:`packed_policy`
enforces STS's 2048-character limit before a request is ever sent.
"""

from __future__ import annotations

import json
from typing import Any

from trace_core.errors import InvalidInput
from trace_core.security.evaluator import PolicyEvaluator, UnsupportedPolicy
from trace_core.security.scopes import S3Prefix, Scope

__all__ = [
    "LIST_ACTION",
    "MAX_DURATION_SECONDS",
    "MAX_PACKED_POLICY_CHARS",
    "MIN_DURATION_SECONDS",
    "POLICY_VERSION",
    "READ_ACTIONS",
    "WRITE_ACTIONS",
    "PolicyEvaluator",
    "PolicyTooLarge",
    "UnsupportedPolicy",
    "bucket_arn",
    "dump_policy",
    "object_arn",
    "packed_policy",
    "prefix_arn",
    "session_policy",
    "validate_duration_seconds",
]

POLICY_VERSION = "2012-10-17"
# STS AssumeRole: "The plaintext that you use for both inline and managed
# session policies can't exceed 2,048 characters."
MAX_PACKED_POLICY_CHARS = 2048
# STS AssumeRole DurationSeconds range; the role's MaxSessionDuration (1 h by
# default, and 1 h when chaining roles) may lower the effective maximum.
MIN_DURATION_SECONDS = 900
MAX_DURATION_SECONDS = 43200

READ_ACTIONS: tuple[str, ...] = ("s3:GetObject",)
# PutObject also covers CreateMultipartUpload, UploadPart and
# CompleteMultipartUpload. AbortMultipartUpload lets a failed upload clean up
# its own parts under the write prefix; it cannot read or delete any
# committed object, and without it abandoned parts keep costing storage.
WRITE_ACTIONS: tuple[str, ...] = ("s3:AbortMultipartUpload", "s3:PutObject")
LIST_ACTION = "s3:ListBucket"
S3_PREFIX_KEY = "s3:prefix"


class PolicyTooLarge(InvalidInput):
    """The packed session policy exceeds STS's limit; the message says how many prefixes fit."""

    def __init__(self, length: int, prefixes: int, buckets: int) -> None:
        per_prefix = length / prefixes
        fit = int(MAX_PACKED_POLICY_CHARS * prefixes / length)
        super().__init__(
            "scope",
            f"the packed session policy is {length} characters, over STS's limit of "
            f"{MAX_PACKED_POLICY_CHARS} (rule: policy-size); {prefixes} prefixes on {buckets} "
            f"bucket(s) cost about {per_prefix:.0f} characters each, so about {fit} fit: "
            "grant a common parent prefix or split the task",
        )
        self.length = length
        self.fit = fit


def bucket_arn(bucket: str) -> str:
    """``arn:aws:s3:::BUCKET`` (the resource of ``s3:ListBucket``)."""
    return f"arn:aws:s3:::{bucket}"


def object_arn(bucket: str, key: str) -> str:
    """``arn:aws:s3:::BUCKET/KEY`` (the resource of object actions)."""
    return f"arn:aws:s3:::{bucket}/{key}"


def prefix_arn(prefix: S3Prefix) -> str:
    """``arn:aws:s3:::BUCKET/PREFIX/*``: every key under the directory, nothing beside it."""
    return object_arn(prefix.bucket, prefix.prefix + "*")


def _allow(actions: tuple[str, ...], resources: list[str]) -> dict[str, Any]:
    return {"Effect": "Allow", "Action": sorted(actions), "Resource": sorted(resources)}


def session_policy(scope: Scope) -> dict[str, Any]:
    """The least-privilege session policy for ``scope`` (deny by default).

    Statements, in this order and only when non-empty: ``s3:GetObject`` on
    read prefixes; ``s3:AbortMultipartUpload`` and ``s3:PutObject`` on write
    prefixes; then one ``s3:ListBucket`` per bucket (sorted by name),
    conditioned on ``s3:prefix`` matching one of that bucket's read or write
    prefixes. A request without a prefix (listing the whole bucket) or with
    ``t1`` instead of ``t1/`` is denied.
    """
    statements: list[dict[str, Any]] = []
    if scope.read:
        statements.append(_allow(READ_ACTIONS, [prefix_arn(p) for p in scope.read]))
    if scope.write:
        statements.append(_allow(WRITE_ACTIONS, [prefix_arn(p) for p in scope.write]))
    listable = (*scope.read, *scope.write)
    for bucket in scope.buckets():
        patterns = sorted({p.prefix + "*" for p in listable if p.bucket == bucket})
        statement = _allow((LIST_ACTION,), [bucket_arn(bucket)])
        statement["Condition"] = {"StringLike": {S3_PREFIX_KEY: patterns}}
        statements.append(statement)
    return {"Version": POLICY_VERSION, "Statement": statements}


def dump_policy(policy: dict[str, Any]) -> str:
    """Compact, key-sorted, ASCII-only JSON.

    ASCII because IAM accepts only U+0020..U+00FF in policy text: other
    characters travel as ``\\uXXXX`` escapes, which IAM decodes.
    """
    return json.dumps(policy, separators=(",", ":"), sort_keys=True, ensure_ascii=True)


def packed_policy(scope: Scope) -> str:
    """The session policy as the compact JSON sent to STS.

    Raises :class:`PolicyTooLarge` above 2048 characters. A read or write
    prefix costs ``len(bucket) + 2 * len(prefix) + 22`` characters (its object
    ARN plus its list pattern; ``prefix`` with its trailing ``/``), a prefix
    both read and written (scratch) ``len(bucket) + len(prefix) + 18`` more.
    Fixed costs: ``~215 + len(bucket)`` for the first bucket, ``~85`` for the
    write statement, ``~120 + len(bucket)`` per further bucket. So with one
    20-character bucket and 40-character prefixes (``/`` included) 14 read
    prefixes fit, the 15th does not (pinned by a test).
    """
    text = dump_policy(session_policy(scope))
    if len(text) > MAX_PACKED_POLICY_CHARS:
        count = len(set(scope.read) | set(scope.write))
        raise PolicyTooLarge(len(text), count, len(scope.buckets()))
    return text


def validate_duration_seconds(duration_seconds: object) -> int:
    """Return ``duration_seconds`` if it is an int in STS's 900..43200 range; else raise."""
    if isinstance(duration_seconds, bool) or not isinstance(duration_seconds, int):
        raise InvalidInput("duration_seconds", "must be an integer number of seconds")
    if not MIN_DURATION_SECONDS <= duration_seconds <= MAX_DURATION_SECONDS:
        raise InvalidInput(
            "duration_seconds",
            f"must be between {MIN_DURATION_SECONDS} and {MAX_DURATION_SECONDS} "
            f"(rule: sts-duration); got {duration_seconds}",
        )
    return duration_seconds
