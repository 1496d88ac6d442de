"""The worker wrapper: the protection boundary between the Dispatcher and operator code.

:meth:`WorkerWrapper.handle_wakeup` is what a worker does with a wake-up
(an SQS message, an in-process hand-off): claim the task; if not claimed,
return the reason (the caller acks the message and moves on); if the task
turns out canceled, acknowledge that without running anything; otherwise run
the operator with a :class:`~trace_core.authoring.context.TaskContext` while
heartbeating every ``lease_ttl * heartbeat_fraction``, then report: complete
with the final events (mid-task events went through ``emit`` and were
accepted before), or fail.

Long attempts: a heartbeat presents the attempt's capability token and, once
it nears its expiry, gets a renewed one; the wrapper mints credentials from
it and swaps both into the task context (:meth:`TaskContext.renew`), so the
context's token and credentials stay valid for as long as the lease is held.
(A UDF child keeps what it was launched with.)

A stale lease, seen by a heartbeat, an emit or a directive, aborts the work:
an async operator is cancelled, a thread is abandoned (its later calls fail),
a UDF child is killed; nothing more is written. Trusted operators run in this
process (async, or sync in a worker thread); untrusted ones (an
:class:`~trace_core.worker.udf.UdfOperator`, or a name in ``untrusted``) in a
child process without the wrapper's credentials (:mod:`trace_core.worker.udf`).

Outcomes: ``completed``, ``failed``, ``canceled``, ``stale`` (the lease was
refused as no longer current), ``abandoned`` (the control plane could not be
reached to confirm or report; the lease will expire and the task be retried),
or the claim's refusal reason (``AlreadyRunning``, ``Completed``, ``Canceled``...).
"""

from __future__ import annotations

import functools
import inspect
import logging
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping
from datetime import datetime
from typing import Any

import anyio
import anyio.to_thread

from trace_core.authoring.context import (
    OperatorError,
    OperatorResult,
    SecretProvider,
    StaticSecrets,
    TaskContext,
    declared_secrets,
)
from trace_core.authoring.operators import OperatorRegistry, OperatorSpec
from trace_core.clock import Clock, SystemClock
from trace_core.errors import ConfigurationError, InvalidInput, NotFound, StaleClaim
from trace_core.worker.attempt import Attempt, AttemptSettings
from trace_core.worker.client import (
    ClaimResult,
    ControlPlaneClient,
    ControlPlaneRejected,
    ControlPlaneUnavailable,
)
from trace_core.worker.current import running
from trace_core.worker.udf import UdfConfig, UdfOperator, run_udf

__all__ = [
    "ABANDONED",
    "CANCELED",
    "COMPLETED",
    "FAILED",
    "STALE",
    "CredentialSource",
    "WorkerWrapper",
]

log = logging.getLogger(__name__)

COMPLETED = "completed"
FAILED = "failed"
CANCELED = "canceled"
STALE = "stale"
ABANDONED = "abandoned"

_MAX_ERROR = 8_192  # characters of an error message sent to the Dispatcher

CredentialSource = Callable[[Mapping[str, Any]], Awaitable[Mapping[str, str]]]
"""Scoped credentials for one attempt, from its payload (e.g. a Credential
Broker exchanging the capability token for STS keys)."""


class WorkerWrapper:
    """Claims, runs and reports tasks through a :class:`ControlPlaneClient`.

    ``secrets`` supplies the values of the secret names jobs declare;
    ``untrusted`` names operators that must run in a UDF child (besides
    every :class:`UdfOperator`); ``credentials`` mints scoped credentials per
    attempt. ``timeout_seconds`` bounds an operator's run (the attempt then
    fails, retryably). ``clock`` and ``sleep`` drive the heartbeat schedule
    (tests inject both); ``heartbeat_seconds`` fixes the period instead of
    deriving it from the lease.
    """

    def __init__(
        self,
        client: ControlPlaneClient,
        operators: OperatorRegistry,
        *,
        worker_id: str,
        heartbeat_fraction: float = 1 / 3,
        heartbeat_seconds: float | None = None,
        min_heartbeat_seconds: float = 0.5,
        directive_refresh_seconds: float = 1.0,
        timeout_seconds: float | None = None,
        secrets: Mapping[str, str] | SecretProvider | None = None,
        untrusted: Collection[str] = (),
        credentials: CredentialSource | None = None,
        udf: UdfConfig | None = None,
        clock: Clock | None = None,
        sleep: Callable[[float], Awaitable[None]] | None = None,
    ) -> None:
        if timeout_seconds is not None and timeout_seconds <= 0:
            raise ConfigurationError("WorkerWrapper.timeout_seconds must be > 0")
        self.client = client
        self.operators = operators
        self.worker_id = worker_id
        self.settings = AttemptSettings(
            heartbeat_fraction=heartbeat_fraction,
            heartbeat_seconds=heartbeat_seconds,
            min_heartbeat_seconds=min_heartbeat_seconds,
            directive_refresh_seconds=directive_refresh_seconds,
        )
        self.timeout_seconds = timeout_seconds
        self.secrets: SecretProvider = (
            StaticSecrets({})
            if secrets is None
            else StaticSecrets(secrets)
            if isinstance(secrets, Mapping)
            else secrets
        )
        self.untrusted = frozenset(untrusted)
        self.credentials = credentials
        self.udf = udf or UdfConfig()
        self.clock: Clock = clock or SystemClock()
        self.sleep = sleep or anyio.sleep

    async def handle_wakeup(self, task_id: uuid.UUID) -> str:
        """Handle one wake-up for ``task_id``; the outcome (module docstring).

        Raises only when the claim itself could not be made (the control plane
        is unreachable or refused the worker): the wake-up should then be
        redelivered rather than acknowledged.
        """
        return await self.handle_claimed(await self.client.claim(task_id, self.worker_id))

    async def handle_claimed(self, claim: ClaimResult) -> str:
        """Run the attempt ``claim`` leased (made by :meth:`handle_wakeup`, or
        elsewhere, e.g. by a stream claim); the outcome (module docstring).

        A claim that was not granted runs nothing and is its reason.
        """
        task_id = claim.task_id
        if not claim.claimed:
            log.debug("task %s not claimed: %s", task_id, claim.reason)
            return claim.reason or "NotClaimed"
        try:
            payload = claim.task if claim.task is not None else await self.client.fetch(task_id)
            if payload.get("status") == "Canceled":
                # Canceled between the claim and the payload read: run nothing.
                await self.client.report_canceled(task_id, claim.attempt)
                return CANCELED
        except (StaleClaim, NotFound):
            return STALE
        except (ControlPlaneUnavailable, ControlPlaneRejected) as exc:
            log.warning("task %s: cannot read or acknowledge: %s", task_id, exc)
            return ABANDONED
        return await self._run(self._attempt(claim, payload), payload)

    def _attempt(self, claim: ClaimResult, payload: Mapping[str, Any]) -> Attempt:
        expires: datetime = claim.lease_expires_at or self.clock.now()
        token = payload.get("capability_token")
        return Attempt(
            self.client,
            claim.fence,
            expires,
            settings=self.settings,
            clock=self.clock,
            capability_token=str(token) if token else None,
        )

    async def _run(self, attempt: Attempt, payload: dict[str, Any]) -> str:
        try:
            spec = self.operators.get(str(payload.get("operator")))
        except ConfigurationError as exc:
            # Retryable: another worker (a newer build) may have the operator.
            return await self._fail(attempt, _message(exc), retryable=True)
        try:
            secrets = self._secrets(payload)
        except ConfigurationError as exc:
            return await self._fail(attempt, _message(exc), retryable=False)
        try:
            credentials = await self.credentials(payload) if self.credentials else None
        except Exception as exc:
            return await self._fail(attempt, f"credentials: {_message(exc)}", retryable=True)
        ctx = TaskContext(payload, attempt, secrets=secrets, credentials=credentials)
        attempt.on_renewed = functools.partial(self._renew, ctx)
        result: Any = None
        error: Exception | None = None
        async with anyio.create_task_group() as group:
            with attempt.work:
                group.start_soon(self._heartbeats, attempt)
                try:
                    with anyio.move_on_after(self.timeout_seconds) as limit:
                        result = await self._execute(spec, ctx)
                    if limit.cancelled_caught:
                        error = OperatorError(f"timed out after {self.timeout_seconds}s")
                except Exception as exc:
                    error = exc
            group.cancel_scope.cancel()
        lost = attempt.lost
        attempt.close()
        if lost is not None or isinstance(error, StaleClaim):
            # Whatever the operator made of it: the lease is gone, write nothing.
            log.info("task %s attempt %d %s", attempt.task_id, attempt.attempt, lost or STALE)
            return lost or STALE
        if error is not None:
            log.warning("task %s attempt %d failed: %r", attempt.task_id, attempt.attempt, error)
            return await self._fail(
                attempt, _message(error), retryable=getattr(error, "retryable", True) is not False
            )
        final = result if isinstance(result, OperatorResult) else OperatorResult()
        try:
            await self.client.complete(attempt.fence, final.events, final.outputs)
        except InvalidInput as exc:
            return await self._fail(attempt, f"invalid result: {exc}", retryable=False)
        except (StaleClaim, NotFound):
            return STALE
        except (ControlPlaneUnavailable, ControlPlaneRejected) as exc:
            log.warning("task %s: completion not reported: %s", attempt.task_id, exc)
            return ABANDONED
        return COMPLETED

    async def _renew(self, ctx: TaskContext, token: str) -> None:
        """Mint credentials from a renewed token, then swap both into ``ctx``."""
        renewed = {**ctx.payload, "capability_token": token}
        credentials = await self.credentials(renewed) if self.credentials else None
        ctx.renew(token, credentials)
        log.info("task %s attempt %d: capability renewed", ctx.task_id, ctx.attempt)

    async def _execute(self, spec: OperatorSpec, ctx: TaskContext) -> Any:
        with running(ctx):  # the attempt's services find its token (worker.current)
            return await self._dispatch(spec, ctx)

    async def _dispatch(self, spec: OperatorSpec, ctx: TaskContext) -> Any:
        run = spec.run
        if isinstance(run, UdfOperator):
            return await run_udf(run.import_path, ctx, self.udf)
        if spec.name in self.untrusted:
            return await run_udf(_import_path(run), ctx, self.udf)
        if inspect.iscoroutinefunction(run):
            return await run(ctx)
        # A thread cannot be stopped: on a lost lease it is abandoned, and its
        # context refuses every further call.
        return await anyio.to_thread.run_sync(run, ctx, abandon_on_cancel=True)

    async def _heartbeats(self, attempt: Attempt) -> None:
        while attempt.lost is None:
            await self.sleep(attempt.heartbeat_delay())
            try:
                await attempt.heartbeat()
            except StaleClaim:
                return  # the attempt is marked lost and its work cancelled

    async def _fail(self, attempt: Attempt, error: str, *, retryable: bool) -> str:
        try:
            await self.client.fail(attempt.fence, error, retryable)
        except (StaleClaim, NotFound):
            return STALE
        except (ControlPlaneUnavailable, ControlPlaneRejected, InvalidInput) as exc:
            log.warning("task %s: failure not reported: %s", attempt.task_id, exc)
            return ABANDONED
        return FAILED

    def _secrets(self, payload: Mapping[str, Any]) -> dict[str, str]:
        """The job's declared secrets; a missing one fails the attempt for good."""
        names = declared_secrets(payload.get("config") or {})
        if not names:
            return {}
        found = dict(self.secrets.secrets_for(names, payload))
        missing = [n for n in names if n not in found]
        if missing:
            raise ConfigurationError(f"secrets not available to this worker: {missing}")
        return {n: found[n] for n in names}


def _import_path(run: Callable[..., Any]) -> str:
    """``module:qualname`` of a module-level function, for the UDF child to import."""
    module = getattr(run, "__module__", None)
    qualname = getattr(run, "__qualname__", "")
    if not module or module == "__main__" or not qualname or "<" in qualname:
        raise ConfigurationError(
            f"untrusted operator {run!r} must be a module-level function (or a UdfOperator)"
        )
    return f"{module}:{qualname}"


def _message(error: BaseException) -> str:
    """The error as the Dispatcher stores it: bounded, without NULs or lone surrogates."""
    text = str(error) if isinstance(error, OperatorError) else f"{type(error).__name__}: {error}"
    text = text.replace("\x00", "\\x00").encode("utf-8", "replace").decode("utf-8")
    return text[:_MAX_ERROR]
