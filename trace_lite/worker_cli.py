"""``trace-lite worker``: pull tasks from worker streams over HTTP and run them.

The loop long-polls ``POST /internal/worker/claim`` for the given streams
(worker queues such as ``trace-ecs-platform``, in priority order). A claim
that returns a job has *already* leased the task: the answer carries the
attempt, the lease token and the payload snapshot. The task is then run by
:meth:`WorkerWrapper.handle_claimed` on that lease (claiming it again by
task id would be refused: ``AlreadyRunning``); every call of the attempt
(heartbeat, emit, complete, fail) goes to a :class:`RetryingClient` over an
:class:`HttpControlPlaneClient`, fenced by the lease. No lease is taken twice.

The internal token comes from ``TRACE_INTERNAL_TOKEN`` only, never from the
command line. SIGTERM (or SIGINT) stops claiming: an idle long-poll is
abandoned at once (a task the server leased for it meanwhile expires and is
retried), a running task is finished and reported, then the process exits 0.
A second signal abandons the running task too (its lease expires).

The loop outlives an outage of the control plane or of its database (a
refused connection, a 503): it logs the first failed claim only, backs off
with jitter (:class:`~trace_core.outage.LoopHealth`) and claims again by
itself once the server answers, logging the recovery once.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import anyio

from trace_core.errors import ConfigurationError
from trace_core.outage import LoopHealth, Sleep
from trace_core.retry import Backoff
from trace_core.worker import (
    ClaimResult,
    ControlPlaneRejected,
    ControlPlaneUnavailable,
    HttpControlPlaneClient,
    RetryingClient,
    WorkerWrapper,
)

if TYPE_CHECKING:
    import httpx

    from trace_core.authoring.operators import OperatorRegistry

__all__ = ["StreamClaimClient", "WorkerConfig", "run_worker", "worker_main"]

log = logging.getLogger("trace_lite.worker")

_CLAIM_BACKOFF = Backoff(base_seconds=0.2, factor=2.0, cap_seconds=10.0, jitter=1.0)
_CLAIM_MARGIN_SECONDS = 10.0
"""Added to ``max_wait`` for the HTTP timeout of a long-poll claim."""


@dataclass(frozen=True)
class WorkerConfig:
    """What ``trace-lite worker`` runs."""

    api: str
    streams: tuple[str, ...]
    worker_id: str
    operators: str | None = None
    max_tasks: int | None = None
    """Stop after handling this many claimed tasks (``None``: run until signalled)."""
    max_wait_ms: int = 10_000
    """Long-poll wait of one claim (the server caps it, 20 s by default)."""
    request_timeout_seconds: float = 30.0


def default_worker_id() -> str:
    """``<host>-<pid>``: unique among the live workers of a fleet."""
    return f"{socket.gethostname()}-{os.getpid()}"


class StreamClaimClient:
    """``POST /internal/worker/claim`` through an existing ``httpx.AsyncClient``.

    Errors follow the worker contract: transport errors, 429 and 5xx raise
    :class:`ControlPlaneUnavailable`; any other refusal
    :class:`ControlPlaneRejected`. The token is only ever put in a header.
    """

    def __init__(self, base_url: str, internal_token: str, http: httpx.AsyncClient) -> None:
        self.base_url = base_url.rstrip("/")
        self._auth = {"Authorization": f"Bearer {internal_token}"}
        self._http = http

    async def claim(
        self, worker_id: str, streams: Sequence[str], max_wait_ms: int
    ) -> ClaimResult | None:
        """The next task of ``streams`` with its lease, or ``None`` after the wait."""
        import httpx

        body = {"worker_id": worker_id, "streams": list(streams), "max_wait_ms": max_wait_ms}
        try:
            response = await self._http.post(
                self.base_url + "/internal/worker/claim",
                json=body,
                headers=self._auth,
                timeout=max_wait_ms / 1000 + _CLAIM_MARGIN_SECONDS,
            )
        except httpx.TransportError as exc:
            raise ControlPlaneUnavailable(f"claim: {type(exc).__name__}") from exc
        status = response.status_code
        try:
            answer: Any = response.json()
        except ValueError:
            answer = None
        if status >= 500 or status == 429 or (status < 300 and not isinstance(answer, dict)):
            raise ControlPlaneUnavailable(f"claim: {status}")
        if status >= 300:
            detail = answer if isinstance(answer, dict) else {}
            raise ControlPlaneRejected(
                status, str(detail.get("error") or "error"), str(detail.get("reason") or "")
            )
        return _claim_result(answer)


def _claim_result(answer: Mapping[str, Any]) -> ClaimResult | None:
    if not answer.get("claimed"):
        return None
    return ClaimResult(
        uuid.UUID(str(answer["job_id"])),
        attempt=int(answer["attempt_id"]),
        lease_token=uuid.UUID(str(answer["lease_token"])),
        lease_expires_at=datetime.fromisoformat(str(answer["lease_expires_at"])),
        task=dict(answer["payload"]),
    )


class _Stop:
    """Signal state: stop claiming; a second signal abandons the running task."""

    def __init__(self) -> None:
        self.requested = False
        self.idle = anyio.CancelScope()
        self.everything = anyio.CancelScope()


async def run_worker(
    config: WorkerConfig,
    token: str,
    operators: OperatorRegistry,
    *,
    sleep: Sleep | None = None,
) -> int:
    """Claim and run tasks until signalled or ``max_tasks`` are handled; the exit code.

    ``sleep`` paces the backoff after a failed claim (tests inject one).
    """
    import httpx

    stop = _Stop()
    handled = 0
    health = LoopHealth(
        f"worker {config.worker_id}",
        logger=log,
        backoff=_CLAIM_BACKOFF,
        sleep=sleep,
        unavailable=(ControlPlaneUnavailable,),
    )
    health.running = True
    async with (
        httpx.AsyncClient(timeout=config.request_timeout_seconds) as http,
        anyio.create_task_group() as group,
    ):
        group.start_soon(_watch_signals, stop)
        streams = StreamClaimClient(config.api, token, http)
        client = RetryingClient(HttpControlPlaneClient(config.api, token, http=http))
        wrapper = WorkerWrapper(client, operators, worker_id=config.worker_id)
        log.info(
            "worker %s polling %s at %s", config.worker_id, ",".join(config.streams), config.api
        )
        with stop.everything:
            while not stop.requested and (config.max_tasks is None or handled < config.max_tasks):
                claim: ClaimResult | None = None
                with anyio.CancelScope() as stop.idle:
                    try:
                        claim = await streams.claim(
                            config.worker_id, config.streams, config.max_wait_ms
                        )
                        health.succeeded()
                    except ControlPlaneUnavailable as exc:
                        await health.backoff_after(exc)
                if claim is None:
                    continue
                # From here the task runs to its report even if a signal arrives.
                stop.idle = anyio.CancelScope()
                try:
                    outcome = await wrapper.handle_claimed(claim)
                except ControlPlaneUnavailable as exc:
                    # Its report could not be delivered within the retry budget:
                    # the lease expires and the task is retried elsewhere.
                    outcome = f"abandoned ({exc})"
                handled += 1
                log.info("task %s attempt %d: %s", claim.task_id, claim.attempt, outcome)
        group.cancel_scope.cancel()
    log.info("worker %s stopped after %d task(s)", config.worker_id, handled)
    return 0


async def _watch_signals(stop: _Stop) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            if stop.requested:
                log.warning("second %s: abandoning the running task", signal.Signals(signum).name)
                stop.everything.cancel()
                return
            log.info("%s: finishing the running task, then stopping", signal.Signals(signum).name)
            stop.requested = True
            stop.idle.cancel()


def worker_main(config: WorkerConfig, environ: Mapping[str, str]) -> int:
    """Read the token from ``TRACE_INTERNAL_TOKEN``, load operators, run the loop."""
    from trace_lite.serve import TOKEN_ENV, load_operators

    token = environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise ConfigurationError(
            f"no internal token: set {TOKEN_ENV} (it is never taken from the command line)"
        )
    if not config.streams or any(not s for s in config.streams):
        raise ConfigurationError("--streams: give one or more comma-separated stream names")
    operators = load_operators(config.operators)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
        )
    try:
        return anyio.run(run_worker, config, token, operators)
    except* ControlPlaneRejected as refused:
        # Raised inside the worker's task group, so it arrives wrapped in a group.
        raise ConfigurationError(
            f"the control plane refused the worker: {refused.exceptions[0]}"
        ) from None
