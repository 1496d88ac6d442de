"""Column lineage derived from Spark's analyzed plan (classic session, tiny frames).

The chain pipeline's aggregation is checked against the table its code
implies (trace_lite.pipeline.transforms.aggregate_blocks); a renamed or
derived column is followed through select, withColumn, groupBy/agg and a join.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from trace_core.dag.lineage import ColumnEdge
from trace_lite.lineage_spark import derive_lineage
from trace_lite.pipeline.transforms import aggregate_blocks

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytest.importorskip("pyspark")

TX = "block_number long, success boolean, value long, gas_used long, gas_price long, "
TX += "from_address string"


def table(edges: list[ColumnEdge]) -> set[tuple[str, str, str, str]]:
    return {(e.output_column, e.input_dataset, e.input_column, e.kind) for e in edges}


def test_the_range_aggregates_lineage_is_what_aggregate_blocks_computes(
    spark: SparkSession,
) -> None:
    blocks = spark.createDataFrame([(1, 10, "h")], "block_number long, timestamp long, hash string")
    txs = spark.createDataFrame([(1, True, 5, 2, 3, "a")], TX)
    # as range_aggregator runs it: the input's where filter, then the aggregation
    out = aggregate_blocks(blocks, txs.where("value > 0"))

    got = table(derive_lineage(out, {"blocks": blocks, "transactions": txs}))

    agg = "AGGREGATION"
    assert got == {
        ("block_number", "blocks", "block_number", "TRANSFORMATION"),  # cast
        ("timestamp", "blocks", "timestamp", "TRANSFORMATION"),
        ("tx_count", "transactions", "*", agg),  # count(1): the (filtered) rows
        ("success_count", "transactions", "success", agg),
        ("failed_count", "transactions", "success", agg),
        ("total_value", "transactions", "value", agg),
        ("total_gas_used", "transactions", "gas_used", agg),
        ("max_gas_price", "transactions", "gas_price", agg),
        ("unique_senders", "transactions", "from_address", agg),
        # which rows exist, for every column:
        ("*", "transactions", "value", "FILTER"),
        ("*", "transactions", "block_number", "GROUP_BY"),
        ("*", "transactions", "block_number", "JOIN"),
        ("*", "blocks", "block_number", "JOIN"),
        ("*", "blocks", "block_number", "SORT"),
    }
    # 'hash' is read by nothing the output shows
    assert not any(e[2] == "hash" for e in got)


def test_a_renamed_and_derived_column_is_followed_through_select_agg_and_join(
    spark: SparkSession,
) -> None:
    from pyspark.sql import functions as F

    orders = spark.createDataFrame(
        [(1, 7, 2.5, "x")], "order_id long, customer long, amount double, note string"
    )
    customers = spark.createDataFrame([(7, "ann", "se")], "id long, name string, country string")
    renamed = orders.withColumnRenamed("amount", "price").withColumn(
        "gross", F.col("price") * F.lit(1.25)
    )
    per_customer = renamed.groupBy("customer").agg(
        F.sum("gross").alias("spent"), F.count("*").alias("orders")
    )
    joined = per_customer.join(customers, per_customer.customer == customers.id)
    out = joined.select(
        F.col("name").alias("who"),
        F.upper("country").alias("country_code"),
        "spent",
        "orders",
    )

    got = table(derive_lineage(out, {"orders": orders, "customers": customers}))

    assert got == {
        ("who", "customers", "name", "IDENTITY"),
        ("country_code", "customers", "country", "TRANSFORMATION"),
        ("spent", "orders", "amount", "AGGREGATION"),  # amount → price → gross → sum
        ("orders", "orders", "*", "AGGREGATION"),
        ("*", "orders", "customer", "GROUP_BY"),
        ("*", "orders", "customer", "JOIN"),
        ("*", "customers", "id", "JOIN"),
    }
