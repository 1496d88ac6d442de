"""The attempt that operator code is running for: :func:`current_context`.

The wrapper marks the task context while it runs an operator
(:func:`running`); a worker-side service that acts for "this attempt" (the
operator state client, :class:`~trace_core.worker.http_state.HttpOperatorState`)
finds the attempt's capability token there. It is a context variable, so it
follows the operator into its worker thread (``anyio.to_thread`` copies the
context) and back into the event loop (``anyio.from_thread.run``), and two
attempts running at once in one process never see each other's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from trace_core.authoring.context import TaskContext

__all__ = ["current_context", "running"]

_current: ContextVar[TaskContext | None] = ContextVar("trace_running_task", default=None)


def current_context() -> TaskContext | None:
    """The context of the attempt whose operator is running here, if any."""
    return _current.get()


@contextmanager
def running(ctx: TaskContext) -> Iterator[None]:
    """Mark ``ctx`` as the running attempt for the code run within."""
    mark = _current.set(ctx)
    try:
        yield
    finally:
        _current.reset(mark)
