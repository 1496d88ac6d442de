"""UDF operators for ``tests/test_udf_isolation.py``: they run in the child process
(``python -m trace_core.worker.udf_child``), imported by path, and take a
:class:`~trace_core.worker.udf_child.UdfContext`.

They use the standard library only, like a tenant's code that knows nothing
of the platform's internals.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

CAPABILITY_TOKEN_ENV = "TRACE_TASK_CAPABILITY_TOKEN"
LINGER_SECONDS = 60.0  # far past any test's patience: only a kill ends it sooner


def _partition(ctx: Any, start: int, end: int) -> dict[str, Any]:
    out = ctx.outputs[0]
    return {
        "dataset_uuid": out["dataset_uuid"],
        "dataset_version": out["dataset_version"],
        "partition_key": f"{start}-{end}",
        "start": start,
        "end": end,
    }


def _sha256(value: str | None) -> str | None:
    return None if value is None else hashlib.sha256(value.encode()).hexdigest()


def _write_pid(ctx: Any) -> None:
    # Atomically (written aside, then renamed): a test that finds the file
    # reads a whole pid even when the child was killed while writing it.
    path = Path(ctx.config["pid_file"])
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(str(os.getpid()))
    os.replace(partial, path)


def _status(url: str, body: dict[str, Any] | None, token: str | None) -> int:
    """The HTTP status of one request to the control plane."""
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def probe(ctx: Any) -> dict[str, Any]:
    """Looks for the platform's credentials, then tries ``/internal/*`` with
    every value it can find (and with none)."""
    base = ctx.config["probe_url"]
    candidates: set[str | None] = {None, ctx.capability_token}
    candidates |= set(os.environ.values()) | set(sys.argv)
    statuses: set[int] = set()
    for token in candidates:
        fetch = f"{base}/internal/task-fetch?task_id={ctx.task_id}"
        statuses.add(_status(fetch, None, token))
        complete = {"task_id": str(ctx.task_id), "attempt": ctx.attempt, "status": "Canceled"}
        statuses.add(_status(f"{base}/internal/task-complete", complete, token))
    found = {
        "env": sorted(os.environ),
        "internal_token": os.environ.get("TRACE_INTERNAL_TOKEN"),
        "database_url": os.environ.get("TRACE_DATABASE_URL"),
        "undeclared_secret": os.environ.get("OTHER_SECRET"),
        "api_key_sha256": _sha256(os.environ.get("API_KEY")),
        "api_key_via_context": _sha256(ctx.secret("API_KEY")),
        "capability_token_sha256": _sha256(os.environ.get(CAPABILITY_TOKEN_ENV)),
        "argv": sys.argv,
        "tried": len(candidates),
        "statuses": sorted(statuses),
        "pid": os.getpid(),
        "cwd": os.getcwd(),
    }
    return {"outputs": [found]}


def relay(ctx: Any) -> dict[str, Any]:
    """Prints noise on stdout (which must not break the protocol), emits one
    partition mid-task and returns another as its final event."""
    print("noise on stdout")
    os.write(1, b"raw noise on descriptor 1\n")
    accepted = ctx.emit([_partition(ctx, 0, 9)])
    return {
        "events": [_partition(ctx, 10, 19)],
        "outputs": [
            {
                "pid": os.getpid(),
                "new": accepted["new"],
                "directive": ctx.directive(),
                "where": [i.get("where") for i in ctx.inputs],
                "undeclared": ctx.secret("OTHER_SECRET"),
            }
        ],
    }


async def async_relay(ctx: Any) -> dict[str, Any]:
    """A coroutine UDF: one final partition, and its pid to prove where it ran."""
    return {"events": [_partition(ctx, 0, 9)], "outputs": [{"pid": os.getpid()}]}


def linger(ctx: Any) -> None:
    """Emits one partition, then keeps running until it is killed."""
    _write_pid(ctx)
    ctx.emit([_partition(ctx, 0, 9)])
    deadline = time.monotonic() + LINGER_SECONDS
    while time.monotonic() < deadline:
        time.sleep(0.05)


def hang(ctx: Any) -> None:
    """Never answers (until killed)."""
    _write_pid(ctx)
    deadline = time.monotonic() + LINGER_SECONDS
    while time.monotonic() < deadline:
        time.sleep(0.05)


def crash(ctx: Any) -> None:
    """Dies without a result."""
    sys.stderr.write("dying words\n")
    sys.stderr.flush()
    os._exit(3)


class _BadInput(ValueError):
    retryable = False


def refuse(ctx: Any) -> None:
    """Fails for good (its exception says it is not retryable)."""
    raise _BadInput("row 7 is malformed")


def bad_emit(ctx: Any) -> None:
    """Emits an event for a dataset its job does not produce; lets the refusal out."""
    event = _partition(ctx, 0, 9)
    event["dataset_uuid"] = "00000000-0000-0000-0000-000000000000"
    ctx.emit([event])
