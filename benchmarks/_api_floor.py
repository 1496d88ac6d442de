"""The HTTP path's floor: a minimal ASGI app doing only what a triple must do.

    python -m benchmarks._api_floor --db URL --port PORT [--connections 4]

``benchmarks.api --path floor`` drives it with the same worker processes and
raw client as Trace's paths. It is served the way ``trace-lite serve`` serves
the control plane (uvicorn with its default HTTP parser, httptools when
installed, inside ``anyio.run`` with :func:`~trace_core.api.serving.event_loop_options`,
so uvloop's event loop when installed; no access log, no server header) and
its three routes each run one statement on psycopg directly, in autocommit
(one durable commit each), with no authentication, no request models and no
framework:

- ``POST /claim`` ``{"worker_id"}``: the oldest ``Queued`` task, locked with
  ``FOR UPDATE SKIP LOCKED`` and leased to the worker (a fresh lease token,
  the lease's expiry, ``claim_version`` + 1) in one ``UPDATE … RETURNING``;
- ``POST /heartbeat`` ``{"task_id", "attempt", "lease_token"}``: the lease
  extended, fenced by attempt and token;
- ``POST /complete`` (the same fence): ``Completed``, the lease ended.

A refused fence answers 409. What Trace does beyond this (the attempt record,
capability tokens, pointers, coverage, the completion's outbox rows, request
validation) is what a share of the floor measures. ``GET /healthz`` answers
when the connections are open.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio
import psycopg
import uvicorn

from trace_core.api.serving import event_loop_options
from trace_core.storage.url import parse_database_url

__all__ = ["FloorApp", "main"]

LEASE_SECONDS = 60

_CLAIM = """
UPDATE tasks SET status = 'Running', worker_id = %(worker_id)s, lease_token = gen_random_uuid(),
       lease_expires_at = now() + make_interval(secs => %(lease)s), last_heartbeat = now(),
       started_at = now(), claim_version = claim_version + 1
WHERE id = (SELECT id FROM tasks WHERE status = 'Queued' ORDER BY queued_at
            LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING id, attempt, lease_token"""

_HEARTBEAT = """
UPDATE tasks SET lease_expires_at = now() + make_interval(secs => %(lease)s),
       last_heartbeat = now()
WHERE id = %(task_id)s AND attempt = %(attempt)s AND lease_token = %(lease_token)s
  AND status = 'Running'"""

_COMPLETE = """
UPDATE tasks SET status = 'Completed', completed_at = now(), lease_expires_at = NULL
WHERE id = %(task_id)s AND attempt = %(attempt)s AND lease_token = %(lease_token)s
  AND status = 'Running'"""

Send = Callable[[Mapping[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[Mapping[str, Any]]]
_HEADERS = [(b"content-type", b"application/json")]


class FloorApp:
    """The ASGI app: ``connections`` autocommit connections shared by the requests."""

    def __init__(self, conninfo: str, connections: int) -> None:
        self._conninfo = conninfo
        self._count = connections
        self._idle: asyncio.Queue[psycopg.AsyncConnection[Any]] = asyncio.Queue()
        self._open: list[psycopg.AsyncConnection[Any]] = []

    async def __call__(self, scope: Mapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        status, answer = await self._route(scope["method"], scope["path"], body)
        payload = json.dumps(answer).encode()
        headers = [*_HEADERS, (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                for _ in range(self._count):
                    conn = await psycopg.AsyncConnection.connect(self._conninfo, autocommit=True)
                    self._open.append(conn)
                    self._idle.put_nowait(conn)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for conn in self._open:
                    await conn.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _route(self, method: str, path: str, body: bytes) -> tuple[int, Any]:
        if method == "GET" and path == "/healthz":
            return 200, {"ok": True}
        if method != "POST" or path not in ("/claim", "/heartbeat", "/complete"):
            return 404, {"detail": f"no route {method} {path}"}
        request = json.loads(body)
        conn = await self._idle.get()
        try:
            if path == "/claim":
                params = {"worker_id": request["worker_id"], "lease": LEASE_SECONDS}
                row = await (await conn.execute(_CLAIM, params, prepare=True)).fetchone()
                if row is None:
                    return 200, {"claimed": False}
                return 200, {
                    "claimed": True,
                    "task_id": str(row[0]),
                    "attempt": row[1],
                    "lease_token": str(row[2]),
                }
            fence = {k: request[k] for k in ("task_id", "attempt", "lease_token")}
            statement = _HEARTBEAT if path == "/heartbeat" else _COMPLETE
            done = await conn.execute(statement, {**fence, "lease": LEASE_SECONDS}, prepare=True)
            if done.rowcount != 1:
                return 409, {"detail": "the fence was refused"}
            return 200, {"ok": True}
        finally:
            self._idle.put_nowait(conn)


async def _serve(conninfo: str, port: int, connections: int) -> None:
    config = uvicorn.Config(
        FloorApp(conninfo, connections),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        server_header=False,
    )
    await uvicorn.Server(config).serve()


def main(argv: Sequence[str] | None = None) -> int:
    """Serve the floor app until SIGINT/SIGTERM."""
    p = argparse.ArgumentParser(prog="python -m benchmarks._api_floor", description=__doc__)
    p.add_argument("--db", required=True, help="the Postgres database URL (migrated, with tasks)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--connections", type=int, default=4, help="connections shared by requests")
    args = p.parse_args(argv)
    conninfo = parse_database_url(args.db).conninfo()
    anyio.run(_serve, conninfo, args.port, args.connections, backend_options=event_loop_options())
    return 0


if __name__ == "__main__":
    sys.exit(main())
