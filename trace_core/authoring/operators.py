"""The operator registry: operator name -> implementation.

A DAG deploy validates every job's ``operator`` against the names here, so a
typo fails at deploy time with the file and line, not when the first event
arrives. Implementations are plain callables taking the task context; the
executor that runs them (threads, Spark) is the runtime's business.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from trace_core.errors import ConfigurationError

__all__ = ["OperatorRegistry", "OperatorSpec", "load_registry"]


@dataclass(frozen=True)
class OperatorSpec:
    """A registered operator: its name, implementation and whether it is a source."""

    name: str
    run: Callable[..., Any]
    source: bool = False
    description: str = ""


class OperatorRegistry:
    """Operator name -> :class:`OperatorSpec`."""

    def __init__(self, operators: Iterable[OperatorSpec] = ()) -> None:
        self._operators: dict[str, OperatorSpec] = {}
        for spec in operators:
            self.register(spec)

    def register(self, spec: OperatorSpec) -> None:
        """Add an operator; registering a name twice is an error (two implementations)."""
        if not spec.name.strip():
            raise ConfigurationError("operator name must not be blank")
        if spec.name in self._operators and self._operators[spec.name] != spec:
            raise ConfigurationError(f"operator {spec.name!r} is already registered")
        self._operators[spec.name] = spec

    def get(self, name: str) -> OperatorSpec:
        """The operator called ``name``; a clear error naming the known ones."""
        try:
            return self._operators[name]
        except KeyError:
            known = ", ".join(sorted(self._operators)) or "none"
            raise ConfigurationError(f"unknown operator {name!r} (registered: {known})") from None

    def names(self) -> frozenset[str]:
        """Every registered operator name (what deploy validates against)."""
        return frozenset(self._operators)

    def __contains__(self, name: object) -> bool:
        return name in self._operators


def load_registry(reference: str, source: str) -> OperatorRegistry:
    """The registry named by ``module:attribute`` (an instance or a factory of one);
    a :class:`ConfigurationError` naming ``source`` (the option or variable the
    reference came from) otherwise."""
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise ConfigurationError(f"{source} {reference!r}: expected 'module:attribute'")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"{source} {reference!r}: {exc}") from None
    registry = found() if callable(found) and not isinstance(found, OperatorRegistry) else found
    if not isinstance(registry, OperatorRegistry):
        raise ConfigurationError(f"{source} {reference!r} is not an OperatorRegistry")
    return registry
