"""Serving the control plane with its Dispatcher: what every profile's ``serve`` does.

:func:`serve_dispatcher` runs :func:`~trace_core.api.app.create_app` on
uvicorn with the Dispatcher's services in the app's lifespan, and stops the
server, then raises, should those services fail: a process is never left
answering HTTP with no Dispatcher behind it (``trace-lite serve`` and
``trace-aws serve`` exit with the error). Services of the profile itself
(the lite buffer sink) run beside the server and stop with it. Each response
leaves in one socket write (:mod:`~trace_core.api.corked_http`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import uvicorn

from trace_core.api.app import create_app
from trace_core.api.corked_http import http_protocol
from trace_core.dispatcher.periodic import PeriodicService
from trace_core.dispatcher.service import Dispatcher
from trace_core.errors import TraceError

__all__ = ["event_loop_options", "serve_dispatcher"]


def event_loop_options() -> dict[str, Any]:
    """``anyio.run`` backend options of a serving process: uvloop's event loop
    when it is installed (the ``http`` extra), else asyncio's own.

    A worker's request is a few short statements and a few socket writes, so
    the event loop's own work (registering the driver's socket for each
    statement's answer, the sends, the polling) is a large share of the
    server's CPU per request; libuv does it in C.
    """
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return {}
    return {"use_uvloop": True}


async def serve_dispatcher(
    dispatcher: Dispatcher,
    *,
    host: str,
    port: int,
    log_level: str,
    beside: Sequence[PeriodicService] = (),
    **app_options: Any,
) -> None:
    """Serve the control-plane app on ``host:port`` until the server stops.

    ``app_options`` are :func:`~trace_core.api.app.create_app`'s (the
    internal token, the verifier, the minter, ...); ``beside`` are services
    started before the server and stopped after it. Raises
    :class:`~trace_core.errors.TraceError` naming the failure when the
    Dispatcher's services failed (the server was stopped because of it).
    """
    failures: list[BaseException] = []

    def dispatcher_failed(exc: BaseException) -> None:
        failures.append(exc)
        server.should_exit = True

    app = create_app(
        dispatcher, run_dispatcher=True, on_dispatcher_failure=dispatcher_failed, **app_options
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            access_log=log_level == "debug",
            lifespan="on",
            server_header=False,
            http=http_protocol(),
        )
    )
    async with anyio.create_task_group() as group:
        for service in beside:
            await service.start(group)
        await server.serve()
        for service in beside:
            await service.stop()
    if failures:
        error = failures[0]
        raise TraceError(
            f"the Dispatcher's services failed ({type(error).__name__}: {error}); "
            "the server stopped"
        ) from error
