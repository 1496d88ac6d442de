"""The Dispatcher: every control-plane service wired on one repository.

One object owns the pieces of dispatcher.md and starts and stops them
together: the outbox relay (``route_event`` → router, ``enqueue_task`` →
launcher), the in-process runner for ``runtime: dispatcher`` jobs, the reaper,
the retry scheduler, the source supervisor and cron, the backpressure
monitor, the idle scaler and the version promoter. ``run_once()`` runs one
round of all of them in a fixed order, which is how tests and single-step
tools drive it without clocks or sleeps; ``start``/``stop`` run them as loops.

A deploy, a rollback and a promotion change which jobs are live: each
notifies a channel on commit, and the running Dispatcher wakes the loops that
act on live jobs (sources, cron, backfill, the promoter), so an always-on
source starts now, not a tick later. On Postgres that includes changes made
by other processes, such as ``trace-lite dag deploy``
(:mod:`trace_core.dispatcher.live_watch`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from trace_core.authoring.operators import OperatorRegistry
from trace_core.clock import Clock, SystemClock
from trace_core.dag import DagDocument, DeployResult, RollbackResult, deploy, rollback
from trace_core.dispatcher.backfill import BackfillConfig, Backfiller
from trace_core.dispatcher.backpressure import BackpressureConfig, BackpressureMonitor
from trace_core.dispatcher.concurrency import ConcurrencyConfig, ConcurrencyGate
from trace_core.dispatcher.control import TaskControl
from trace_core.dispatcher.cron import CronConfig, CronScheduler
from trace_core.dispatcher.events import ROUTE_EVENT, EventGateway
from trace_core.dispatcher.explain import Explanation, explain_job
from trace_core.dispatcher.inprocess import InProcessLambdaInvoker, InProcessWakeupQueue
from trace_core.dispatcher.launcher import TaskLauncher
from trace_core.dispatcher.live_watch import LiveJobsWatcher
from trace_core.dispatcher.manual import ManualTrigger
from trace_core.dispatcher.manual_pause import ManualPause
from trace_core.dispatcher.metrics import render_metrics
from trace_core.dispatcher.operator_state import OperatorStateStore
from trace_core.dispatcher.promoter import PromoterConfig, VersionPromoter
from trace_core.dispatcher.reaper import Reaper, ReaperConfig
from trace_core.dispatcher.retry_scheduler import RetryScheduler, RetrySchedulerConfig
from trace_core.dispatcher.routing import EventRouter
from trace_core.dispatcher.runner import InProcessRunner, RunnerConfig
from trace_core.dispatcher.runtimes import RuntimeRegistry
from trace_core.dispatcher.scale import IdleScaler, ScaleConfig
from trace_core.dispatcher.sources import SourceConfig, SourceSupervisor
from trace_core.identity import worker_id as default_worker_id
from trace_core.outage import LoopHealth
from trace_core.outbox import OutboxRelay, RelayConfig
from trace_core.ports import LambdaInvoker, WakeupQueue
from trace_core.storage.protocol import Repository
from trace_core.tasks import ENQUEUE_TASK, TaskQueue

if TYPE_CHECKING:
    from trace_core.dispatcher.capabilities import CapabilityIssuer
    from trace_core.worker.wrapper import CredentialSource

__all__ = ["Dispatcher", "DispatcherConfig"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DispatcherConfig:
    """Settings of every Dispatcher service (each validated by its own config)."""

    relay: RelayConfig = field(default_factory=RelayConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    reaper: ReaperConfig = field(default_factory=ReaperConfig)
    retries: RetrySchedulerConfig = field(default_factory=RetrySchedulerConfig)
    sources: SourceConfig = field(default_factory=SourceConfig)
    cron: CronConfig = field(default_factory=CronConfig)
    backpressure: BackpressureConfig = field(default_factory=BackpressureConfig)
    concurrency: ConcurrencyConfig = field(default_factory=ConcurrencyConfig)
    scale: ScaleConfig = field(default_factory=ScaleConfig)
    promoter: PromoterConfig = field(default_factory=PromoterConfig)
    backfill: BackfillConfig = field(default_factory=BackfillConfig)
    storage_root: str = "s3://trace-lite/"
    """Where dataset versions of deployed DAGs live (version-addressed prefixes)."""


class Dispatcher:
    """The control plane on one state database (see the module docstring)."""

    def __init__(
        self,
        repo: Repository,
        *,
        operators: OperatorRegistry,
        clock: Clock | None = None,
        runtimes: RuntimeRegistry | None = None,
        wakeups: WakeupQueue | None = None,
        lambdas: LambdaInvoker | None = None,
        config: DispatcherConfig | None = None,
        worker_id: str | None = None,
        capabilities: CapabilityIssuer | None = None,
        credentials: CredentialSource | None = None,
    ) -> None:
        self.repo = repo
        self.clock = clock or SystemClock()
        self.config = config or DispatcherConfig()
        self.operators = operators
        self.runtimes = runtimes or RuntimeRegistry()
        self.wakeups = wakeups or InProcessWakeupQueue()
        self.lambdas = lambdas or InProcessLambdaInvoker()
        worker = worker_id or default_worker_id()
        cfg, clock_ = self.config, self.clock

        self.tasks = TaskQueue(repo, clock=clock_)
        self.backpressure = BackpressureMonitor(repo, clock=clock_, config=cfg.backpressure)
        handicap = self.backpressure.handicap_seconds
        self.gateway = EventGateway(repo, clock=clock_)
        self.router = EventRouter(repo, clock=clock_, tasks=self.tasks, handicap=handicap)
        self.gate = ConcurrencyGate(self.tasks, config=cfg.concurrency)
        self.sources = SourceSupervisor(
            repo, clock=clock_, config=cfg.sources, tasks=self.tasks, handicap=handicap
        )
        self.control = TaskControl(
            repo,
            clock=clock_,
            tasks=self.tasks,
            gateway=self.gateway,
            claim=self.gate.claim,
            directive=self.sources.directive,
            capabilities=capabilities,
            on_release=self.gate.wake_waiting,
        )
        self.runner = InProcessRunner(
            self.control, operators, worker_id=worker, config=cfg.runner, credentials=credentials
        )
        self.launcher = TaskLauncher(
            repo,
            self.runtimes,
            wakeups=self.wakeups,
            lambdas=self.lambdas,
            in_process=self.runner.submit,
        )
        self.relay = OutboxRelay(
            repo,
            {ROUTE_EVENT: self.router.handle, ENQUEUE_TASK: self.launcher.handle},
            clock=clock_,
            config=cfg.relay,
            worker_id=worker,
        )
        self.reaper = Reaper(repo, clock=clock_, config=cfg.reaper, tasks=self.tasks)
        self.retries = RetryScheduler(repo, clock=clock_, config=cfg.retries, tasks=self.tasks)
        self.cron = CronScheduler(
            repo, clock=clock_, config=cfg.cron, tasks=self.tasks, handicap=handicap
        )
        self.scaler = IdleScaler(repo, clock=clock_, config=cfg.scale)
        self.backfill = Backfiller(repo, self.router, clock=clock_, config=cfg.backfill)
        self.promoter = VersionPromoter(repo, clock=clock_, config=cfg.promoter)
        self.live_watch = LiveJobsWatcher(repo, self._live_jobs_changed)
        self.manual = ManualTrigger(repo, clock=clock_, tasks=self.tasks, gateway=self.gateway)
        self.pauses = ManualPause(repo, clock=clock_)
        self.state = OperatorStateStore(repo, clock=clock_)

    # --- deploy and inspect ---------------------------------------------------

    async def deploy(self, document: DagDocument, *, org_slug: str | None = None) -> DeployResult:
        """Deploy a DAG; its operators and runtimes must be registered here.

        Once it commits, the running loops that act on live jobs pass at once:
        sources start, cron schedules begin, a building version is backfilled
        and checked for promotion without waiting for their interval.
        """
        return await deploy(
            self.repo,
            document,
            clock=self.clock,
            org_slug=org_slug,
            storage_root=self.config.storage_root,
            operators=self.operators.names(),
            runtimes=self.runtimes.names(),
            cancel=self.tasks.cancel,
        )

    async def rollback(self, dag_name: str, *, org_slug: str = "default") -> RollbackResult:
        """Undo the last deploy of ``dag_name``; abandoned work is canceled."""
        return await rollback(
            self.repo, dag_name, org_slug=org_slug, clock=self.clock, cancel=self.tasks.cancel
        )

    def _live_jobs_changed(self) -> None:
        """Start the next pass of the loops that act on live jobs now.

        Without it a new always-on source would start (and a superseded one
        stop, a cron schedule begin, a building version be backfilled) only at
        the end of their interval.
        """
        self.backfill.wake()
        self.promoter.wake()
        self.sources.wake()
        self.cron.wake()

    async def explain(
        self, dag_name: str, job_name: str, *, org_slug: str = "default"
    ) -> Explanation:
        """Why ``dag_name/job_name`` did or did not run."""
        return await explain_job(self.repo, dag_name, job_name, org_slug=org_slug)

    async def metrics(self) -> str:
        """Queue depth/age, pauses and in-flight counts, Prometheus text format."""
        return await render_metrics(self.repo, self.clock)

    # --- running --------------------------------------------------------------

    async def run_once(self) -> Mapping[str, Any]:
        """One round of every service, in causal order; what each did.

        The relay is drained until empty, so events emitted by in-process
        tasks are routed (and their tasks started) within the same round.
        """
        report: dict[str, Any] = {
            "backfilled": await self.backfill.run_once(),
            "promoted": await self.promoter.run_once(),
            "backpressure": await self.backpressure.run_once(),
            "sources": await self.sources.run_once(),
            "cron": await self.cron.run_once(),
            "reaper": await self.reaper.run_once(),
            "retries": await self.retries.run_once(),
        }
        handled = 0
        while n := await self.relay.run_once():
            handled += n
        report["outbox_rows"] = handled
        report["scale"] = await self.scaler.run_once()
        return report

    async def start(self, task_group: anyio.abc.TaskGroup) -> None:
        """Run every service as a loop in ``task_group``."""
        await self.runner.start(task_group)
        task_group.start_soon(self._start_stranded)
        for service in self._services():
            await service.start(task_group)

    async def _start_stranded(self) -> None:
        """Hand the runner the ``Queued`` in-process tasks whose wake-ups a
        previous process took with it (see
        :meth:`TaskLauncher.start_queued_in_process`); retried with the
        service loops' backoff (:class:`~trace_core.outage.LoopHealth`)
        through an outage."""
        health = LoopHealth("start of queued in-process tasks", logger=log)
        while True:
            try:
                handed = await self.launcher.start_queued_in_process()
            except Exception as exc:
                await health.backoff_after(exc)
                continue
            health.succeeded()
            if handed:
                log.info("started %d queued in-process task(s) at start", handed)
            return

    async def stop(self) -> None:
        """Drain sources, then stop every loop (each finishes its current round).

        A drain that fails (the database is down) is logged and the loops are
        stopped all the same: a shutdown must not hang on an outage.
        """
        try:
            await self.sources.drain()
        except Exception as exc:
            log.warning("stopping without draining sources: %s: %s", type(exc).__name__, exc)
        for service in reversed(self._services()):
            await service.stop()

    def health(self) -> dict[str, dict[str, Any]]:
        """Each service loop's state (:meth:`~trace_core.outage.LoopHealth.snapshot`).

        No service loop ends on an error: each backs off and carries on by
        itself (an outage or a bug alike), so a failure shows here as
        ``healthy: false`` with its ``last_error`` rather than as a dead
        loop behind a live HTTP server. ``running: false`` means the loop is
        not started (or was stopped).
        """
        return {service.health.name: service.health.snapshot() for service in self._services()}

    def _services(self) -> list[Any]:
        # The watcher first: a change committed while the others start wakes them.
        return [
            self.live_watch,
            self.relay,
            self.backfill,
            self.promoter,
            self.backpressure,
            self.sources,
            self.cron,
            self.reaper,
            self.retries,
            self.scaler,
        ]
