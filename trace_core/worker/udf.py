"""Untrusted operators (UDFs) in a child process: the parent side.

The worker wrapper holds the internal token; the UDF must not. So an
untrusted operator runs in ``python -m trace_core.worker.udf_child`` with an
environment built from scratch (:func:`child_environment`): ``PATH``,
``HOME``, ``LANG``, ``PYTHONPATH`` (for imports), the attempt's capability
token as ``TRACE_TASK_CAPABILITY_TOKEN``, the job's declared secrets and the
attempt's scoped credentials; nothing else. The command line carries no
credential either, no descriptor is inherited, and the child starts in a
fresh scratch directory as the leader of its own process group.

The conversation is JSON lines (see :mod:`trace_core.worker.udf_child`): the
task context goes in on stdin, mid-task ``emit``/``directive`` requests come
out on stdout and are answered on stdin, and the last line out is the result
or the error. The parent validates everything the child says (it is
untrusted input) and forwards emits through the wrapper's fenced attempt, so
a stale lease answers the child by killing it. A cancellation (stale lease,
timeout) kills the whole process group at once.

Which code runs is decided by the worker's operator registry, never by the job:
an :class:`UdfOperator` names its function by import path (``module:function``),
resolved in the child. A job's config cannot choose the import path.

Limits of the boundary: the environment, argv and descriptors. A child running
under the wrapper's own uid can still read ``/proc/<wrapper pid>/environ`` and
memory where the kernel allows it (always for root). In production run
children as a dedicated user (``UdfConfig.run_as_user``) or in their own
container.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

from trace_core.authoring.context import (
    CAPABILITY_TOKEN_ENV,
    OperatorError,
    OperatorResult,
    TaskContext,
    check_env_name,
)
from trace_core.authoring.events import parse_events
from trace_core.errors import ConfigurationError, InvalidInput
from trace_core.worker.client import ControlPlaneRejected, ControlPlaneUnavailable

__all__ = [
    "CHILD_MODULE",
    "INHERITED_ENV",
    "UdfConfig",
    "UdfOperator",
    "child_environment",
    "run_udf",
]

log = logging.getLogger(__name__)

CHILD_MODULE = "trace_core.worker.udf_child"
INHERITED_ENV = ("PATH", "HOME", "LANG")
"""The only variables copied from the wrapper's environment into a child."""


class UdfOperator:
    """An operator implementation that only ever runs in a UDF child process.

    Register it as ``OperatorSpec(name, UdfOperator("package.module:function"))``;
    the function takes a :class:`~trace_core.worker.udf_child.UdfContext`.
    Calling it in-process is refused.
    """

    def __init__(self, import_path: str) -> None:
        module, sep, function = import_path.partition(":")
        if not sep or not module or not function or "<" in function:
            raise ConfigurationError(f"UDF import path {import_path!r} is not 'module:function'")
        self.import_path = import_path

    def __call__(self, ctx: Any) -> Any:
        raise ConfigurationError(f"UDF {self.import_path} runs only in a child process")

    def __repr__(self) -> str:
        return f"UdfOperator({self.import_path!r})"


@dataclass(frozen=True)
class UdfConfig:
    """How UDF children are launched."""

    python: str = sys.executable
    """The interpreter (its virtual environment provides the installed packages)."""
    pythonpath: Sequence[str] | None = None
    """Import roots of the child; ``None`` passes the wrapper's own ``PYTHONPATH``."""
    run_as_user: str | int | None = None
    """Run children as this user (the wrapper must be root); see the module docstring."""
    run_as_group: str | int | None = None
    scratch_root: str | None = None
    """Where per-attempt scratch directories are made (the system temp dir by default)."""
    exit_grace_seconds: float = 5.0
    """How long a child that answered may take to exit before it is killed."""
    max_message_bytes: int = 16 << 20
    """Longest JSON line accepted from a child."""
    stderr_tail_bytes: int = 4096
    """How much of a crashed child's stderr goes into the failure message."""

    def __post_init__(self) -> None:
        if self.exit_grace_seconds < 0:
            raise ConfigurationError("UdfConfig.exit_grace_seconds must be >= 0")
        if self.max_message_bytes < 1024:
            raise ConfigurationError("UdfConfig.max_message_bytes must be >= 1024")
        if self.stderr_tail_bytes < 0:
            raise ConfigurationError("UdfConfig.stderr_tail_bytes must be >= 0")


def child_environment(
    *,
    capability_token: str | None,
    secrets: Mapping[str, str],
    credentials: Mapping[str, str],
    pythonpath: Sequence[str] | None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The complete environment of a UDF child (see the module docstring).

    ``base`` is the wrapper's environment (``os.environ``); only
    :data:`INHERITED_ENV` is taken from it. A secret and a credential of the
    same name is a configuration error, not a silent override.
    """
    source = os.environ if base is None else base
    env = {name: source[name] for name in INHERITED_ENV if name in source}
    path = os.pathsep.join(pythonpath) if pythonpath is not None else source.get("PYTHONPATH")
    if path:
        env["PYTHONPATH"] = path
    if capability_token:
        env[CAPABILITY_TOKEN_ENV] = capability_token
    for what, values in (("secrets", secrets), ("credentials", credentials)):
        for name, value in values.items():
            check_env_name(name, what)
            if name in env:
                raise ConfigurationError(f"{what}: {name!r} is set twice in the UDF environment")
            env[name] = value
    return env


async def run_udf(import_path: str, ctx: TaskContext, config: UdfConfig) -> OperatorResult:
    """Run the UDF at ``import_path`` in a child process for ``ctx``'s attempt.

    Returns its result, raises :class:`OperatorError` when it failed (with the
    child's retry choice) or broke the protocol, and lets
    :class:`~trace_core.errors.StaleClaim` from a forwarded call through. The
    child is dead when this returns or raises, cancellation included.
    """
    env = child_environment(
        capability_token=ctx.capability_token,
        secrets=ctx.secrets,
        credentials=ctx.credentials,
        pythonpath=config.pythonpath,
    )
    # The token travels in the environment only, never in the task document.
    task = {k: v for k, v in ctx.payload.items() if k != "capability_token"}
    scratch = tempfile.mkdtemp(prefix="trace-udf-", dir=config.scratch_root)
    try:
        if config.run_as_user is not None:
            shutil.chown(scratch, user=config.run_as_user, group=config.run_as_group)
        ids: dict[str, Any] = {}
        if config.run_as_user is not None:
            ids["user"] = config.run_as_user
        if config.run_as_group is not None:
            ids["group"] = config.run_as_group
        process = await anyio.open_process(
            [config.python, "-m", CHILD_MODULE],
            env=env,
            cwd=scratch,
            start_new_session=True,
            **ids,
        )
        return await _Conversation(process, import_path, ctx, config).run(task)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


class _Conversation:
    """One child's lifetime: the JSON-lines exchange, then its certain death."""

    def __init__(
        self, process: anyio.abc.Process, path: str, ctx: TaskContext, config: UdfConfig
    ) -> None:
        assert process.stdin and process.stdout and process.stderr
        self.process = process
        self.path = path
        self.ctx = ctx
        self.config = config
        self.stdin = process.stdin
        self.stdout = BufferedByteReceiveStream(process.stdout)
        self.stderr = bytearray()
        self.stderr_done = anyio.Event()
        self.answered = False

    async def run(self, task: Mapping[str, Any]) -> OperatorResult:
        outcome: OperatorResult | Exception
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._drain_stderr)
                try:
                    outcome = await self._exchange(task)
                except Exception as exc:
                    # Raised after the group, so it is not wrapped in an ExceptionGroup.
                    outcome = exc
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._reap()
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def _exchange(self, task: Mapping[str, Any]) -> OperatorResult:
        await self._send({"type": "start", "udf": self.path, "task": task})
        while True:
            message = await self._receive()
            kind = message.get("type")
            if kind == "result":
                self.answered = True
                return _result(message, self.path)
            if kind == "error":
                self.answered = True
                retryable = message.get("retryable", True) is not False
                raise OperatorError(f"UDF {self.path}: {message.get('error')}", retryable=retryable)
            if kind == "emit":
                await self._send(await self._forward_emit(message.get("events")))
            elif kind == "directive":
                await self._send(await self._forward_directive())
            else:
                raise OperatorError(f"UDF {self.path}: unknown message {kind!r}", retryable=False)

    async def _forward_emit(self, docs: object) -> dict[str, Any]:
        """Emit for the child through the fenced attempt. Refusals are answered;
        a stale lease is not: it propagates and the child is killed."""

        try:
            events = parse_events(docs)
        except InvalidInput as exc:
            return _refusal(exc)
        try:
            accepted = await self.ctx.emit(events)
        except _ANSWERED as exc:
            return _refusal(exc)
        return {
            "type": "emitted",
            "event_ids": [str(i) for i in accepted.event_ids],
            "new": accepted.new,
            "duplicates": accepted.duplicates,
        }

    async def _forward_directive(self) -> dict[str, Any]:
        try:
            return {"type": "directive", "value": await self.ctx.directive()}
        except _ANSWERED as exc:
            return _refusal(exc)

    async def _send(self, message: Mapping[str, Any]) -> None:
        line = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        try:
            await self.stdin.send(line)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            await self._crashed()

    async def _receive(self) -> dict[str, Any]:
        try:
            line = await self.stdout.receive_until(b"\n", self.config.max_message_bytes)
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
            await self._crashed()
        except anyio.DelimiterNotFound:
            raise OperatorError(
                f"UDF {self.path}: a message over {self.config.max_message_bytes} bytes",
                retryable=False,
            ) from None
        try:
            message = json.loads(line)
        except ValueError:
            message = None
        if not isinstance(message, dict):
            raise OperatorError(f"UDF {self.path}: malformed protocol message", retryable=False)
        return message

    async def _crashed(self) -> NoReturn:
        """The child went away without an answer: its exit code and last words."""
        with anyio.move_on_after(self.config.exit_grace_seconds):
            await self.process.wait()
            await self.stderr_done.wait()
        tail = bytes(self.stderr[-self.config.stderr_tail_bytes :]).decode(errors="replace")
        code = self.process.returncode
        raise OperatorError(f"UDF {self.path} exited ({code}) without a result: {tail.strip()}")

    async def _drain_stderr(self) -> None:
        """Keep the child's stderr flowing (a full pipe would block it); keep the tail."""
        assert self.process.stderr is not None
        try:
            async for chunk in self.process.stderr:
                self.stderr += chunk
                del self.stderr[: -max(self.config.stderr_tail_bytes, 1)]
                log.debug("UDF %s stderr: %r", self.path, chunk[:1024])
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        finally:
            self.stderr_done.set()

    async def _reap(self) -> None:
        process = self.process
        if self.answered and process.returncode is None:
            with anyio.move_on_after(self.config.exit_grace_seconds):
                await process.wait()
        if process.returncode is None:
            # Not reaped yet, so the group id cannot have been reused: kill the
            # child and anything it started.
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
        await process.aclose()


_ANSWERED = (InvalidInput, ControlPlaneRejected, ControlPlaneUnavailable)
"""Refusals of a forwarded call that the child hears about (and may handle)."""


def _refusal(exc: Exception) -> dict[str, Any]:
    return {
        "type": "failed",
        "error": str(exc),
        "retryable": isinstance(exc, ControlPlaneUnavailable),
    }


def _result(message: Mapping[str, Any], path: str) -> OperatorResult:
    """The child's result, validated like any untrusted input."""

    docs = message.get("events") or []
    outputs = message.get("outputs")
    try:
        events = parse_events(docs, "events") if docs else []
    except InvalidInput as exc:
        raise OperatorError(f"UDF {path} returned invalid events: {exc}", retryable=False) from None
    if outputs is not None and (
        not isinstance(outputs, list) or not all(isinstance(o, dict) for o in outputs)
    ):
        raise OperatorError(f"UDF {path}: outputs must be a list of objects", retryable=False)
    return OperatorResult(events=events, outputs=outputs)
