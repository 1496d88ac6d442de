"""What a dataset version has materialized, and whether one covers another.

Coverage is kept as merged inclusive block ranges plus the highest cursor
(``dataset_version_progress``), never one row per partition: a version with a
million partitions is still a handful of intervals. The Dispatcher's router
maintains it with :func:`merge_ranges`; activation compares a building
version with the current one with :func:`covers`.
"""

from __future__ import annotations

import bisect
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from trace_core.ranges import Range, merge_ranges
from trace_core.storage.ports.registry import VersionProgress
from trace_core.storage.protocol import Transaction

__all__ = ["Coverage", "Range", "coverages", "covers", "merge_ranges", "read_coverage"]


@dataclass(frozen=True)
class Coverage:
    """Materialized progress of one dataset version (empty when nothing is known)."""

    ranges: tuple[Range, ...] = ()
    max_cursor: int | None = None

    @classmethod
    def of(cls, ranges: Any, max_cursor: int | None) -> Coverage:
        """From a ``dataset_version_progress`` row's JSON ranges and cursor."""
        return cls(tuple(merge_ranges(ranges or [])), max_cursor)


def covers(candidate: Coverage, baseline: Coverage) -> bool:
    """Whether ``candidate`` has materialized at least what ``baseline`` has.

    Every baseline range must lie inside the union of the candidate's ranges,
    and when the baseline has a cursor the candidate's must be as high.
    """
    if baseline.max_cursor is not None and (
        candidate.max_cursor is None or candidate.max_cursor < baseline.max_cursor
    ):
        return False
    have = merge_ranges(candidate.ranges)
    starts = [start for start, _ in have]
    for start, end in merge_ranges(baseline.ranges):
        # Merged intervals neither overlap nor touch, so a contiguous range
        # inside their union is inside the single interval that holds its start.
        i = bisect.bisect_right(starts, start) - 1
        if i < 0 or have[i][1] < end:
            return False
    return True


async def read_coverage(
    tx: Transaction, versions: Collection[uuid.UUID]
) -> dict[uuid.UUID, Coverage]:
    """The recorded coverage of each of ``versions`` that has a progress row."""
    return coverages(await tx.registry.dataset_version_progress(versions))


def coverages(found: Mapping[uuid.UUID, VersionProgress]) -> dict[uuid.UUID, Coverage]:
    """Recorded progress rows as coverage, by dataset version."""
    return {version: Coverage.of(p.ranges, p.max_cursor) for version, p in found.items()}
