"""Recording coverage: accepted events advance their dataset versions' progress.

Coverage (merged block ranges and the highest cursor, see
:mod:`trace_core.dag.coverage`) is advanced in the transaction that accepts
the events, so it is committed before those events are routed. That order is
what makes the ``PerPartition`` join race-free: whichever input's event is
routed last sees every input's coverage.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime

from trace_core.authoring.events import DatasetEvent
from trace_core.ranges import merge_ranges
from trace_core.storage.ports.events import ProgressFold
from trace_core.storage.protocol import Transaction

__all__ = ["record_coverage"]


async def record_coverage(
    tx: Transaction, events: Sequence[DatasetEvent], *, now: datetime
) -> None:
    """Fold newly accepted ``events`` into their versions' progress rows."""
    by_version: dict[uuid.UUID, list[DatasetEvent]] = {}
    for event in events:
        by_version.setdefault(event.dataset_version, []).append(event)
    folds = []
    for version in sorted(by_version):  # a fixed lock order: no deadlock between acceptors
        batch = by_version[version]
        spans = merge_ranges(
            (e.start, e.end) for e in batch if e.start is not None and e.end is not None
        )
        cursor = max((e.cursor for e in batch if isinstance(e.cursor, int)), default=None)
        folds.append(ProgressFold(version, batch[0].dataset_uuid, spans, cursor, len(batch)))
    await tx.events.advance_progress(folds, now=now)
