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

import logging
from collections.abc import Sequence
from typing import Protocol

import anyio
import anyio.abc
import uvicorn
from fastapi import FastAPI

from trace_core.errors import TraceError

__all__ = ["BesideService", "serve_transcode"]

log = logging.getLogger("trace_core.api.transcode")


class BesideService(Protocol):
    """A service run beside the server (the house service shape)."""

    async def start(self, task_group: anyio.abc.TaskGroup) -> None:
        """Start the service's loop in ``task_group``."""
        ...

    async def stop(self) -> None:
        """End the loop and wait for it."""
        ...


async def serve_transcode(
    app: FastAPI,
    *,
    host: str,
    port: int,
    log_level: str,
    beside: Sequence[BesideService] = (),
    shutdown: anyio.Event | None = None,
) -> None:
    """Serve ``app`` on ``host:port`` with ``beside`` running, until the server
    stops (a signal, or ``shutdown`` set: an embedder's graceful stop);
    :class:`TraceError` if a service's task failed (the server was stopped
    because of it)."""
    server = uvicorn.Server(
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
            try:
                # A service whose task raised cancels this (its task group's host).
                await server.serve()
            finally:
                with anyio.CancelScope(shield=True):
                    for service in reversed(beside):
                        await service.stop()
                group.cancel_scope.cancel()  # the shutdown watcher, if any
    except* Exception as failed:
        error = failed.exceptions[0]
        log.critical("a Euterpe service failed; the server stopped", exc_info=error)
        raise TraceError(
            f"a Euterpe service failed ({type(error).__name__}: {error}); the server stopped"
        ) from error
