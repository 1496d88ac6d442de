"""The pipeline's Spark computations, and committing a DataFrame as one Parquet file.

:func:`aggregate_blocks` turns ``blocks`` and ``transactions`` into one row
per block; callers apply ``where:`` filters to the inputs first
(``df.where(predicate.sql)``). :func:`commit_parquet` writes a DataFrame as
exactly one Parquet file, atomically: readers see the previous file or the new
one, never a partial file, and re-running a partition replaces its file.

Types as Spark stores them (what a reader of these files gets):

- ``int64`` -> ``LongType`` -> Parquet ``INT64``; ``int32`` -> ``IntegerType``
  -> ``INT32``; ``bool`` -> ``BooleanType`` -> ``BOOLEAN``: unchanged.
- ``fixed_size_binary(n)`` -> ``BinaryType`` -> Parquet ``BYTE_ARRAY``:
  Spark has no fixed-size binary type, so the width is lost on the way
  through Spark. :func:`stored_schema` says what a file holds;
  :func:`trace_lite.pipeline.chain.conform` casts it back (checking widths).
- Aggregates (counts, sums, max) are ``LongType``; they are cast explicitly so
  the output matches :data:`AGGREGATE_SCHEMA` exactly.

pyspark is imported inside the functions that use it, so the schema
constants are importable without it (the pyarrow reference uses them).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from trace_core.errors import InvalidInput

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = [
    "AGGREGATE_SCHEMA",
    "STAGING_PREFIX",
    "aggregate_blocks",
    "commit_parquet",
    "read_parquet_files",
    "stored_schema",
    "write_arrow_parquet",
]

AGGREGATE_SCHEMA = pa.schema(
    [
        ("block_number", pa.int64()),
        ("timestamp", pa.int64()),
        ("tx_count", pa.int64()),
        ("success_count", pa.int64()),
        ("failed_count", pa.int64()),
        ("total_value", pa.int64()),
        ("total_gas_used", pa.int64()),
        ("max_gas_price", pa.int64()),
        ("unique_senders", pa.int64()),
    ]
)
"""Columns of :func:`aggregate_blocks`.

Only ``max_gas_price`` holds nulls (blocks without transactions). Spark marks
the coalesced counts and sums ``not null`` in the files it writes; the types
are exactly these."""

STAGING_PREFIX = "._staging-"
"""Start of the staging directory's name next to a destination (hidden from listings
and from Spark, which skips names starting with ``.`` or ``_``)."""


def stored_schema(schema: pa.Schema) -> pa.Schema:
    """The schema of a Parquet file Spark writes from Arrow data with ``schema``."""
    return pa.schema(
        [
            pa.field(f.name, pa.binary()) if pa.types.is_fixed_size_binary(f.type) else f
            for f in schema
        ]
    )


def aggregate_blocks(blocks: DataFrame, transactions: DataFrame) -> DataFrame:
    """One row per block of ``blocks`` with :data:`AGGREGATE_SCHEMA`, ordered by number.

    ``blocks`` needs ``block_number`` and ``timestamp``; ``transactions`` needs
    ``block_number``, ``success``, ``value``, ``gas_used``, ``gas_price`` and
    ``from_address``. A block without (matching) transactions keeps its row
    with zero counts and sums and a null ``max_gas_price`` (a left join).
    ``success_count`` and ``failed_count`` count true and false; a null
    ``success`` counts in neither.
    """
    from pyspark.sql import functions as F

    per_block = transactions.groupBy("block_number").agg(
        F.count(F.lit(1)).alias("tx_count"),
        F.count(F.when(F.col("success"), True)).alias("success_count"),
        F.count(F.when(~F.col("success"), True)).alias("failed_count"),
        F.sum("value").alias("total_value"),
        F.sum("gas_used").alias("total_gas_used"),
        F.max("gas_price").alias("max_gas_price"),
        F.countDistinct("from_address").alias("unique_senders"),
    )
    zero = F.lit(0).cast("long")
    joined = blocks.select("block_number", "timestamp").join(per_block, "block_number", "left")
    return joined.select(
        F.col("block_number").cast("long").alias("block_number"),
        F.col("timestamp").cast("long").alias("timestamp"),
        *[
            F.coalesce(F.col(name).cast("long"), zero).alias(name)
            for name in (
                "tx_count",
                "success_count",
                "failed_count",
                "total_value",
                "total_gas_used",
            )
        ],
        F.col("max_gas_price").cast("long").alias("max_gas_price"),
        F.coalesce(F.col("unique_senders").cast("long"), zero).alias("unique_senders"),
    ).orderBy("block_number")


def read_parquet_files(spark: SparkSession, paths: Sequence[str | Path]) -> DataFrame:
    """A DataFrame over the given Parquet files (one dataset's partitions)."""
    if isinstance(paths, str | Path) or not paths:
        raise InvalidInput("paths", "must be a non-empty list of Parquet files")
    return spark.read.parquet(*[str(p) for p in paths])


def commit_parquet(df: DataFrame, destination: str | Path) -> int:
    """Write ``df`` as exactly one Parquet file at ``destination``; the number of rows.

    Spark writes one partition (``coalesce(1)``, which keeps the order of a
    sorted DataFrame) into a fresh staging directory next to ``destination``;
    the part file is then renamed onto ``destination``, replacing any previous
    file in one step. The staging directory is removed whatever happens, and a
    failed write leaves a previous file untouched. ``destination`` is a local
    path that the Spark driver and executors share (the lite object store).
    """
    target = Path(destination).absolute()
    if target.is_dir():
        raise InvalidInput("destination", f"{str(target)!r} is a directory, not a file path")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f"{STAGING_PREFIX}{uuid.uuid4().hex}"
    try:
        # The staging directory is fresh (a new uuid): "overwrite" replaces nothing,
        # and unlike the default mode it is supported by Spark Connect too.
        df.coalesce(1).write.mode("overwrite").parquet(str(staging))
        parts = sorted(staging.glob("part-*.parquet"))
        if len(parts) != 1:
            raise RuntimeError(f"Spark wrote {len(parts)} part files into {staging} instead of one")
        rows = int(pq.read_metadata(parts[0]).num_rows)
        _fsync(parts[0])
        os.replace(parts[0], target)
        _fsync(target.parent)  # the rename itself survives a crash
        return rows
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_arrow_parquet(spark: SparkSession, table: pa.Table, destination: str | Path) -> int:
    """Write an Arrow table through Spark with :func:`commit_parquet`; the number of rows.

    The file has :func:`stored_schema` of ``table.schema`` (Spark drops the
    width of fixed-size binary columns); rows keep their order.
    """
    return commit_parquet(spark.createDataFrame(table), destination)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
