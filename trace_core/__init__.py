"""Trace core: the storage-agnostic ownership protocol, outbox and idempotency keys.

Importing this package stays light: no Spark, no AWS SDK, no Postgres driver.
"""

from typing import TYPE_CHECKING

from trace_core.lazy_exports import attach

if TYPE_CHECKING:
    from trace_core.clock import Clock, ManualClock, SystemClock
    from trace_core.errors import (
        ConfigurationError,
        DatabaseUnavailable,
        DuplicateItem,
        IdempotencyConflict,
        IdempotencyInFlight,
        InvalidTransition,
        NotFound,
        StaleClaim,
        StorageError,
        TraceError,
    )
    from trace_core.idempotency import IdempotencyStore, Replay, request_fingerprint
    from trace_core.identity import worker_id
    from trace_core.leasing import FailOutcome, LeaseConfig, LeaseQueue, ReclaimReport
    from trace_core.model import (
        INBOX_JOBS,
        JOB_OUTBOX_EVENTS,
        OUTBOX,
        QUEUES,
        TASKS,
        ClaimOutcome,
        Fence,
        ItemState,
        Lease,
        NotClaimedReason,
        QueueSpec,
    )
    from trace_core.outbox import OutboxRelay, PermanentFailure, RelayConfig
    from trace_core.retry import Backoff, RetryClass, RetryDecision, RetryPolicy
    from trace_core.states import (
        INBOX_LIFECYCLE,
        JOB_OUTBOX_LIFECYCLE,
        OUTBOX_LIFECYCLE,
        TASK_LIFECYCLE,
        Lifecycle,
    )
    from trace_core.tasks import TaskQueue

__all__ = [
    "INBOX_JOBS",
    "INBOX_LIFECYCLE",
    "JOB_OUTBOX_EVENTS",
    "JOB_OUTBOX_LIFECYCLE",
    "OUTBOX",
    "OUTBOX_LIFECYCLE",
    "QUEUES",
    "TASKS",
    "TASK_LIFECYCLE",
    "Backoff",
    "ClaimOutcome",
    "Clock",
    "ConfigurationError",
    "DatabaseUnavailable",
    "DuplicateItem",
    "FailOutcome",
    "Fence",
    "IdempotencyConflict",
    "IdempotencyInFlight",
    "IdempotencyStore",
    "InvalidTransition",
    "ItemState",
    "Lease",
    "LeaseConfig",
    "LeaseQueue",
    "Lifecycle",
    "ManualClock",
    "NotClaimedReason",
    "NotFound",
    "OutboxRelay",
    "PermanentFailure",
    "QueueSpec",
    "ReclaimReport",
    "RelayConfig",
    "Replay",
    "RetryClass",
    "RetryDecision",
    "RetryPolicy",
    "StaleClaim",
    "StorageError",
    "SystemClock",
    "TaskQueue",
    "TraceError",
    "request_fingerprint",
    "worker_id",
]

__getattr__, __dir__ = attach(__name__, __file__)
