"""What an operator author imports: events, operator registration, the task context.

One small neutral module, below both the Dispatcher and the worker: importing
it loads neither SQLAlchemy, Alembic, FastAPI nor PySpark, so an operator
module and the UDF child start light.

- :class:`DatasetEvent`, :func:`parse_events`, :class:`AcceptResult`: the
  wire shape of upstream events (dispatcher.md, "Event Model").
- :class:`OperatorSpec`, :class:`OperatorRegistry`: operator name ->
  implementation, validated at deploy.
- :class:`TaskContext`, :class:`OperatorResult`, :class:`OperatorError`: what
  an operator is called with and returns; :class:`TaskPayload` is the typed
  task document a UDF's context shares.
"""

from typing import TYPE_CHECKING

from trace_core.lazy_exports import attach

if TYPE_CHECKING:
    from trace_core.authoring.context import (
        AttemptControl,
        OperatorError,
        OperatorResult,
        SecretProvider,
        StaticSecrets,
        TaskContext,
        declared_secrets,
    )
    from trace_core.authoring.events import AcceptResult, DatasetEvent, parse_events
    from trace_core.authoring.operators import OperatorRegistry, OperatorSpec
    from trace_core.authoring.payload import CAPABILITY_TOKEN_ENV, TaskPayload

__all__ = [
    "CAPABILITY_TOKEN_ENV",
    "AcceptResult",
    "AttemptControl",
    "DatasetEvent",
    "OperatorError",
    "OperatorRegistry",
    "OperatorResult",
    "OperatorSpec",
    "SecretProvider",
    "StaticSecrets",
    "TaskContext",
    "TaskPayload",
    "declared_secrets",
    "parse_events",
]

__getattr__, __dir__ = attach(__name__, __file__)
