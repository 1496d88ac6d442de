"""One socket write per response (``trace_core.api.corked_http``): the corked
transport's rules, and uvicorn serving over it on a real socket."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from trace_core.api.corked_http import CorkedTransport, http_protocol

pytestmark = pytest.mark.anyio


@pytest.fixture(params=[{}, {"use_uvloop": True}], ids=["asyncio", "uvloop"])
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """asyncio's loop and uvloop's (``serve``'s), whose transports differ."""
    return "asyncio", request.param


class Recording(asyncio.Transport):
    """The socket end of the corked transport: what reaches it, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.events: list[str] = []
        self.closing = False

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))
        self.events.append("write")

    def close(self) -> None:
        self.closing = True
        self.events.append("close")

    def abort(self) -> None:
        self.closing = True
        self.events.append("abort")

    def is_closing(self) -> bool:
        return self.closing


async def _one_step() -> None:
    await asyncio.sleep(0)  # yields once: the callbacks scheduled so far run


async def test_the_writes_of_one_step_leave_as_one_in_order() -> None:
    socket_end = Recording()
    corked = CorkedTransport(socket_end, asyncio.get_running_loop())
    corked.write(b"HTTP/1.1 200 OK\r\n\r\n")
    corked.writelines([b"{", b"}"])
    assert socket_end.writes == []
    await _one_step()
    assert socket_end.writes == [b"HTTP/1.1 200 OK\r\n\r\n{}"]
    corked.write(b"next")
    await _one_step()
    assert socket_end.writes[1:] == [b"next"]


async def test_a_close_flushes_first_and_an_abort_drops() -> None:
    socket_end = Recording()
    corked = CorkedTransport(socket_end, asyncio.get_running_loop())
    corked.write(b"last words")
    corked.close()
    assert socket_end.events == ["write", "close"] and socket_end.writes == [b"last words"]
    corked.write(b"after the close")
    await _one_step()
    assert socket_end.writes == [b"last words"]  # nothing is written to a closing transport

    other = Recording()
    aborted = CorkedTransport(other, asyncio.get_running_loop())
    aborted.write(b"dropped")
    aborted.abort()
    await _one_step()
    assert other.events == ["abort"]


async def test_uvicorn_serves_over_it_on_a_real_socket() -> None:
    big = b"x" * (1 << 20)  # past any socket buffer: flow control engages

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        message = await receive()
        body = big if scope["path"] == "/big" else message.get("body", b"")
        headers = [(b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    # Listening before the server starts: the client's connection waits in the
    # backlog, so nothing has to wait for the server to be up.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    protocol = http_protocol()
    assert not isinstance(protocol, str)  # httptools is installed with the http extra
    config = uvicorn.Config(app, http=protocol, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            for i in range(20):  # one keep-alive connection
                answer = await client.post("/echo", content=f"request {i}".encode())
                assert answer.status_code == 200 and answer.content == f"request {i}".encode()
            assert (await client.get("/big")).content == big
    finally:
        server.should_exit = True
        await serving
        listener.close()
