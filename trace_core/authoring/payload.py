"""Typed read access to a task document, for every context an operator sees.

The task document is the payload of a claim (interface-contracts.md, "Task
Claim": ``task_id``, ``attempt``, ``job``, ``config``, ``inputs``,
``outputs``). :class:`~trace_core.authoring.context.TaskContext` (in the
worker) and the UDF child's context read it through :class:`TaskPayload`, so
an operator sees the same fields with the same types wherever it runs. This
module imports nothing but the standard library: the UDF child starts on it.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

__all__ = ["CAPABILITY_TOKEN_ENV", "TaskPayload"]

CAPABILITY_TOKEN_ENV = "TRACE_TASK_CAPABILITY_TOKEN"
"""The environment variable holding the attempt's capability token in a UDF child."""


class TaskPayload:
    """The fields of a task document, typed; ``payload`` is the document itself."""

    def __init__(self, payload: Mapping[str, Any]) -> None:
        self.payload: dict[str, Any] = dict(payload)

    @property
    def task_id(self) -> uuid.UUID:
        """The task (the producer run id of its events)."""
        return uuid.UUID(str(self.payload["task_id"]))

    @property
    def attempt(self) -> int:
        """The attempt being run."""
        return int(self.payload["attempt"])

    @property
    def job(self) -> dict[str, Any]:
        """``{dag_name, name, ...}`` of the task's job."""
        return dict(self.payload.get("job") or {})

    @property
    def config(self) -> dict[str, Any]:
        """The job's operator config."""
        return dict(self.payload.get("config") or {})

    @property
    def inputs(self) -> list[dict[str, Any]]:
        """Pinned input versions with their ``where`` filters and unit of work."""
        return list(self.payload.get("inputs") or [])

    @property
    def outputs(self) -> list[dict[str, Any]]:
        """Output datasets with their version and location, by output index."""
        return list(self.payload.get("outputs") or [])
