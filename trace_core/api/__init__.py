"""The control-plane HTTP API as an ASGI app (FastAPI).

``create_app(dispatcher, internal_token=...)`` serves the contracts of
``spec/interface-contracts.md`` (``/internal/task-*``, ``heartbeat``,
``events``, ``jwks/task``), the v1 worker contract (``/internal/worker/*``)
and the Dispatcher's operations (``explain``, ``metrics``, ``trigger``).

FastAPI is imported here and below only: ``import trace_core`` stays light.
"""

from typing import TYPE_CHECKING

from trace_core.lazy_exports import attach

if TYPE_CHECKING:
    from trace_core.api.app import ApiConfig, create_app
    from trace_core.api.auth import MIN_TOKEN_LENGTH, check_internal_token

__all__ = ["MIN_TOKEN_LENGTH", "ApiConfig", "check_internal_token", "create_app"]

__getattr__, __dir__ = attach(__name__, __file__)
