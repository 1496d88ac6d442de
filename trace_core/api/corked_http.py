"""One socket write per response: uvicorn's HTTP protocol over a corked transport.

uvicorn writes a response's status line and headers when the app sends
``http.response.start`` and its body when the app sends the body: two
``send`` system calls, two TCP segments and two wake-ups of the client for
a worker's small JSON answer. On a busy machine those sends are a large
share of the server's CPU per request. :class:`CorkedTransport` gathers
the writes made within one step of the event loop and hands them to the
socket as one at the end of that step, like ``TCP_CORK`` in user space:
the bytes and their order are unchanged, they only leave together.
:func:`http_protocol` is the protocol class for ``uvicorn.Config(http=...)``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, cast

__all__ = ["CorkedTransport", "http_protocol"]


class CorkedTransport(asyncio.Transport):
    """An asyncio transport whose writes of one loop step leave as one write.

    Everything but the writes goes straight to the wrapped transport;
    :meth:`write_eof`, :meth:`close` and the write-buffer size flush first, so
    nothing written is reordered, lost by a close or hidden from flow control.
    :meth:`abort` drops what is queued, as the wrapped transport drops its buffer.
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Queue ``data``; it leaves at the end of this loop step with the rest."""
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(bytes(data))

    def writelines(self, chunks: Iterable[bytes | bytearray | memoryview]) -> None:
        """Queue each of ``chunks``."""
        for chunk in chunks:
            self.write(chunk)

    def flush(self) -> None:
        """Hand what is queued to the socket now (nothing once it is closing)."""
        if not self._pending:
            return
        data = b"".join(self._pending)
        self._pending.clear()
        if not self._transport.is_closing():
            self._transport.write(data)

    def write_eof(self) -> None:
        """Flush, then close the write side."""
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        """Flush, then close (the transport still sends what it buffered)."""
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        """Close at once, dropping what is queued (as the wrapped transport does)."""
        self._pending.clear()
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        """The wrapped transport's buffer, after a flush."""
        self.flush()
        return self._transport.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        """The wrapped transport's."""
        return self._transport.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        """The wrapped transport's."""
        self._transport.set_write_buffer_limits(high, low)

    def can_write_eof(self) -> bool:
        """The wrapped transport's."""
        return self._transport.can_write_eof()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """The wrapped transport's (socket, peer name, SSL object ...)."""
        return self._transport.get_extra_info(name, default)

    def is_closing(self) -> bool:
        """The wrapped transport's."""
        return self._transport.is_closing()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        """The wrapped transport's (a connection upgrade)."""
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        """The wrapped transport's."""
        return self._transport.get_protocol()

    def is_reading(self) -> bool:
        """The wrapped transport's."""
        return self._transport.is_reading()

    def pause_reading(self) -> None:
        """The wrapped transport's (flow control)."""
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        """The wrapped transport's (flow control)."""
        self._transport.resume_reading()


def http_protocol() -> type[asyncio.Protocol] | str:
    """uvicorn's httptools protocol over a :class:`CorkedTransport`, or
    ``"auto"`` (uvicorn's own choice) when httptools is not installed."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "auto"

    class CorkedHttpToolsProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol writing through a :class:`CorkedTransport`."""

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            # uvloop's transports are not asyncio.Transport subclasses: no isinstance.
            stream = cast(asyncio.Transport, transport)
            super().connection_made(CorkedTransport(stream, self.loop))

    return CorkedHttpToolsProtocol
