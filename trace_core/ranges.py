"""Inclusive integer block ranges, merged: the stored form of coverage.

A base value module (no I/O): the DAG layer compares coverage with it
(:mod:`trace_core.dag.coverage`) and the storage layer merges a version's
stored ranges with it where the engine cannot (SQLite).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["Range", "merge_ranges"]

Range = tuple[int, int]
"""An inclusive ``(start, end)`` block range."""


def merge_ranges(ranges: Iterable[Sequence[int]]) -> list[Range]:
    """Sort and merge inclusive integer ranges; touching ranges merge too.

    ``[[0, 9], [10, 19], [30, 39], [35, 50]]`` -> ``[(0, 19), (30, 50)]``.
    Raises ``ValueError`` for a range whose end is before its start.
    """
    pairs: list[Range] = []
    for item in ranges:
        start, end = int(item[0]), int(item[1])
        if end < start:
            raise ValueError(f"range [{start}, {end}] ends before it starts")
        pairs.append((start, end))
    pairs.sort()
    merged: list[Range] = []
    for start, end in pairs:
        # Block numbers are integers: [0, 9] and [10, 19] leave no gap.
        if merged and start <= merged[-1][1] + 1:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged
