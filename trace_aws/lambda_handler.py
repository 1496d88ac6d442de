"""The function side of ``runtime: lambda``: ``trace_aws.lambda_handler.handler``.

The Dispatcher invokes the function (``InvocationType=Event``, its own retries
off: :mod:`trace_aws.lambda_invoker`) with the full task payload. The handler
runs the operator through the same :class:`~trace_core.worker.WorkerWrapper`
as every other worker and reports through the Dispatcher's ``/internal/*``
endpoints over HTTP; it holds the internal token, never database
credentials.

**How an invocation gets its lease.** The invocation is a wake-up that
carries the payload: the handler claims the task (``/internal/task-claim``)
exactly as an SQS worker does, with a worker id naming the function and
the invocation's request id. The claim's answer is the lease (attempt, lease
token) and the payload with the attempt's capability token, which the
Dispatcher issues only to a granted claim (a token minted at invoke time would
outlive a lost event). So an invocation is fenced like any stale worker:

- a duplicate invocation (Lambda delivers an event at least once) finds the
  task ``AlreadyRunning`` or ``Completed`` and runs nothing;
- a late invocation after the task completed is answered ``Completed``;
- an invocation whose lease was reclaimed (it outlived its heartbeat timeout,
  the reaper retried the task) has its next heartbeat, emit or completion
  refused as stale: the operator is cancelled and nothing more is written.

The invocation's own payload only names the task (``task_id``, checked);
what runs is what the claim returned, so a stale payload cannot run.

Configuration (environment of the function): ``TRACE_API_URL`` (the
Dispatcher's base URL), ``TRACE_INTERNAL_TOKEN`` (its internal token: keep it
in an encrypted environment variable or fetch it from Secrets Manager into
the environment), ``TRACE_OPERATORS`` (``module:attribute`` of an
``OperatorRegistry`` or a factory of one), and optionally
``TRACE_LAMBDA_TIMEOUT_SECONDS`` (bounds the operator; keep it below the
function's timeout so a failure is still reported). The secrets a job
declares are read from the same environment (:class:`EnvironmentSecrets`),
never the platform's ``TRACE_*`` nor the runtime's ``AWS_*`` variables.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from trace_core.authoring.operators import OperatorRegistry, load_registry
from trace_core.errors import ConfigurationError, InvalidInput
from trace_core.worker import HttpControlPlaneClient, RetryingClient, WorkerWrapper

__all__ = [
    "EnvironmentSecrets",
    "LambdaHandlerSettings",
    "handler",
    "parse_invocation",
    "run_invocation",
    "worker_id_for",
]

log = logging.getLogger(__name__)

WrapperFactory = Callable[[str], WorkerWrapper]
"""Builds the wrapper of one invocation from its worker id."""


@dataclass(frozen=True)
class LambdaHandlerSettings:
    """What the handler reads from the function's environment."""

    api_url: str
    internal_token: str = field(repr=False)
    operators: str
    timeout_seconds: float | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LambdaHandlerSettings:
        """The settings, or a :class:`ConfigurationError` naming the variable."""
        env = os.environ if env is None else env
        values = {}
        for name in ("TRACE_API_URL", "TRACE_INTERNAL_TOKEN", "TRACE_OPERATORS"):
            value = env.get(name, "").strip()
            if not value:
                raise ConfigurationError(f"{name}: required in the function's environment")
            values[name] = value
        if not values["TRACE_API_URL"].startswith(("http://", "https://")):
            raise ConfigurationError("TRACE_API_URL: must be an http:// or https:// URL")
        timeout: float | None = None
        raw = env.get("TRACE_LAMBDA_TIMEOUT_SECONDS", "").strip()
        if raw:
            try:
                timeout = float(raw)
            except ValueError:
                raise ConfigurationError("TRACE_LAMBDA_TIMEOUT_SECONDS: not a number") from None
            if not timeout > 0:
                raise ConfigurationError("TRACE_LAMBDA_TIMEOUT_SECONDS: must be > 0")
        return cls(
            values["TRACE_API_URL"],
            values["TRACE_INTERNAL_TOKEN"],
            values["TRACE_OPERATORS"],
            timeout,
        )


_PLATFORM_PREFIXES = ("TRACE_", "AWS_")


class EnvironmentSecrets:
    """A job's declared secrets from the function's environment (where Lambda
    puts its encrypted environment variables).

    ``TRACE_*`` (the internal token) and ``AWS_*`` (the execution role's
    session credentials Lambda sets) are never handed to an operator, whatever
    a job declares.
    """

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self._env = os.environ if env is None else env

    def secrets_for(self, names: Sequence[str], task: Mapping[str, Any]) -> Mapping[str, str]:
        """The values of ``names`` the environment holds (platform names left out)."""
        return {
            n: self._env[n]
            for n in names
            if n in self._env and not n.startswith(_PLATFORM_PREFIXES)
        }

    def __repr__(self) -> str:
        return "EnvironmentSecrets()"  # never the values


def parse_invocation(event: Any) -> uuid.UUID:
    """The task id of an invocation event; :class:`InvalidInput` naming the field."""
    if not isinstance(event, Mapping):
        raise InvalidInput("event", "not a JSON object")
    value = event.get("task_id")
    if value is None:
        raise InvalidInput("event.task_id", "missing")
    if not isinstance(value, str):
        raise InvalidInput("event.task_id", "not a string")
    try:
        return uuid.UUID(value)
    except ValueError:
        raise InvalidInput("event.task_id", "not a UUID") from None


def worker_id_for(function_name: str, request_id: str) -> str:
    """The worker id of one invocation: the function and its request id, so the
    task's lease names the invocation (and CloudWatch finds its logs)."""
    return f"lambda:{function_name}:{request_id}"


async def run_invocation(event: Any, worker_id: str, wrapper_for: WrapperFactory) -> dict[str, str]:
    """Claim, run and report the task ``event`` names; ``{"task_id", "outcome"}``.

    The outcome is the wrapper's (``completed``, ``failed``, ``stale``,
    ``AlreadyRunning``, ``Completed``...). Raises when the claim could not be
    made (the control plane unreachable, or refusing the token).
    """
    task_id = parse_invocation(event)
    outcome = await wrapper_for(worker_id).handle_wakeup(task_id)
    log.info("task %s: %s (%s)", task_id, outcome, worker_id)
    return {"task_id": str(task_id), "outcome": outcome}


def _settings_wrapper(
    settings: LambdaHandlerSettings, registry: OperatorRegistry
) -> Callable[[str], tuple[WorkerWrapper, Callable[[], Awaitable[None]]]]:
    def build(worker_id: str) -> tuple[WorkerWrapper, Callable[[], Awaitable[None]]]:
        # One HTTP client per invocation: each runs its own event loop.
        http = HttpControlPlaneClient(settings.api_url, settings.internal_token)
        client = RetryingClient(http, max_elapsed_seconds=60.0)
        wrapper = WorkerWrapper(
            client,
            registry,
            worker_id=worker_id,
            timeout_seconds=settings.timeout_seconds,
            secrets=EnvironmentSecrets(),
        )
        return wrapper, http.aclose

    return build


_registry: OperatorRegistry | None = None


def handler(event: Any, context: Any) -> dict[str, str]:
    """The Lambda entry point: run the task ``event`` names (module docstring).

    Configuration errors and a malformed event raise (the invocation fails and
    Lambda logs it); the outcome of a task is the return value.
    """
    global _registry
    settings = LambdaHandlerSettings.from_env()
    if _registry is None:  # once per execution environment
        _registry = load_registry(settings.operators, "TRACE_OPERATORS")
    build = _settings_wrapper(settings, _registry)
    worker_id = worker_id_for(
        str(getattr(context, "function_name", "function")),
        str(getattr(context, "aws_request_id", uuid.uuid4())),
    )

    async def main() -> dict[str, str]:
        wrapper, close = build(worker_id)
        try:
            return await run_invocation(event, worker_id, lambda _: wrapper)
        finally:
            await close()

    return anyio.run(main)
