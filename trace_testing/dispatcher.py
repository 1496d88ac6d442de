"""A Dispatcher for tests that runs its services round by round until idle.

:meth:`~trace_core.dispatcher.service.Dispatcher.run_once` is one round of
every service in causal order (the relay drained, in-process tasks run in
it). A round can leave work for the next (a retry due, a task an event
started); :meth:`IdleDispatcher.run_until_idle` repeats rounds until one
handles no outbox row and starts nothing, with a bound so a livelock fails
the test instead of hanging it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from trace_core.authoring.operators import OperatorRegistry, OperatorSpec
from trace_core.clock import Clock
from trace_core.dispatcher.service import Dispatcher, DispatcherConfig
from trace_core.storage.protocol import Repository

__all__ = ["DispatcherFactory", "IdleDispatcher", "NotIdle"]


class NotIdle(AssertionError):
    """The Dispatcher still had work after the bound on rounds."""


def _busy(report: Mapping[str, Any]) -> bool:
    # A round is idle when the relay handled nothing: every new task, retry
    # and routed event goes through an outbox row, so no row means no work
    # was started that a further round could continue.
    return bool(report.get("outbox_rows"))


class IdleDispatcher:
    """A :class:`~trace_core.dispatcher.service.Dispatcher` (``.dispatcher``)
    with :meth:`run_until_idle`."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        """Wrap ``dispatcher`` (not started: rounds run in the caller's task)."""
        self.dispatcher = dispatcher

    async def run_until_idle(self, *, max_rounds: int = 50) -> list[Mapping[str, Any]]:
        """Run rounds until one is idle; the reports of every round, last one idle.

        Raises :class:`NotIdle` after ``max_rounds`` busy rounds.
        """
        if max_rounds < 1:
            raise ValueError("max_rounds must be >= 1")
        reports: list[Mapping[str, Any]] = []
        for _ in range(max_rounds):
            report = await self.dispatcher.run_once()
            reports.append(report)
            if not _busy(report):
                return reports
        raise NotIdle(f"the Dispatcher was still busy after {max_rounds} rounds: {reports[-1]}")


class DispatcherFactory:
    """Makes :class:`IdleDispatcher` instances on one repository and clock
    (what the ``trace_dispatcher`` fixture returns)."""

    def __init__(self, repo: Repository, clock: Clock) -> None:
        """Dispatchers made here use ``repo`` and ``clock``."""
        self.repo = repo
        self.clock = clock

    def __call__(
        self,
        operators: Iterable[OperatorSpec] | OperatorRegistry = (),
        *,
        config: DispatcherConfig | None = None,
        **kwargs: Any,
    ) -> IdleDispatcher:
        """A Dispatcher running ``operators``; ``kwargs`` go to its constructor."""
        registry = (
            operators if isinstance(operators, OperatorRegistry) else OperatorRegistry(operators)
        )
        dispatcher = Dispatcher(
            self.repo, operators=registry, clock=self.clock, config=config, **kwargs
        )
        return IdleDispatcher(dispatcher)
