"""The Dispatcher (dispatcher.md): events, routing, runtimes and lifecycle services.

:class:`Dispatcher` wires everything on one state database; the pieces are
usable on their own (tests drive each service's ``run_once``).
"""

from typing import TYPE_CHECKING

from trace_core.lazy_exports import attach

if TYPE_CHECKING:
    from trace_core.dispatcher.backfill import BackfillConfig, Backfiller
    from trace_core.dispatcher.backpressure import BackpressureConfig, BackpressureMonitor
    from trace_core.dispatcher.concurrency import ConcurrencyConfig, ConcurrencyGate
    from trace_core.dispatcher.control import ClaimedTask, TaskControl
    from trace_core.dispatcher.cron import CronConfig, CronScheduler
    from trace_core.dispatcher.events import ROUTE_EVENT, EventGateway, Producer
    from trace_core.dispatcher.explain import EventDecision, Explanation, explain_job
    from trace_core.dispatcher.inprocess import InProcessLambdaInvoker, InProcessWakeupQueue
    from trace_core.dispatcher.inprocess_client import InProcessClient
    from trace_core.dispatcher.launcher import TaskLauncher
    from trace_core.dispatcher.manual import ManualTrigger
    from trace_core.dispatcher.metrics import render_metrics
    from trace_core.dispatcher.operator_state import (
        OperatorStateStore,
        StateConflict,
        StateSnapshot,
    )
    from trace_core.dispatcher.periodic import PeriodicService
    from trace_core.dispatcher.promoter import PromoterConfig, VersionPromoter
    from trace_core.dispatcher.reaper import Reaper, ReaperConfig
    from trace_core.dispatcher.retry_scheduler import RetryScheduler, RetrySchedulerConfig
    from trace_core.dispatcher.routing import EventRouter, RouteReport
    from trace_core.dispatcher.runner import InProcessRunner, RunnerConfig
    from trace_core.dispatcher.runtimes import (
        DEFAULT_RUNTIMES,
        Runtime,
        RuntimeKind,
        RuntimeRegistry,
    )
    from trace_core.dispatcher.scale import IdleScaler, ScaleConfig
    from trace_core.dispatcher.service import Dispatcher, DispatcherConfig
    from trace_core.dispatcher.sources import SourceConfig, SourceSupervisor

__all__ = [
    "DEFAULT_RUNTIMES",
    "ROUTE_EVENT",
    "BackfillConfig",
    "Backfiller",
    "BackpressureConfig",
    "BackpressureMonitor",
    "ClaimedTask",
    "ConcurrencyConfig",
    "ConcurrencyGate",
    "CronConfig",
    "CronScheduler",
    "Dispatcher",
    "DispatcherConfig",
    "EventDecision",
    "EventGateway",
    "EventRouter",
    "Explanation",
    "IdleScaler",
    "InProcessClient",
    "InProcessLambdaInvoker",
    "InProcessRunner",
    "InProcessWakeupQueue",
    "ManualTrigger",
    "OperatorStateStore",
    "PeriodicService",
    "Producer",
    "PromoterConfig",
    "Reaper",
    "ReaperConfig",
    "RetryScheduler",
    "RetrySchedulerConfig",
    "RouteReport",
    "RunnerConfig",
    "Runtime",
    "RuntimeKind",
    "RuntimeRegistry",
    "ScaleConfig",
    "SourceConfig",
    "SourceSupervisor",
    "StateConflict",
    "StateSnapshot",
    "TaskControl",
    "TaskLauncher",
    "VersionPromoter",
    "explain_job",
    "render_metrics",
]

__getattr__, __dir__ = attach(__name__, __file__)
