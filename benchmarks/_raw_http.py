"""A minimal HTTP/1.1 JSON client for the benchmarks' worker processes.

One keep-alive connection, one request in flight, ``Content-Length`` bodies
only (what ``trace-lite serve`` answers on the worker routes). It exists so
that ``benchmarks.api --client raw`` measures the server rather than the
client library: an ``httpx.AsyncClient`` request costs a few milliseconds of
client CPU on the development machine, as much as the server's work, and
four worker processes of it on two cores starve the server they measure.
It offers the part of ``httpx.AsyncClient`` the benchmark uses: ``post``
answering an object with ``status_code``, ``json()`` and ``raise_for_status()``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

__all__ = ["RawClient", "RawResponse"]


class RawResponse:
    """A response: status and body."""

    def __init__(self, status_code: int, body: bytes) -> None:
        self.status_code = status_code
        self.content = body

    def json(self) -> Any:
        """The body, decoded."""
        return json.loads(self.content)

    def raise_for_status(self) -> None:
        """Raise for a status of 400 or more, with the body."""
        if self.status_code >= 400:
            raise RuntimeError(f"HTTP {self.status_code}: {self.content[:500]!r}")


class RawClient:
    """``async with RawClient(base, headers=...) as client: await client.post(...)``."""

    def __init__(self, base_url: str, *, headers: Mapping[str, str] | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or parts.hostname is None or parts.port is None:
            raise ValueError(f"an http://host:port base URL is required, got {base_url!r}")
        self._host, self._port = parts.hostname, parts.port
        self._headers = dict(headers or {})
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> RawClient:
        self._reader, self._writer = await asyncio.open_connection(self._host, self._port)
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._writer is not None:
            self._writer.close()
            await self._writer.wait_closed()

    async def post(
        self, path: str, *, json: Any = None, headers: Mapping[str, str] | None = None
    ) -> RawResponse:
        """``POST path`` with ``json`` as the body; the response."""
        assert self._reader is not None and self._writer is not None, "use async with"
        body = _dumps(json)
        fields = {**self._headers, **(headers or {})}
        head = [f"POST {path} HTTP/1.1", f"Host: {self._host}:{self._port}"]
        head += [f"{name}: {value}" for name, value in fields.items()]
        head += ["Content-Type: application/json", f"Content-Length: {len(body)}", "", ""]
        self._writer.write("\r\n".join(head).encode("latin-1") + body)
        status_line = await self._reader.readuntil(b"\r\n")
        status = int(status_line.split(b" ", 2)[1])
        length = None
        while True:
            line = await self._reader.readuntil(b"\r\n")
            if line == b"\r\n":
                break
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        if length is None:
            raise RuntimeError(f"POST {path}: the answer has no Content-Length")
        return RawResponse(status, await self._reader.readexactly(length))


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()
