"""The runtime registry: how a job's tasks are started.

``runtime`` in a job names an entry here. The Dispatcher owns attempts,
leases and retries the same way for every runtime; a runtime only decides
how a created (or retried) task is *started*:

- ``in_process``: the Dispatcher runs the operator itself (``runtime: dispatcher``);
- ``lambda``: a function is invoked with the full task payload, no queue;
- ``queue``: a ``task_id``-only wake-up goes to a worker queue (``ecs_*``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from trace_core.errors import ConfigurationError

__all__ = ["DEFAULT_RUNTIMES", "Runtime", "RuntimeKind", "RuntimeRegistry"]


class RuntimeKind(StrEnum):
    """How tasks of a runtime are started."""

    IN_PROCESS = "in_process"
    LAMBDA = "lambda"
    QUEUE = "queue"


@dataclass(frozen=True)
class Runtime:
    """One runtime: its name in job definitions, its kind and its target.

    ``target`` is the queue name for ``queue`` runtimes and the function name
    for ``lambda`` ones (``{operator}`` in it is replaced by the job's operator).
    """

    name: str
    kind: RuntimeKind
    target: str = ""

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ConfigurationError("Runtime.name must not be blank")
        if self.kind is not RuntimeKind.IN_PROCESS and not self.target.strip():
            raise ConfigurationError(f"runtime {self.name!r}: a {self.kind} runtime needs a target")

    def target_for(self, operator: str) -> str:
        """The queue or function that starts a task of ``operator``."""
        return self.target.replace("{operator}", operator)


DEFAULT_RUNTIMES = (
    Runtime("dispatcher", RuntimeKind.IN_PROCESS),
    Runtime("lambda", RuntimeKind.LAMBDA, "trace-{operator}"),
    Runtime("ecs_platform", RuntimeKind.QUEUE, "trace-ecs-platform"),
    Runtime("ecs_udf", RuntimeKind.QUEUE, "trace-ecs-udf"),
)


class RuntimeRegistry:
    """Runtime name -> :class:`Runtime`; deploy validates job runtimes against it."""

    def __init__(self, runtimes: Iterable[Runtime] = DEFAULT_RUNTIMES) -> None:
        self._runtimes: dict[str, Runtime] = {}
        for runtime in runtimes:
            self.register(runtime)

    def register(self, runtime: Runtime) -> None:
        """Add or replace a runtime."""
        self._runtimes[runtime.name] = runtime

    def get(self, name: str) -> Runtime:
        """The runtime called ``name``; a clear error naming the known ones."""
        try:
            return self._runtimes[name]
        except KeyError:
            known = ", ".join(sorted(self._runtimes))
            raise ConfigurationError(f"unknown runtime {name!r} (known: {known})") from None

    def names(self) -> frozenset[str]:
        """Every registered runtime name."""
        return frozenset(self._runtimes)
