"""The UDF child process: ``python -m trace_core.worker.udf_child``.

Started by :func:`trace_core.worker.udf.run_udf` with a scrubbed environment.
It speaks JSON lines with the parent, one object per line:

====================================================  =================================
parent -> child (stdin)                               child -> parent (stdout)
====================================================  =================================
``{"type": "start", "udf": "mod:fn", "task": {...}}``
                                                      ``{"type": "emit", "events": [...]}``
``{"type": "emitted", "event_ids", "new",
"duplicates"}`` or ``{"type": "failed", ...}``
                                                      ``{"type": "directive"}``
``{"type": "directive", "value": "run"}``
                                                      ``{"type": "result", "events": [...],
                                                      "outputs": [...] | null}`` or
                                                      ``{"type": "error", "error": "...",
                                                      "retryable": true}``
====================================================  =================================

The protocol owns descriptors 0 and 1: before the UDF runs, they are moved
aside and replaced by ``/dev/null`` and stderr, so whatever the UDF prints
(even from C code) goes to stderr, which the parent drains.

The UDF is ``module:function`` taking a :class:`UdfContext`; it may be a
coroutine function. It returns ``None``, ``{"events": [...], "outputs": [...]}``
or an object with ``events``/``outputs`` attributes; events are
``DatasetEvent`` objects or their JSON shape. Raising fails the attempt
(an exception with ``retryable = False`` fails it terminally).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import IO, Any

from trace_core.authoring.payload import CAPABILITY_TOKEN_ENV, TaskPayload

__all__ = ["EmitRefused", "UdfContext", "main"]


class EmitRefused(RuntimeError):
    """The control plane refused a call made for the UDF (``retryable`` says
    whether another attempt might succeed)."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


class UdfContext(TaskPayload):
    """What a UDF sees: the task document, its environment, and two calls."""

    def __init__(self, task: Mapping[str, Any], channel: _Channel) -> None:
        super().__init__(task)
        self._channel = channel

    @property
    def capability_token(self) -> str | None:
        """The attempt's capability token (from ``TRACE_TASK_CAPABILITY_TOKEN``)."""
        return os.environ.get(CAPABILITY_TOKEN_ENV)

    def secret(self, name: str) -> str | None:
        """A secret the job declared (``config["secrets"]``); ``None`` otherwise."""
        declared = self.config.get("secrets") or []
        return os.environ.get(name) if name in declared else None

    def emit(self, events: Sequence[Any]) -> dict[str, Any]:
        """Emit events mid-task; the parent's answer (``event_ids``, ``new``,
        ``duplicates``). :class:`EmitRefused` if the control plane refused them."""
        answer = self._channel.ask({"type": "emit", "events": [_event_json(e) for e in events]})
        if answer.get("type") != "emitted":
            raise EmitRefused(str(answer.get("error")), retryable=bool(answer.get("retryable")))
        return answer

    def directive(self) -> str:
        """For sources: ``run``, ``pause`` or ``stop``."""
        answer = self._channel.ask({"type": "directive"})
        if answer.get("type") != "directive":
            raise EmitRefused(str(answer.get("error")), retryable=bool(answer.get("retryable")))
        return str(answer["value"])


class _Channel:
    """The protocol's two private descriptors."""

    def __init__(self, incoming: IO[bytes], outgoing: IO[bytes]) -> None:
        self._in = incoming
        self._out = outgoing

    def send(self, message: Mapping[str, Any]) -> None:
        self._out.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")
        self._out.flush()

    def receive(self) -> dict[str, Any]:
        line = self._in.readline()
        if not line:
            raise SystemExit(3)  # the parent went away: nobody to answer
        message = json.loads(line)
        if not isinstance(message, dict):
            raise SystemExit(4)
        return message

    def ask(self, message: Mapping[str, Any]) -> dict[str, Any]:
        self.send(message)
        return self.receive()


def _event_json(event: Any) -> Any:
    to_json = getattr(event, "to_json", None)
    return to_json() if callable(to_json) else event


def _result_json(value: Any) -> dict[str, Any]:
    if value is None:
        return {"type": "result", "events": [], "outputs": None}
    if isinstance(value, Mapping):
        events, outputs = value.get("events") or [], value.get("outputs")
    else:
        events, outputs = getattr(value, "events", ()) or (), getattr(value, "outputs", None)
    return {
        "type": "result",
        "events": [_event_json(e) for e in events],
        "outputs": None if outputs is None else [dict(o) for o in outputs],
    }


def _resolve(path: str) -> Any:
    module_name, _, qualname = path.partition(":")
    target: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _private_channel() -> _Channel:
    """Move the protocol off descriptors 0/1 before any UDF code runs."""
    incoming = os.fdopen(os.dup(0), "rb")
    outgoing = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    return _Channel(incoming, outgoing)


def main() -> int:
    """Run one UDF for one attempt; the exit code says how the protocol went."""
    channel = _private_channel()
    start = channel.receive()
    if start.get("type") != "start":
        return 2
    try:
        function = _resolve(str(start["udf"]))
        ctx = UdfContext(start["task"], channel)
        value = function(ctx)
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
        answer = _result_json(value)
        json.dumps(answer)  # a result that cannot be sent is the UDF's error
    except Exception as exc:
        answer = {
            "type": "error",
            "error": f"{type(exc).__name__}: {exc}",
            "retryable": getattr(exc, "retryable", True) is not False,
        }
    channel.send(answer)
    sys.stdout.flush()
    return 0


async def _awaited(value: Any) -> Any:
    return await value


if __name__ == "__main__":
    sys.exit(main())
