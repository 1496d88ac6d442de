"""Lifecycles as data: the allowed state transitions of every durable queue.

Each queue's statuses and edges are declared once here. The storage layer puts
the allowed source states of a transition into the ``WHERE`` of the update, so
a write outside the table changes nothing; the core then reports it as
:class:`~trace_core.errors.InvalidTransition`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from trace_core.errors import InvalidTransition

__all__ = [
    "INBOX_LIFECYCLE",
    "JOB_OUTBOX_LIFECYCLE",
    "OUTBOX_LIFECYCLE",
    "TASK_LIFECYCLE",
    "Lifecycle",
]


@dataclass(frozen=True)
class Lifecycle:
    """A named state machine: statuses, terminal statuses and allowed edges."""

    name: str
    statuses: frozenset[str]
    terminal: frozenset[str]
    edges: frozenset[tuple[str, str]]
    _sources: dict[str, frozenset[str]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        unknown = {s for edge in self.edges for s in edge} - self.statuses
        if unknown:
            raise ValueError(f"{self.name}: edges name unknown statuses {sorted(unknown)}")
        if not self.terminal <= self.statuses:
            raise ValueError(f"{self.name}: terminal statuses must be statuses")
        sources: dict[str, set[str]] = {s: set() for s in self.statuses}
        for src, dst in self.edges:
            sources[dst].add(src)
        object.__setattr__(self, "_sources", {k: frozenset(v) for k, v in sources.items()})

    @classmethod
    def build(
        cls, name: str, terminal: Iterable[str], edges: Iterable[tuple[str, str]]
    ) -> Lifecycle:
        """Build a lifecycle whose statuses are those named by its edges."""
        edge_set = frozenset(edges)
        statuses = frozenset(s for edge in edge_set for s in edge)
        return cls(name, statuses, frozenset(terminal), edge_set)

    def allows(self, source: str, target: str) -> bool:
        """Whether ``source -> target`` is an edge of the table."""
        return (source, target) in self.edges

    def sources_of(self, target: str) -> frozenset[str]:
        """Every status from which ``target`` may be entered."""
        self.require_status(target)
        return self._sources[target]

    def require_status(self, status: str) -> None:
        """Raise ``ValueError`` naming the lifecycle if ``status`` is unknown."""
        if status not in self.statuses:
            raise ValueError(
                f"{self.name}: unknown status {status!r} (known: {sorted(self.statuses)})"
            )

    def check(self, source: str, target: str, item_id: object = None) -> None:
        """Raise :class:`InvalidTransition` unless ``source -> target`` is allowed."""
        self.require_status(source)
        self.require_status(target)
        if not self.allows(source, target):
            raise InvalidTransition(self.name, source, target, item_id)


def _chain(*statuses: str) -> list[tuple[str, str]]:
    return list(itertools.pairwise(statuses))


# interface-contracts.md / orchestration-data-model.md. ``Failed`` is both the
# retry-pending state (``next_retry_at`` set) and the terminal one (exhausted).
# The two edges into ``Completed`` from Failed/Queued are the contract's late
# reply: a completion for the *current* attempt, fenced by its lease token, is
# accepted after the timeout mark as long as no newer attempt was claimed.
TASK_LIFECYCLE = Lifecycle.build(
    "task",
    terminal={"Completed", "Canceled"},
    edges=[
        ("Queued", "Running"),
        ("Running", "Completed"),
        ("Running", "Failed"),
        ("Failed", "Queued"),
        ("Failed", "Completed"),
        ("Queued", "Completed"),
        ("Queued", "Canceled"),
        ("Running", "Canceled"),
        ("Failed", "Canceled"),
    ],
)

_INBOX_LEASED = ("claimed", "fetching", "processing", "uploading")

# euterpe-contract.md section 3, verbatim.
INBOX_LIFECYCLE = Lifecycle.build(
    "inbox_job",
    terminal={"succeeded", "dead_letter"},
    edges=[
        *_chain("queued", "claimed", "fetching", "processing", "uploading", "succeeded"),
        *[(s, "queued") for s in _INBOX_LEASED],
        *[(s, "failed") for s in _INBOX_LEASED],
        ("failed", "queued"),
        ("failed", "dead_letter"),
    ],
)

# orchestration-data-model.md "Outbox": Pending | Processing | Done | Failed,
# where Failed is the dead letter.
OUTBOX_LIFECYCLE = Lifecycle.build(
    "outbox",
    terminal={"Done", "Failed"},
    edges=[
        ("Pending", "Processing"),
        ("Processing", "Done"),
        ("Processing", "Pending"),
        ("Processing", "Failed"),
    ],
)

# euterpe-contract.md section 8: webhook deliveries with an outbox dead letter.
JOB_OUTBOX_LIFECYCLE = Lifecycle.build(
    "job_outbox_event",
    terminal={"delivered", "dead_letter"},
    edges=[
        ("pending", "delivering"),
        ("delivering", "delivered"),
        ("delivering", "pending"),
        ("delivering", "dead_letter"),
    ],
)
