"""Euterpe's maintenance service: the supervisor loop over
:class:`~trace_core.euterpe.job_maintenance.InboxMaintenance`.

:class:`EuterpeMaintenance` is a service in the house shape (``run_once`` /
``run`` / ``start`` / ``stop`` / ``wake``). One pass:

1. reclaims expired job leases (a worker that died: the job is retried, or
   ``failed -> dead_letter`` when its attempts are spent, §4);
2. moves failed jobs whose retry time came back to ``queued`` (§3);
3. at most every ``prune_interval_seconds``: prunes finished jobs older than
   ``retention`` (a tombstone each, so their status reads answer ``410
   Gone``), sweeps expired idempotency keys, and, when this deployment also
   runs a webhook receiver, its expired nonces and event ids.

A failing pass never ends the loop (a database outage): it backs off with
jitter through :class:`~trace_core.outage.LoopHealth` and carries on. The
clock is the lifecycle's, so tests drive it with a ``ManualClock``.
"""

from __future__ import annotations

import logging
import random
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import anyio
import anyio.abc

from trace_core.errors import ConfigurationError
from trace_core.euterpe.job_maintenance import InboxMaintenance
from trace_core.euterpe.receiver import WebhookReceiver
from trace_core.idempotency import IdempotencyStore
from trace_core.outage import LoopHealth

__all__ = ["EuterpeMaintenance", "MaintenanceConfig", "MaintenancePass"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MaintenanceConfig:
    """How often the service runs and how long finished jobs are kept."""

    interval_seconds: float = 5.0
    """Time between passes (jittered by ±20 %)."""
    retention: timedelta = timedelta(days=30)
    """Finished jobs older than this are pruned (then answered 410)."""
    prune_interval_seconds: float = 300.0
    """Pruning and sweeping run at most this often (the reclaim every pass)."""
    batch: int = 500
    """Rows reclaimed, requeued or swept per step of one pass."""

    def __post_init__(self) -> None:
        if self.interval_seconds <= 0 or self.prune_interval_seconds <= 0:
            raise ConfigurationError("MaintenanceConfig intervals must be > 0")
        if self.retention < timedelta(0):
            raise ConfigurationError("MaintenanceConfig.retention must not be negative")
        if self.batch < 1:
            raise ConfigurationError("MaintenanceConfig.batch must be >= 1")


@dataclass
class MaintenancePass:
    """What one pass did (ids, never data)."""

    reclaimed: int = 0
    requeued: list[uuid.UUID] = field(default_factory=list)
    pruned: list[uuid.UUID] = field(default_factory=list)
    idempotency_swept: int = 0
    nonces_pruned: int = 0
    events_pruned: int = 0
    pruning_ran: bool = False


class EuterpeMaintenance:
    """Reclaim, due retries and retention pruning on an interval (module docstring)."""

    def __init__(
        self,
        maintenance: InboxMaintenance,
        *,
        config: MaintenanceConfig | None = None,
        idempotency: IdempotencyStore | None = None,
        receiver: WebhookReceiver | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.maintenance = maintenance
        self.config = config or MaintenanceConfig()
        self.idempotency = idempotency
        self.receiver = receiver
        self.clock = maintenance.jobs.clock
        self.rng = rng or random.Random()
        self.health = LoopHealth(type(self).__name__, logger=_log)
        self._last_prune: datetime | None = None
        self._stop_requested = False
        self._waiting: anyio.CancelScope | None = None
        self._stopped: anyio.Event | None = None

    async def run_once(self, *, prune: bool | None = None) -> MaintenancePass:
        """One pass; ``prune`` forces (True) or skips (False) the pruning step,
        which otherwise runs when ``prune_interval_seconds`` have passed."""
        done = MaintenancePass()
        report = await self.maintenance.reclaim_expired(limit=self.config.batch)
        done.reclaimed = len(report.retried) + len(report.dead_lettered)
        done.requeued = await self.maintenance.requeue_due(limit=self.config.batch)
        now = self.clock.now()
        due = self._last_prune is None or (now - self._last_prune).total_seconds() >= (
            self.config.prune_interval_seconds
        )
        if prune if prune is not None else due:
            done.pruning_ran = True
            done.pruned = await self.maintenance.prune(self.config.retention)
            if self.idempotency is not None:
                done.idempotency_swept = await self.idempotency.sweep(limit=self.config.batch)
            if self.receiver is not None:
                done.nonces_pruned, done.events_pruned = await self.receiver.prune(
                    limit=self.config.batch
                )
            self._last_prune = now
        if done.reclaimed or done.requeued or done.pruned:
            _log.info(
                "euterpe maintenance: %d lease(s) reclaimed, %d retry(ies) requeued, "
                "%d job(s) pruned",
                done.reclaimed,
                len(done.requeued),
                len(done.pruned),
            )
        return done

    async def run(self) -> None:
        """Passes until :meth:`stop`, ``interval_seconds`` apart (jittered); a
        failed pass backs off instead."""
        self._stopped = anyio.Event()
        self.health.running = True
        try:
            while not self.stopping():
                failure: Exception | None = None
                try:
                    await self.run_once()
                    self.health.succeeded()
                except Exception as exc:
                    failure = exc
                if self.stopping():
                    break
                with anyio.CancelScope() as self._waiting:
                    if failure is not None:
                        await self.health.backoff_after(failure)
                    else:
                        interval = self.config.interval_seconds
                        await anyio.sleep(interval * self.rng.uniform(0.8, 1.2))
                self._waiting = None
        finally:
            self.health.running = False
            self._stopped.set()

    def stopping(self) -> bool:
        """Whether :meth:`stop` was called (a call: it changes while the loop awaits)."""
        return self._stop_requested

    def wake(self) -> None:
        """Start the next pass now."""
        if self._waiting is not None:
            self._waiting.cancel()

    async def start(self, task_group: anyio.abc.TaskGroup) -> None:
        """Run :meth:`run` in ``task_group``."""
        task_group.start_soon(self.run)

    async def stop(self) -> None:
        """End the loop after the current pass; wait for it if it runs."""
        self._stop_requested = True
        self.wake()
        if self._stopped is not None:
            await self._stopped.wait()
