"""The worker wrapper: claim, run, heartbeat, emit and report, fenced.

:class:`WorkerWrapper` is the protection boundary of interface-contracts.md
("Worker -> Dispatcher"): it alone talks to the Dispatcher, through a
:class:`ControlPlaneClient` (the Dispatcher's
:class:`~trace_core.dispatcher.inprocess_client.InProcessClient`, or
:class:`HttpControlPlaneClient` for ``/internal/*``; wrap either in a
:class:`RetryingClient` to ride out outages), and runs untrusted operators in
a child process without its credentials (:mod:`trace_core.worker.udf`).

The Dispatcher's own in-process runner
(:class:`~trace_core.dispatcher.runner.InProcessRunner`) is this wrapper on
an ``InProcessClient``. httpx is imported only when an HTTP client is built.
An HTTP worker's scoped credentials come from :class:`HttpCredentialSource`,
its operators' state from :class:`HttpOperatorState` (``/v1/task/state``).
"""

from typing import TYPE_CHECKING

from trace_core.lazy_exports import attach

if TYPE_CHECKING:
    from trace_core.worker.attempt import Attempt, AttemptSettings
    from trace_core.worker.client import (
        ClaimResult,
        ControlPlaneClient,
        ControlPlaneRejected,
        ControlPlaneUnavailable,
        HeartbeatResult,
    )
    from trace_core.worker.http_client import HttpControlPlaneClient
    from trace_core.worker.http_credentials import HttpCredentialSource
    from trace_core.worker.http_state import HttpOperatorState
    from trace_core.worker.retrying import DEFAULT_BACKOFF, OutageRetry, RetryingClient
    from trace_core.worker.udf import UdfConfig, UdfOperator, child_environment, run_udf
    from trace_core.worker.wrapper import (
        ABANDONED,
        CANCELED,
        COMPLETED,
        FAILED,
        STALE,
        CredentialSource,
        WorkerWrapper,
    )

__all__ = [
    "ABANDONED",
    "CANCELED",
    "COMPLETED",
    "DEFAULT_BACKOFF",
    "FAILED",
    "STALE",
    "Attempt",
    "AttemptSettings",
    "ClaimResult",
    "ControlPlaneClient",
    "ControlPlaneRejected",
    "ControlPlaneUnavailable",
    "CredentialSource",
    "HeartbeatResult",
    "HttpControlPlaneClient",
    "HttpCredentialSource",
    "HttpOperatorState",
    "OutageRetry",
    "RetryingClient",
    "UdfConfig",
    "UdfOperator",
    "WorkerWrapper",
    "child_environment",
    "run_udf",
]

__getattr__, __dir__ = attach(__name__, __file__)
