"""An independent reference of the block aggregation, in plain pyarrow (no Spark).

Tests compare :func:`trace_lite.pipeline.transforms.aggregate_blocks` (Spark,
with filters as SQL text) against :func:`reference_aggregates` (Arrow's own
group-by and join, with filters as ``pyarrow.compute`` expressions): two
engines and two filter paths that share only the chain generator and the
parsed predicate.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from trace_lite.pipeline.chain import SyntheticChain
from trace_lite.pipeline.predicate import parse_where
from trace_lite.pipeline.transforms import AGGREGATE_SCHEMA

__all__ = ["aggregate_blocks_arrow", "reference_aggregates"]


def aggregate_blocks_arrow(blocks: pa.Table, transactions: pa.Table) -> pa.Table:
    """What ``aggregate_blocks`` computes, with :data:`AGGREGATE_SCHEMA`, ordered by number."""
    success = transactions.column("success")
    flags = pa.table(
        {
            "block_number": transactions.column("block_number"),
            # A null success counts as neither, as in SQL's COUNT(CASE WHEN ...).
            "succeeded": pc.if_else(pc.fill_null(success, False), 1, 0),
            "failed": pc.if_else(pc.fill_null(pc.invert(success), False), 1, 0),
            "value": transactions.column("value"),
            "gas_used": transactions.column("gas_used"),
            "gas_price": transactions.column("gas_price"),
            "from_address": transactions.column("from_address"),
        }
    )
    per_block = flags.group_by("block_number").aggregate(
        [
            ([], "count_all"),
            ("succeeded", "sum"),
            ("failed", "sum"),
            ("value", "sum"),
            ("gas_used", "sum"),
            ("gas_price", "max"),
            ("from_address", "count_distinct"),
        ]
    )
    joined = (
        blocks.select(["block_number", "timestamp"])
        .join(per_block, "block_number", join_type="left outer")
        .sort_by("block_number")
    )

    def zero_if_null(name: str) -> pa.ChunkedArray:
        return pc.fill_null(joined.column(name), 0)

    columns = [
        joined.column("block_number"),
        joined.column("timestamp"),
        zero_if_null("count_all"),
        zero_if_null("succeeded_sum"),
        zero_if_null("failed_sum"),
        zero_if_null("value_sum"),
        zero_if_null("gas_used_sum"),
        joined.column("gas_price_max"),
        zero_if_null("from_address_count_distinct"),
    ]
    return pa.Table.from_arrays(
        [c.cast(f.type) for c, f in zip(columns, AGGREGATE_SCHEMA, strict=True)],
        schema=AGGREGATE_SCHEMA,
    )


def reference_aggregates(
    chain: SyntheticChain, start: int, end: int, *, transactions_where: str | None = None
) -> pa.Table:
    """The aggregates of blocks ``start..end`` of ``chain``, transactions filtered first.

    ``transactions_where`` is a ``where:`` filter (see
    :mod:`trace_lite.pipeline.predicate`), checked against the transaction
    schema; errors name the field ``transactions_where``.
    """
    blocks = chain.blocks(start, end)
    transactions = chain.transactions(start, end)
    if transactions_where is not None:
        predicate = parse_where(transactions_where, field="transactions_where")
        predicate.check_schema(transactions.schema, field="transactions_where")
        transactions = transactions.filter(predicate.to_arrow())
    return aggregate_blocks_arrow(blocks, transactions)
