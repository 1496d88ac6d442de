"""What an operator sees: :class:`TaskContext`, :class:`OperatorResult`, and the
job's declared secrets.

The context carries the task payload (config, pinned inputs with their
``where`` filters, output locations), the attempt's capability token and
scoped credentials when there are any, and the only calls an operator may make
to the control plane: :meth:`TaskContext.emit` and
:meth:`TaskContext.directive`. Both go through the worker wrapper's attempt,
which is fenced: once the lease is lost they raise
:class:`~trace_core.errors.StaleClaim` without calling anything.

Secrets: a job declares the names it needs in ``config["secrets"]``; the
wrapper resolves them from its :class:`SecretProvider` at launch and hands
the operator those and no others (as environment variables in a UDF child).

Part of :mod:`trace_core.authoring`: it imports nothing from the control plane.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio.from_thread

from trace_core.authoring.events import AcceptResult, DatasetEvent
from trace_core.authoring.payload import CAPABILITY_TOKEN_ENV, TaskPayload
from trace_core.errors import ConfigurationError, StaleClaim

__all__ = [
    "CAPABILITY_TOKEN_ENV",
    "RESERVED_ENV",
    "AttemptControl",
    "OperatorError",
    "OperatorResult",
    "SecretProvider",
    "StaticSecrets",
    "TaskContext",
    "check_env_name",
    "declared_secrets",
]

RESERVED_ENV = frozenset({"PATH", "HOME", "LANG", "PYTHONPATH"})
"""Names the wrapper sets itself in a UDF child; a secret may not take them."""

_RESERVED_PREFIXES = ("TRACE_", "PYTHON", "LD_", "DYLD_")
"""``TRACE_*`` keeps the platform's own variables (the internal token, the
state-DB URL) out of reach of a job's declaration; ``PYTHON*``, ``LD_*`` and
``DYLD_*`` would change what code the child runs."""

_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]{0,127}")


@dataclass(frozen=True)
class OperatorResult:
    """What an operator returns: final events and per-output metadata."""

    events: Sequence[DatasetEvent] = ()
    outputs: Sequence[Mapping[str, Any]] | None = None


class OperatorError(Exception):
    """Raised by an operator to fail its attempt with the given message.

    ``retryable=False`` fails it terminally (no retry): use it for errors
    another attempt cannot fix. Any other exception is retryable.
    """

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


class AttemptControl(Protocol):
    """The fenced calls a context makes for its operator (the wrapper's attempt)."""

    @property
    def lost(self) -> str | None:
        """Why the attempt lost its lease (``stale``, ``abandoned``), or ``None``."""
        ...

    async def emit(self, events: Sequence[DatasetEvent]) -> AcceptResult:
        """Emit events mid-task; :class:`StaleClaim` once the lease is lost."""
        ...

    async def directive(self) -> str:
        """The source directive (``run``/``pause``/``stop``)."""
        ...


class SecretProvider(Protocol):
    """Where a worker's secrets come from (its injected environment, a vault...)."""

    def secrets_for(self, names: Sequence[str], task: Mapping[str, Any]) -> Mapping[str, str]:
        """The values it has among ``names`` for ``task``'s job (missing ones
        are left out; the wrapper fails the attempt naming them)."""
        ...


class StaticSecrets:
    """A :class:`SecretProvider` over a fixed mapping (the same for every job)."""

    def __init__(self, values: Mapping[str, str]) -> None:
        self._values = dict(values)

    def secrets_for(self, names: Sequence[str], task: Mapping[str, Any]) -> Mapping[str, str]:
        """The values of ``names`` that the mapping holds."""
        return {n: self._values[n] for n in names if n in self._values}

    def __repr__(self) -> str:
        return f"StaticSecrets({sorted(self._values)})"  # names only, never values


def check_env_name(name: object, field: str) -> str:
    """``name`` if it may be set in an operator's environment; else
    :class:`~trace_core.errors.ConfigurationError` naming ``field``."""
    if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
        raise ConfigurationError(f"{field}: {name!r} is not an environment variable name [A-Z_0-9]")
    if name in RESERVED_ENV or name.startswith(_RESERVED_PREFIXES):
        raise ConfigurationError(f"{field}: {name!r} is reserved for the platform")
    return name


def declared_secrets(config: Mapping[str, Any]) -> list[str]:
    """The secret names a job declares in ``config["secrets"]``, validated."""
    names = config.get("secrets", [])
    if not isinstance(names, list):
        raise ConfigurationError("config.secrets must be a list of names")
    return [check_env_name(n, f"config.secrets[{i}]") for i, n in enumerate(names)]


class TaskContext(TaskPayload):
    """What an operator gets: the task payload and its fenced calls.

    Asynchronous operators ``await ctx.emit(...)``; synchronous ones (run in a
    worker thread) call :meth:`emit_blocking` and :meth:`directive_blocking`,
    and may call :meth:`check` between units of work to stop promptly once the
    lease is lost (the wrapper abandons the thread; its later calls fail).
    """

    def __init__(
        self,
        payload: Mapping[str, Any],
        control: AttemptControl,
        *,
        secrets: Mapping[str, str] | None = None,
        credentials: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(payload)
        self._control = control
        self.secrets: Mapping[str, str] = dict(secrets or {})
        """The job's declared secrets (``config["secrets"]``), and no others."""
        self.credentials: Mapping[str, str] = dict(credentials or {})
        """Scoped credentials for this attempt (e.g. STS keys), when the worker has a
        broker; re-minted whenever the capability token is renewed (:meth:`renew`)."""
        self.emitted: list[AcceptResult] = []

    @property
    def capability_token(self) -> str | None:
        """The attempt's data-access capability token, when the Dispatcher issued one
        (the current one: heartbeats renew it before it expires)."""
        token = self.payload.get("capability_token")
        return str(token) if token else None

    def renew(self, token: str, credentials: Mapping[str, str] | None) -> None:
        """Adopt a renewed capability token and the credentials minted from it.

        Each is replaced by one assignment, so an operator thread reading
        :attr:`credentials` sees the old or the new set, never a mix; handles
        built from the old set work until it expires, so a long-running
        operator should build its handle from :attr:`credentials` per unit of work.
        """
        self.payload = {**self.payload, "capability_token": token}
        if credentials is not None:
            self.credentials = dict(credentials)

    def check(self) -> None:
        """Raise :class:`StaleClaim` if the attempt has lost its lease."""
        if self._control.lost is not None:
            raise StaleClaim("tasks", self.task_id, f"attempt {self.attempt} {self._control.lost}")

    async def directive(self) -> str:
        """For sources: ``run``, ``pause`` (emit nothing until resumed) or ``stop``
        (finish cleanly and return)."""
        return await self._control.directive()

    async def emit(self, events: Sequence[DatasetEvent]) -> AcceptResult:
        """Emit events mid-task (accepted only while this attempt is current)."""
        result = await self._control.emit(events)
        self.emitted.append(result)
        return result

    def emit_blocking(self, events: Sequence[DatasetEvent]) -> AcceptResult:
        """:meth:`emit` from a synchronous operator's worker thread."""
        self.check()
        return anyio.from_thread.run(self.emit, events)

    def directive_blocking(self) -> str:
        """:meth:`directive` from a synchronous operator's worker thread."""
        self.check()
        return anyio.from_thread.run(self.directive)
