"""The Dispatcher (dispatcher.md): events, routing, runtimes and lifecycle services.

:class:`Dispatcher` wires everything on one state database; the pieces are
usable on their own (tests drive each service's ``run_once``).
"""

from trace_core.dispatcher.backfill import BackfillConfig, Backfiller
from trace_core.dispatcher.backpressure import BackpressureConfig, BackpressureMonitor
from trace_core.dispatcher.concurrency import ConcurrencyConfig, ConcurrencyGate
from trace_core.dispatcher.control import ClaimedTask, TaskControl
from trace_core.dispatcher.cron import CronConfig, CronScheduler
from trace_core.dispatcher.events import (
    ROUTE_EVENT,
    AcceptResult,
    DatasetEvent,
    EventGateway,
    Producer,
    parse_events,
)
from trace_core.dispatcher.explain import EventDecision, Explanation, explain_job
from trace_core.dispatcher.inprocess import InProcessLambdaInvoker, InProcessWakeupQueue
from trace_core.dispatcher.launcher import TaskLauncher
from trace_core.dispatcher.manual import ManualTrigger
from trace_core.dispatcher.metrics import render_metrics
from trace_core.dispatcher.operator_state import OperatorStateStore, StateConflict, StateSnapshot
from trace_core.dispatcher.operators import OperatorRegistry, OperatorSpec
from trace_core.dispatcher.periodic import PeriodicService
from trace_core.dispatcher.promoter import PromoterConfig, VersionPromoter
from trace_core.dispatcher.reaper import Reaper, ReaperConfig
from trace_core.dispatcher.retry_scheduler import RetryScheduler, RetrySchedulerConfig
from trace_core.dispatcher.routing import EventRouter, RouteReport
from trace_core.dispatcher.runner import InProcessRunner, OperatorResult, RunnerConfig, TaskContext
from trace_core.dispatcher.runtimes import DEFAULT_RUNTIMES, Runtime, RuntimeKind, RuntimeRegistry
from trace_core.dispatcher.scale import IdleScaler, ScaleConfig
from trace_core.dispatcher.service import Dispatcher, DispatcherConfig
from trace_core.dispatcher.sources import SourceConfig, SourceSupervisor

__all__ = [
    "DEFAULT_RUNTIMES",
    "ROUTE_EVENT",
    "AcceptResult",
    "BackfillConfig",
    "Backfiller",
    "BackpressureConfig",
    "BackpressureMonitor",
    "ClaimedTask",
    "ConcurrencyConfig",
    "ConcurrencyGate",
    "CronConfig",
    "CronScheduler",
    "DatasetEvent",
    "Dispatcher",
    "DispatcherConfig",
    "EventDecision",
    "EventGateway",
    "EventRouter",
    "Explanation",
    "IdleScaler",
    "InProcessLambdaInvoker",
    "InProcessRunner",
    "InProcessWakeupQueue",
    "ManualTrigger",
    "OperatorRegistry",
    "OperatorResult",
    "OperatorSpec",
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
    "TaskContext",
    "TaskControl",
    "TaskLauncher",
    "VersionPromoter",
    "explain_job",
    "parse_events",
    "render_metrics",
]
