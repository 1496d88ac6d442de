"""The requester's webhook endpoint of ``python -m benchmarks.euterpe``, as its own process.

``python -m benchmarks._euterpe_receiver --db sqlite:///r.db --port N`` serves,
on 127.0.0.1 with uvicorn:

- ``POST /hook``: one delivery, checked and recorded by the receiver helper
  (:meth:`~trace_core.euterpe.receiver.WebhookReceiver.verify_and_record`)
  on the receiver's own SQLite file, as a requester would; 200 for a new or
  a duplicate event, the helper's 4xx for a refused one;
- ``GET /processed?from=K``: the event ids processed (first deliveries, in
  commit order) from position ``K`` on, and the counts of duplicates and
  refusals, so the benchmark can check that every event was processed
  exactly once;
- ``GET /health``: 200 once serving.

The requester's secrets come hex-encoded and comma-separated in
``$BENCH_EUTERPE_RECEIVER_SECRETS`` (not the command line, which ``ps`` shows).
:class:`ReceiverProcess` starts and stops it from the benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs

from benchmarks._common import stop_process
from trace_core.euterpe.receiver import WebhookReceiver, read_request_body
from trace_core.security.webhook_signing import WebhookRejected
from trace_core.storage.sql import SqlRepository

__all__ = ["ReceiverProcess", "ReceiverStats", "main"]

SECRETS_ENV = "BENCH_EUTERPE_RECEIVER_SECRETS"
_START_SECONDS = 60.0


class ReceiverStats:
    """What the receiver reported: processed event ids and the other counts."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.processed: list[str] = [str(e) for e in body["processed"]]
        self.duplicates = int(body["duplicates"])
        self.rejected = int(body["rejected"])
        self.total_processed = int(body["total_processed"])


class ReceiverProcess:
    """The receiver as a subprocess on a free loopback port (context manager)."""

    def __init__(self, db_path: Path, secrets: Sequence[bytes], log_file: Path) -> None:
        self.url = f"sqlite:///{db_path}"
        self.secrets = secrets
        self.log_file = log_file
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.hook_url = f"{self.base}/hook"
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ReceiverProcess:
        import httpx

        root = Path(__file__).resolve().parents[1]
        env = {
            **os.environ,
            SECRETS_ENV: ",".join(s.hex() for s in self.secrets),
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p
            ),
        }
        command = [sys.executable, "-m", "benchmarks._euterpe_receiver"]
        command += ["--db", self.url, "--port", str(self.port)]
        with self.log_file.open("wb") as out:
            self._proc = subprocess.Popen(
                command, env=env, cwd=root, stdout=out, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + _START_SECONDS
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError("the receiver exited:\n" + self.log_file.read_text())
            try:
                if httpx.get(f"{self.base}/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self._proc.kill()
                raise RuntimeError(f"the receiver did not start within {_START_SECONDS:g} s")
            time.sleep(0.05)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._proc is not None:
            stop_process(self._proc)

    async def stats(self, start: int = 0) -> ReceiverStats:
        """The receiver's record from processed position ``start`` on."""
        import httpx

        async with httpx.AsyncClient(timeout=30) as client:
            answer = await client.get(f"{self.base}/processed", params={"from": start})
            answer.raise_for_status()
            return ReceiverStats(answer.json())


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


# --- the server process ----------------------------------------------------------


class _App:
    """The ASGI application (module docstring)."""

    def __init__(self, url: str, secrets: Sequence[bytes]) -> None:
        self.url = url
        self.secrets = secrets
        self.processed: list[str] = []
        self.duplicates = 0
        self.rejected = 0
        self._repo: SqlRepository | None = None
        self._receiver: WebhookReceiver | None = None

    async def open(self) -> None:
        self._repo = SqlRepository(self.url)
        self._receiver = WebhookReceiver(self._repo, self.secrets)

    async def close(self) -> None:
        if self._repo is not None:
            await self._repo.close()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = await read_request_body(receive)
        if body is None:
            return  # the client left mid-request: nothing to verify or answer
        path, method = scope["path"], scope["method"]
        if path == "/hook" and method == "POST":
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            status, answer = await self._hook(headers, body)
        elif path == "/processed" and method == "GET":
            query = parse_qs(scope.get("query_string", b"").decode())
            start = int(query.get("from", ["0"])[0])
            status, answer = 200, self._report(start)
        elif path == "/health":
            status, answer = 200, {"ok": True}
        else:
            status, answer = 404, {"error": "not_found", "field": "path", "reason": "no route"}
        data = json.dumps(answer).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": data})

    async def _hook(self, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, Any]]:
        assert self._repo is not None and self._receiver is not None
        try:
            # The helper's records and the "processing" (here: noting the id)
            # commit together, as the helper's docstring asks.
            async with self._repo.transaction() as tx:
                accepted = await self._receiver.verify_and_record(headers, body, tx=tx)
        except WebhookRejected as exc:
            self.rejected += 1
            return exc.http_status, exc.as_json()
        if accepted.duplicate:
            self.duplicates += 1
        else:
            self.processed.append(str(accepted.event_id))
        return 200, {"ok": True}

    def _report(self, start: int) -> dict[str, Any]:
        return {
            "processed": self.processed[start:],
            "total_processed": len(self.processed),
            "duplicates": self.duplicates,
            "rejected": self.rejected,
        }


async def _serve(url: str, port: int, secrets: Sequence[bytes]) -> None:
    import uvicorn

    app = _App(url, secrets)
    await app.open()
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", lifespan="off", access_log=False
        )
    )
    try:
        await server.serve()
    finally:
        await app.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until SIGTERM (module docstring)."""
    import anyio

    from trace_core.storage.migrate import upgrade

    p = argparse.ArgumentParser(prog="python -m benchmarks._euterpe_receiver")
    p.add_argument("--db", required=True, help="the receiver's own database URL")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    raw = os.environ.get(SECRETS_ENV, "")
    if not raw:
        p.error(f"${SECRETS_ENV} must hold the requester's secrets")
    secrets = [bytes.fromhex(part) for part in raw.split(",")]
    upgrade(args.db)
    anyio.run(_serve, args.db, args.port, secrets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
