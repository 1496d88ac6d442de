"""The Cryo file naming convention of block-range partitions, and range splitting.

A partition of a dataset covering blocks ``start..end`` (both inclusive) is
one Parquet file ``{dataset}_{start}_{end}.parquet`` with both numbers
zero-padded to :data:`BLOCK_NUMBER_WIDTH` digits, so sorting file names sorts
partitions by block number (Ethereum is past 2*10^7 blocks, other chains past
10^8; 12 digits leave room). Partitions live directly under a dataset
version's location (``s3://.../dataset/<uuid>/version/<uuid>/``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from trace_core.errors import InvalidInput

__all__ = [
    "BLOCK_NUMBER_WIDTH",
    "MAX_BLOCK_NUMBER",
    "CryoRange",
    "cryo_file_name",
    "parse_cryo_file_name",
    "partition_ranges",
    "partition_uri",
]

BLOCK_NUMBER_WIDTH = 12
"""Digits of each block number in a file name."""

MAX_BLOCK_NUMBER = 10**BLOCK_NUMBER_WIDTH - 1
"""The largest block number a file name can hold."""

_SUFFIX = ".parquet"
# Dataset names follow the DAG's name rule (trace_core.dag.spec): a letter, then
# letters, digits, '_' and '-'. The numbers are anchored at the end, so a name
# containing '_' or digits still splits unambiguously.
_DATASET = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,127}")
_FILE_NAME = re.compile(r"(?P<dataset>.+)_(?P<start>[0-9]+)_(?P<end>[0-9]+)\.parquet")


@dataclass(frozen=True, slots=True)
class CryoRange:
    """What a file name says: the dataset and its inclusive block range."""

    dataset: str
    start: int
    end: int


def _check_dataset(dataset: object, field: str) -> str:
    if not isinstance(dataset, str) or not _DATASET.fullmatch(dataset):
        raise InvalidInput(
            field,
            f"invalid dataset name {dataset!r}: a letter, then letters, digits, '_' or '-' "
            "(at most 128 characters)",
        )
    return dataset


def _check_block(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(field, f"must be an integer, got {type(value).__name__}")
    if not 0 <= value <= MAX_BLOCK_NUMBER:
        raise InvalidInput(field, f"must be between 0 and {MAX_BLOCK_NUMBER}, got {value}")
    return value


def _check_range(start: object, end: object) -> tuple[int, int]:
    first = _check_block(start, "start")
    last = _check_block(end, "end")
    if first > last:
        raise InvalidInput("end", f"must be >= start ({first}), got {last}")
    return first, last


def cryo_file_name(dataset: str, start: int, end: int) -> str:
    """``{dataset}_{start}_{end}.parquet`` with 12-digit numbers; ``end`` is inclusive."""
    _check_dataset(dataset, "dataset")
    first, last = _check_range(start, end)
    w = BLOCK_NUMBER_WIDTH
    return f"{dataset}_{first:0{w}d}_{last:0{w}d}{_SUFFIX}"


def parse_cryo_file_name(name: str, *, field: str = "name") -> CryoRange:
    """The dataset and range of a file named by :func:`cryo_file_name`.

    Only the exact form is accepted (a base name, 12-digit numbers,
    ``start <= end``), so every accepted name round-trips. Raises
    :class:`InvalidInput` naming ``field`` otherwise.
    """
    if not isinstance(name, str):
        raise InvalidInput(field, f"must be a string, got {type(name).__name__}")
    match = _FILE_NAME.fullmatch(name)
    if match is None:
        raise InvalidInput(
            field,
            f"{name!r} is not a Cryo file name '<dataset>_<start>_<end>.parquet' "
            f"with {BLOCK_NUMBER_WIDTH}-digit block numbers",
        )
    dataset = _check_dataset(match["dataset"], field)
    for part in ("start", "end"):
        if len(match[part]) != BLOCK_NUMBER_WIDTH:
            raise InvalidInput(
                field,
                f"{name!r}: {part} block {match[part]!r} must have exactly "
                f"{BLOCK_NUMBER_WIDTH} digits",
            )
    start, end = int(match["start"]), int(match["end"])
    if start > end:
        raise InvalidInput(field, f"{name!r}: start block {start} is after end block {end}")
    return CryoRange(dataset, start, end)


def partition_uri(location: str, dataset: str, start: int, end: int) -> str:
    """The URI of a partition file under a dataset version ``location``.

    ``location`` is a version prefix such as
    ``s3://trace-lite/default/dataset/<uuid>/version/<uuid>/`` and must end with
    ``/`` (a prefix, never an object).
    """
    if not isinstance(location, str) or not location:
        raise InvalidInput("location", "must be a non-empty string")
    if not location.endswith("/"):
        raise InvalidInput("location", f"must end with '/' (a version prefix), got {location!r}")
    return location + cryo_file_name(dataset, start, end)


def partition_ranges(start: int, end: int, size: int) -> list[tuple[int, int]]:
    """``start..end`` split at multiples of ``size``: ranges ``[k*size, k*size+size-1]``.

    Boundaries are aligned to multiples of ``size`` whatever ``start`` is, so
    two requests over overlapping ranges produce the same partitions; the
    first and last range are clipped to ``start`` and ``end``.
    """
    first, last = _check_range(start, end)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise InvalidInput("size", f"must be a positive integer, got {size!r}")
    ranges: list[tuple[int, int]] = []
    low = first
    while low <= last:
        high = min((low // size + 1) * size - 1, last)
        ranges.append((low, high))
        low = high + 1
    return ranges
