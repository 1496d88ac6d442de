"""Serving Euterpe's app with its services beside it: what every profile's
``euterpe serve`` does.

:func:`serve_transcode` starts the services (the webhook deliverer, the
maintenance loop, optionally in-process workers: anything with
``start(task_group)`` / ``stop()``), serves the app on uvicorn until it is
told to stop (SIGINT/SIGTERM), then stops the services in reverse order. A
service loop that ends with an error stops the server too: a process must not
answer ``POST /transcode`` while nothing delivers or maintains its jobs.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Iterator, Sequence
from typing import Protocol

import anyio
import anyio.abc
import uvicorn
from fastapi import FastAPI

from trace_core.errors import TraceError

__all__ = ["BesideService", "serve_transcode"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)

log = logging.getLogger("trace_core.api.transcode")


class BesideService(Protocol):
    """A service run beside the server (the house service shape)."""

    async def start(self, task_group: anyio.abc.TaskGroup) -> None:
        """Start the service's loop in ``task_group``."""
        ...

    async def stop(self) -> None:
        """End the loop and wait for it."""
        ...


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves signals to its embedder: uvicorn's own
    handling re-raises the signal once the server has stopped, which would end
    the process before the services beside it are stopped (an in-process
    worker could not hand its jobs back)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_transcode(
    app: FastAPI,
    *,
    host: str,
    port: int,
    log_level: str,
    beside: Sequence[BesideService] = (),
    shutdown: anyio.Event | None = None,
    handle_signals: bool = True,
) -> None:
    """Serve ``app`` on ``host:port`` with ``beside`` running, until SIGINT or
    SIGTERM (with ``handle_signals``) or ``shutdown`` is set, then stop
    gracefully: the server first, then the services, in reverse order.
    :class:`TraceError` if a service's task failed (the server was stopped
    because of it)."""
    server = _EmbeddedServer(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            access_log=log_level == "debug",
            lifespan="off",
            server_header=False,
        )
    )
    try:
        async with anyio.create_task_group() as group:
            for service in beside:
                await service.start(group)
            if shutdown is not None:

                async def stop_when_told() -> None:
                    await shutdown.wait()
                    server.should_exit = True

                group.start_soon(stop_when_told)
            if handle_signals:

                async def stop_on_signal() -> None:
                    with anyio.open_signal_receiver(*_SIGNALS) as signals:
                        async for signum in signals:
                            log.info("%s: stopping", signal.Signals(signum).name)
                            server.should_exit = True

                group.start_soon(stop_on_signal)
            try:
                # A service whose task raised cancels this (its task group's host).
                await server.serve()
            finally:
                with anyio.CancelScope(shield=True):
                    for service in reversed(beside):
                        await service.stop()
                group.cancel_scope.cancel()  # the shutdown and signal watchers
    except* Exception as failed:
        error = failed.exceptions[0]
        log.critical("a Euterpe service failed; the server stopped", exc_info=error)
        raise TraceError(
            f"a Euterpe service failed ({type(error).__name__}: {error}); the server stopped"
        ) from error
