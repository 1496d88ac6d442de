"""A deterministic synthetic block chain: Cryo-like ``blocks`` and ``transactions`` tables.

No network and no state: every row is a pure function of ``(seed, chain_id,
block_number[, transaction_index])``, computed with a counter-based hash
(splitmix64 over ``uint64`` numpy arrays). Generating blocks ``0..999`` at once
therefore equals concatenating ``0..499`` and ``500..999``, whatever the
partitioning, which is what makes re-running a partition reproduce it exactly.

The shapes are chosen so the example pipeline's filters matter: the number of
transactions per block is uniform in ``0..2*mean`` (so some blocks are empty),
about 2% of blocks are heavy (``3*mean..5*mean``); about 30% of transactions
carry no value and about 5% failed. Senders come from a pool of 1024 addresses,
so a block often has fewer unique senders than transactions. A block's
``gas_used`` and ``transaction_count`` are the sum and count of its
transactions, and ``parent_hash`` is the previous block's ``block_hash``
(all zeros for the genesis block).

Everything is vectorized (no per-row Python): binary columns are built from
numpy buffers with :meth:`pyarrow.FixedSizeBinaryArray.from_buffers`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from trace_core.errors import InvalidInput
from trace_lite.pipeline.cryo import MAX_BLOCK_NUMBER  # the largest a Cryo file name can hold

__all__ = [
    "BLOCK_SCHEMA",
    "MAX_BLOCKS_PER_CALL",
    "TRANSACTION_SCHEMA",
    "SyntheticChain",
    "conform",
]

BLOCK_SCHEMA = pa.schema(
    [
        ("block_number", pa.int64()),
        ("block_hash", pa.binary(32)),
        ("parent_hash", pa.binary(32)),
        ("timestamp", pa.int64()),
        ("miner", pa.binary(20)),
        ("gas_used", pa.int64()),
        ("base_fee_per_gas", pa.int64()),
        ("transaction_count", pa.int32()),
    ]
)
"""Columns of :meth:`SyntheticChain.blocks` (all nullable, like Spark writes them)."""

TRANSACTION_SCHEMA = pa.schema(
    [
        ("block_number", pa.int64()),
        ("transaction_index", pa.int32()),
        ("transaction_hash", pa.binary(32)),
        ("from_address", pa.binary(20)),
        ("to_address", pa.binary(20)),
        ("value", pa.int64()),
        ("gas_used", pa.int64()),
        ("gas_price", pa.int64()),
        ("success", pa.bool_()),
    ]
)
"""Columns of :meth:`SyntheticChain.transactions`."""

MAX_BLOCKS_PER_CALL = 10_000_000
"""The widest range one call generates (bounds the memory of a single call)."""

_MAX_MEAN_TXS = 100_000  # 5 * mean (a heavy block) must fit transaction_count's int32
_MAX_U64 = (1 << 64) - 1
_CHUNK_TRANSACTIONS = 1 << 18
_GWEI = 1_000_000_000
_SENDERS = 1024  # index taken from 10 hash bits
_RECEIVERS = 4096  # 12 hash bits
_MINERS = 16  # 4 hash bits

_GAMMA = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's increment (odd: a full-period counter)
_TX_GAMMA = np.uint64(0xD1B54A32D192ED03)  # a second odd constant for the transaction counter
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_R27, _R30, _R31 = np.uint64(27), np.uint64(30), np.uint64(31)

_U64 = NDArray[np.uint64]


def _stream(name: str) -> np.uint64:
    """A 64-bit constant per field, so two fields of one row are independent draws."""
    return np.uint64(int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big"))


_S_CHAIN = _stream("chain_id")
_S_COUNT = _stream("transaction_count")
_S_BLOCK = _stream("block_fields")
_S_BLOCK_HASH = _stream("block_hash")
_S_TX_A = _stream("transaction_fields_a")
_S_TX_B = _stream("transaction_fields_b")
_S_TX_HASH = _stream("transaction_hash")
_S_SENDER = _stream("sender_pool")
_S_RECEIVER = _stream("receiver_pool")
_S_MINER = _stream("miner_pool")


def _mix(x: _U64) -> _U64:
    """splitmix64's output function, elementwise (a bijection of uint64 with good avalanche).

    Array arithmetic on uint64 wraps modulo 2**64 without warnings, which is
    the intended arithmetic here. One scratch array is reused for the shifts:
    at millions of rows, allocations cost more than the arithmetic.
    """
    z = x + _GAMMA
    scratch = np.empty_like(z)
    np.right_shift(z, _R30, out=scratch)
    z ^= scratch
    z *= _M1
    np.right_shift(z, _R27, out=scratch)
    z ^= scratch
    z *= _M2
    np.right_shift(z, _R31, out=scratch)
    z ^= scratch
    return z


def _words(keys: _U64, stream: np.uint64, count: int) -> _U64:
    """``count`` hash words per key, as a C-contiguous ``(len(keys), count)`` array."""
    streams = stream ^ np.arange(count, dtype=np.uint64)
    # Broadcasting lays the inputs out row by row, so one pass of _mix fills the
    # rows in their final (contiguous) layout.
    return _mix(keys[:, None] ^ streams[None, :])


def _fixed_binary(words: _U64, width: int) -> pa.FixedSizeBinaryArray:
    """The first ``width`` bytes of each row of ``words`` (little-endian) as binary(width)."""
    data = words.astype("<u8", copy=False).view(np.uint8)
    if data.shape[1] != width:
        data = np.ascontiguousarray(data[:, :width])
    return _binary_from_bytes(data.reshape(-1), width)


def _binary_from_bytes(data: NDArray[Any], width: int) -> pa.FixedSizeBinaryArray:
    """``data`` (contiguous, ``width`` bytes per value) as a binary(width) array, no copy."""
    return pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(width), data.nbytes // width, [None, pa.py_buffer(data)]
    )


def _address_pool(chain_key: np.uint64, stream: np.uint64, size: int) -> NDArray[np.void]:
    """``size`` 20-byte addresses derived from the chain key, as a 1-D ``V20`` array.

    One opaque 20-byte item per address: indexing it by a sender index array
    copies whole items, much faster than gathering rows of a 2-D byte array.
    """
    keys = _mix(np.arange(size, dtype=np.uint64) + (chain_key ^ stream))
    raw = np.ascontiguousarray(_words(keys, stream, 3).astype("<u8").view(np.uint8)[:, :20])
    return raw.view(np.dtype("V20")).reshape(size)


def _check_int(field: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise InvalidInput(field, f"must be an integer, got {type(value).__name__}")
    number = int(value)
    if not low <= number <= high:
        raise InvalidInput(field, f"must be between {low} and {high}, got {number}")
    return number


def _check_range(start: object, end: object) -> tuple[int, int]:
    first = _check_int("start", start, 0, MAX_BLOCK_NUMBER)
    last = _check_int("end", end, 0, MAX_BLOCK_NUMBER)
    if first > last:
        raise InvalidInput("end", f"must be >= start ({first}), got {last}")
    if last - first + 1 > MAX_BLOCKS_PER_CALL:
        raise InvalidInput(
            "end", f"range of {last - first + 1} blocks exceeds {MAX_BLOCKS_PER_CALL} per call"
        )
    return first, last


@dataclass(frozen=True)
class _Blocks:
    """Per-block draws of one range, shared by :meth:`blocks` and :meth:`transactions`."""

    numbers: NDArray[np.int64]
    keys: _U64
    counts: NDArray[np.int64]
    base_fee: NDArray[np.int64]
    miner_index: NDArray[np.intp]


@dataclass(frozen=True)
class _Transactions:
    block_numbers: NDArray[np.int64]
    indexes: NDArray[np.int64]
    keys: _U64
    fields: _U64  # the draw that decides success, value == 0, addresses and gas_used
    gas_used: NDArray[np.int64]


@dataclass(frozen=True)
class SyntheticChain:
    """A reproducible chain; equal parameters always produce equal rows.

    ``mean_txs_per_block`` is the mean of ordinary blocks (uniform in
    ``0..2*mean``); heavy blocks raise the overall mean by about 6%.
    """

    seed: int
    chain_id: int = 1
    mean_txs_per_block: int = 20
    genesis_timestamp: int = 1_700_000_000
    block_time_seconds: int = 12

    def __post_init__(self) -> None:
        _check_int("seed", self.seed, 0, _MAX_U64)
        _check_int("chain_id", self.chain_id, 0, _MAX_U64)
        _check_int("mean_txs_per_block", self.mean_txs_per_block, 0, _MAX_MEAN_TXS)
        # Bounds keep genesis + MAX_BLOCK_NUMBER * block_time inside int64.
        _check_int("genesis_timestamp", self.genesis_timestamp, 0, 2**40)
        _check_int("block_time_seconds", self.block_time_seconds, 1, 86_400)

    def blocks(self, start: int, end: int) -> pa.Table:
        """Blocks ``start..end`` (inclusive) with :data:`BLOCK_SCHEMA`, ordered by number.

        Wide ranges come back as a chunked table (one chunk per slice generated).
        """
        first, last = _check_range(start, end)
        return self._chunked(first, last, self._blocks_table)

    def transactions(self, start: int, end: int) -> pa.Table:
        """Transactions of blocks ``start..end`` with :data:`TRANSACTION_SCHEMA`.

        Ordered by ``(block_number, transaction_index)``; possibly chunked.
        """
        first, last = _check_range(start, end)
        return self._chunked(first, last, self._transactions_table)

    def _chunked(self, first: int, last: int, build: Callable[[int, int], pa.Table]) -> pa.Table:
        # Slices of about 2**18 transactions: temporaries of that size are reused
        # by the allocator and stay in cache, while fresh multi-megabyte arrays
        # cost a page fault per 4 KiB (several times slower on this kind of VM).
        step = max(1, _CHUNK_TRANSACTIONS // max(1, self.mean_txs_per_block))
        tables = [build(lo, min(lo + step - 1, last)) for lo in range(first, last + 1, step)]
        return tables[0] if len(tables) == 1 else pa.concat_tables(tables)

    def _blocks_table(self, first: int, last: int) -> pa.Table:
        b = self._blocks(first, last)
        txs = self._transaction_draws(b)
        # Exact integer per-block sums through a prefix sum (reduceat mishandles empty blocks).
        prefix = np.concatenate((np.zeros(1, dtype=np.int64), np.cumsum(txs.gas_used)))
        ends = np.cumsum(b.counts)
        gas_used = prefix[ends] - prefix[ends - b.counts]
        hashes = _words(b.keys, _S_BLOCK_HASH, 4)
        parents = np.empty_like(hashes)
        parents[1:] = hashes[:-1]
        if first == 0:
            parents[0] = 0
        else:
            previous = self._block_keys(np.array([first - 1], dtype=np.int64))
            parents[0] = _words(previous, _S_BLOCK_HASH, 4)[0]
        miners = _address_pool(self._chain_key(), _S_MINER, _MINERS)
        timestamps = self.genesis_timestamp + b.numbers * self.block_time_seconds
        columns: list[Any] = [
            pa.array(b.numbers, pa.int64()),
            _fixed_binary(hashes, 32),
            _fixed_binary(parents, 32),
            pa.array(timestamps, pa.int64()),
            _binary_from_bytes(miners[b.miner_index].view(np.uint8), 20),
            pa.array(gas_used, pa.int64()),
            pa.array(b.base_fee, pa.int64()),
            pa.array(b.counts.astype(np.int32), pa.int32()),
        ]
        return pa.Table.from_arrays(columns, schema=BLOCK_SCHEMA)

    def _transactions_table(self, first: int, last: int) -> pa.Table:
        b = self._blocks(first, last)
        txs = self._transaction_draws(b)
        # Bits of the first draw: 0-7 success, 8-15 zero value, 16-25 sender,
        # 26-37 receiver, 38-63 gas_used (see _transaction_draws).
        a = txs.fields
        extra = _mix(txs.keys ^ _S_TX_B)
        key = self._chain_key()
        senders = _address_pool(key, _S_SENDER, _SENDERS)
        receivers = _address_pool(key, _S_RECEIVER, _RECEIVERS)
        from_index = ((a >> np.uint64(16)) & np.uint64(_SENDERS - 1)).astype(np.intp)
        to_index = ((a >> np.uint64(26)) & np.uint64(_RECEIVERS - 1)).astype(np.intp)
        success = (a & np.uint64(0xFF)) >= np.uint64(13)  # 13/256: about 5% fail
        no_value = ((a >> np.uint64(8)) & np.uint64(0xFF)) < np.uint64(77)  # about 30%
        # 40-bit values keep any block's sum far from int64 overflow (Spark's ANSI
        # mode would raise on it); values below 2**63 make the int64 views exact.
        value = ((extra >> np.uint64(24)) + np.uint64(1)).view(np.int64)
        value[no_value] = 0
        tip = ((extra & np.uint64(0xFFFFFF)) << np.uint64(8)).view(np.int64)  # < 4.3 gwei
        gas_price = np.repeat(b.base_fee, b.counts) + tip
        columns: list[Any] = [
            pa.array(txs.block_numbers, pa.int64()),
            pa.array(txs.indexes.astype(np.int32), pa.int32()),
            _fixed_binary(_words(txs.keys, _S_TX_HASH, 4), 32),
            _binary_from_bytes(senders[from_index].view(np.uint8), 20),
            _binary_from_bytes(receivers[to_index].view(np.uint8), 20),
            pa.array(value, pa.int64()),
            pa.array(txs.gas_used, pa.int64()),
            pa.array(gas_price, pa.int64()),
            pa.array(success, pa.bool_()),
        ]
        return pa.Table.from_arrays(columns, schema=TRANSACTION_SCHEMA)

    def _chain_key(self) -> np.uint64:
        key = _mix(np.array([self.seed], dtype=np.uint64))
        key = _mix(key ^ (np.uint64(self.chain_id) ^ _S_CHAIN))
        return np.uint64(key[0])

    def _block_keys(self, numbers: NDArray[np.int64]) -> _U64:
        # The splitmix64 sequence at position block_number: a counter, not a chain
        # of states, so any block is computed without its predecessors.
        return _mix(numbers.astype(np.uint64) * _GAMMA + self._chain_key())

    def _blocks(self, first: int, last: int) -> _Blocks:
        numbers = np.arange(first, last + 1, dtype=np.int64)
        keys = self._block_keys(numbers)
        draw = _mix(keys ^ _S_COUNT)
        mean = self.mean_txs_per_block
        spread = (draw >> np.uint64(8)) % np.uint64(2 * mean + 1)
        heavy = (draw & np.uint64(0xFF)) < np.uint64(5)  # 5/256: about 2% heavy blocks
        counts = (spread + np.where(heavy, np.uint64(3 * mean), np.uint64(0))).astype(np.int64)
        fields = _mix(keys ^ _S_BLOCK)
        base_fee = (np.uint64(_GWEI) + (fields >> np.uint64(8)) % np.uint64(99 * _GWEI)).view(
            np.int64
        )
        miner_index = (fields & np.uint64(_MINERS - 1)).astype(np.intp)
        return _Blocks(numbers, keys, counts, base_fee, miner_index)

    def _transaction_draws(self, b: _Blocks) -> _Transactions:
        total = int(b.counts.sum())
        block_numbers = np.repeat(b.numbers, b.counts)
        starts = np.cumsum(b.counts) - b.counts
        indexes = np.arange(total, dtype=np.int64) - np.repeat(starts, b.counts)
        keys = _mix(
            np.repeat(b.keys, b.counts) + (indexes.view(np.uint64) + np.uint64(1)) * _TX_GAMMA
        )
        fields = _mix(keys ^ _S_TX_A)
        # gas_used in 21_000..500_000 from the top 26 bits by multiply-shift
        # (a uint64 modulo costs more than the rest of the column).
        gas_used = (
            np.uint64(21_000) + (((fields >> np.uint64(38)) * np.uint64(479_001)) >> np.uint64(26))
        ).view(np.int64)
        return _Transactions(block_numbers, indexes, keys, fields, gas_used)


def conform(table: pa.Table, schema: pa.Schema, *, field: str = "table") -> pa.Table:
    """``table``'s columns of ``schema``, in its order, cast to its types.

    Spark has no fixed-size binary type: it reads and writes
    ``fixed_size_binary(n)`` as variable ``binary``. Casting back checks every
    value has exactly ``n`` bytes. Raises :class:`InvalidInput` naming ``field``
    for a missing column or a value that does not fit.
    """
    arrays = []
    for target in schema:
        if target.name not in table.column_names:
            raise InvalidInput(field, f"missing column {target.name!r}")
        try:
            arrays.append(table.column(target.name).cast(target.type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise InvalidInput(
                field, f"column {target.name!r} does not fit {target.type}: {exc}"
            ) from exc
    return pa.Table.from_arrays(arrays, schema=schema)
