"""An in-repo evaluator for the subset of IAM policy logic our session policies use.

moto does not enforce session policies, so this is the oracle of the tests
and the enforcement engine of the lite profile's object store. It is written
from the IAM evaluation rules, not from the generator, so a generator bug
shows up as a disagreement:

- deny by default; an explicit ``Deny`` overrides any ``Allow``;
- ``Action``: case-insensitive, ``*`` and ``?`` wildcards;
- ``Resource``: case-sensitive glob where ``*`` matches any sequence
  (including ``/``) and ``?`` exactly one character;
- ``Condition``: only ``StringLike`` on ``s3:prefix`` (case-sensitive glob);
  a request without the key does not satisfy it; several values are ORed,
  several keys and operators ANDed.

Anything outside that subset (``NotAction``, ``NotResource``, ``Principal``,
other operators or keys, ``${...}`` policy variables) is refused at
construction with :class:`UnsupportedPolicy`, because silently ignoring an
element would make the oracle more permissive than IAM.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from trace_core.errors import ConfigurationError

__all__ = ["PolicyEvaluator", "UnsupportedPolicy"]

_STATEMENT_KEYS = frozenset({"Sid", "Effect", "Action", "Resource", "Condition"})
_SUPPORTED_CONDITIONS = {"StringLike": frozenset({"s3:prefix"})}


class UnsupportedPolicy(ConfigurationError):
    """The policy uses an element the evaluator does not implement."""


@lru_cache(maxsize=4096)
def _glob(pattern: str, *, ignore_case: bool) -> re.Pattern[str]:
    """IAM wildcard pattern -> anchored regex (``*`` any run, ``?`` one char)."""
    parts = [".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern]
    flags = re.DOTALL | (re.IGNORECASE if ignore_case else 0)
    return re.compile("".join(parts), flags)


def _strings(value: object, where: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(v, str) for v in items):
        raise UnsupportedPolicy(f"{where}: must be a string or a non-empty list of strings")
    for item in items:
        if "${" in item:
            raise UnsupportedPolicy(f"{where}: policy variables are not supported ({item!r})")
    return tuple(items)


@dataclass(frozen=True, slots=True)
class _Statement:
    allow: bool
    actions: tuple[str, ...]
    resources: tuple[str, ...]
    # operator -> key -> patterns
    conditions: tuple[tuple[str, str, tuple[str, ...]], ...]

    def matches(self, action: str, resource: str, context: Mapping[str, str]) -> bool:
        if not any(_glob(a, ignore_case=True).fullmatch(action) for a in self.actions):
            return False
        if not any(_glob(r, ignore_case=False).fullmatch(resource) for r in self.resources):
            return False
        for _operator, key, patterns in self.conditions:
            # StringLike on a key absent from the request is false (no IfExists).
            value = context.get(key)
            if value is None:
                return False
            if not any(_glob(p, ignore_case=False).fullmatch(value) for p in patterns):
                return False
        return True


def _parse_statement(raw: object, where: str) -> _Statement:
    if not isinstance(raw, Mapping):
        raise UnsupportedPolicy(f"{where}: must be an object")
    extra = set(raw) - _STATEMENT_KEYS
    if extra:
        raise UnsupportedPolicy(f"{where}: unsupported elements {sorted(extra)}")
    effect = raw.get("Effect")
    if effect not in ("Allow", "Deny"):
        raise UnsupportedPolicy(f"{where}.Effect: must be 'Allow' or 'Deny', not {effect!r}")
    conditions: list[tuple[str, str, tuple[str, ...]]] = []
    block = raw.get("Condition", {})
    if not isinstance(block, Mapping):
        raise UnsupportedPolicy(f"{where}.Condition: must be an object")
    for operator, entries in block.items():
        keys = _SUPPORTED_CONDITIONS.get(operator)
        if keys is None or not isinstance(entries, Mapping):
            raise UnsupportedPolicy(f"{where}.Condition: operator {operator!r} is not supported")
        for key, values in entries.items():
            if key not in keys:
                raise UnsupportedPolicy(f"{where}.Condition.{operator}: key {key!r} unsupported")
            patterns = _strings(values, f"{where}.Condition.{operator}.{key}")
            conditions.append((operator, key, patterns))
    return _Statement(
        allow=effect == "Allow",
        actions=_strings(raw.get("Action"), f"{where}.Action"),
        resources=_strings(raw.get("Resource"), f"{where}.Resource"),
        conditions=tuple(conditions),
    )


class PolicyEvaluator:
    """Decides requests against one identity/session policy, deny by default."""

    def __init__(self, policy: Mapping[str, Any]) -> None:
        """Parse ``policy``; raise :class:`UnsupportedPolicy` outside the implemented subset."""
        if not isinstance(policy, Mapping) or set(policy) - {"Version", "Statement", "Id"}:
            raise UnsupportedPolicy("policy: must be an object with Version and Statement")
        if policy.get("Version") != "2012-10-17":
            raise UnsupportedPolicy("policy.Version: must be '2012-10-17'")
        raw = policy.get("Statement")
        raw_list = [raw] if isinstance(raw, Mapping) else raw
        if not isinstance(raw_list, list):
            raise UnsupportedPolicy("policy.Statement: must be an object or a list")
        self._statements = tuple(
            _parse_statement(s, f"Statement[{i}]") for i, s in enumerate(raw_list)
        )

    def allows(self, action: str, resource_arn: str, *, s3_prefix: str | None = None) -> bool:
        """Whether ``action`` on ``resource_arn`` is allowed.

        ``s3_prefix`` is the request's ``s3:prefix`` condition key (the
        ``prefix`` parameter of a list request); ``None`` means the request
        carries none. True only if some ``Allow`` matches and no ``Deny`` does.
        """
        context = {} if s3_prefix is None else {"s3:prefix": s3_prefix}
        allowed = False
        for statement in self._statements:
            if statement.matches(action, resource_arn, context):
                if not statement.allow:
                    return False
                allowed = True
        return allowed
