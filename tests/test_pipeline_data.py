"""The example pipeline's data layer: chain, Cryo names, filters, Spark transforms."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trace_core.errors import InvalidInput
from trace_lite.pipeline.chain import BLOCK_SCHEMA, TRANSACTION_SCHEMA, SyntheticChain, conform
from trace_lite.pipeline.cryo import (
    BLOCK_NUMBER_WIDTH,
    CryoRange,
    cryo_file_name,
    parse_cryo_file_name,
    partition_ranges,
    partition_uri,
)
from trace_lite.pipeline.predicate import parse_where
from trace_lite.pipeline.reference import reference_aggregates
from trace_lite.pipeline.transforms import (
    AGGREGATE_SCHEMA,
    STAGING_PREFIX,
    aggregate_blocks,
    commit_parquet,
    read_parquet_files,
    stored_schema,
    write_arrow_parquet,
)
from trace_lite.spark import SparkConfig, SparkSessionProvider

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

SEED = 3  # block 5 of this seed has no transactions (asserted where it matters)


# --- the synthetic chain ----------------------------------------------------------------


def test_generation_is_independent_of_how_the_range_is_split() -> None:
    chain = SyntheticChain(seed=SEED)
    for method in (chain.blocks, chain.transactions):
        whole = method(0, 999)
        for cut in (500, 337, 1):
            parts = pa.concat_tables([method(0, cut - 1), method(cut, 999)])
            assert parts.equals(whole)
    # Across the internal slicing of wide ranges (about 13k blocks per slice).
    wide = chain.transactions(0, 29_999)
    split = pa.concat_tables([chain.transactions(0, 14_999), chain.transactions(15_000, 29_999)])
    assert wide.equals(split)
    assert SyntheticChain(seed=SEED).transactions(0, 99).equals(chain.transactions(0, 99))


def test_seed_and_chain_id_change_every_hash() -> None:
    base = SyntheticChain(seed=1).blocks(0, 99).column("block_hash").to_pylist()
    for other in (SyntheticChain(seed=2), SyntheticChain(seed=1, chain_id=2)):
        hashes = other.blocks(0, 99).column("block_hash").to_pylist()
        assert not set(hashes) & set(base)


def test_schemas() -> None:
    chain = SyntheticChain(seed=SEED)
    assert chain.blocks(10, 20).schema.equals(BLOCK_SCHEMA)
    assert chain.transactions(10, 20).schema.equals(TRANSACTION_SCHEMA)
    assert chain.blocks(7, 7).num_rows == 1


def test_blocks_link_to_their_parent_across_calls() -> None:
    chain = SyntheticChain(seed=SEED)
    blocks = chain.blocks(0, 999)
    hashes = blocks.column("block_hash").to_pylist()
    parents = blocks.column("parent_hash").to_pylist()
    assert parents[0] == bytes(32)
    assert parents[1:] == hashes[:-1]
    assert len(set(hashes)) == len(hashes)
    later = chain.blocks(500, 600)
    assert later.column("parent_hash")[0].as_py() == hashes[499]
    assert blocks.column("block_number").to_pylist() == list(range(1000))
    timestamps = np.asarray(blocks.column("timestamp"))
    assert set(np.diff(timestamps)) == {12}


def test_blocks_agree_with_their_transactions() -> None:
    chain = SyntheticChain(seed=SEED)
    blocks = chain.blocks(0, 999)
    txs = chain.transactions(0, 999)
    per_block = txs.group_by("block_number").aggregate(
        [([], "count_all"), ("gas_used", "sum"), ("transaction_index", "max")]
    )
    by_number = {
        row["block_number"]: row for row in per_block.to_pylist()
    }  # blocks without transactions are absent
    for row in blocks.to_pylist():
        got = by_number.get(row["block_number"])
        if row["transaction_count"] == 0:
            assert got is None
            assert row["gas_used"] == 0
        else:
            assert got is not None
            assert got["count_all"] == row["transaction_count"]
            assert got["gas_used_sum"] == row["gas_used"]
            assert got["transaction_index_max"] == row["transaction_count"] - 1
    assert len(txs.column("transaction_hash").unique()) == txs.num_rows


def test_distributions_make_the_filters_matter() -> None:
    chain = SyntheticChain(seed=SEED)
    counts = np.asarray(chain.blocks(0, 9_999).column("transaction_count"))
    txs = chain.transactions(0, 9_999)
    assert (counts == 0).sum() > 50  # empty blocks
    assert 0.2 < (counts > 30).mean() < 0.4  # a tx_count > 30 alert fires sometimes
    assert counts.max() > 60  # heavy blocks
    assert 18 < counts.mean() < 24
    zero_value = pc.mean(pc.cast(pc.equal(txs.column("value"), 0), pa.int64())).as_py()
    failed = pc.mean(pc.cast(pc.invert(txs.column("success")), pa.int64())).as_py()
    assert 0.27 < zero_value < 0.33
    assert 0.035 < failed < 0.065
    senders = len(txs.column("from_address").unique())
    assert 900 < senders <= 1024  # a pool: senders repeat across and within blocks


@pytest.mark.parametrize(
    ("start", "end", "field"),
    [
        (-1, 5, "start"),
        (5, 4, "end"),
        ("0", 5, "start"),
        (0, True, "end"),
        (0, 10**12, "end"),
        (0, 10_000_000, "end"),
    ],
)
def test_chain_rejects_bad_ranges(start: Any, end: Any, field: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        SyntheticChain(seed=SEED).transactions(start, end)
    assert caught.value.field == field


def test_chain_rejects_bad_parameters() -> None:
    with pytest.raises(InvalidInput) as caught:
        SyntheticChain(seed=-1)
    assert caught.value.field == "seed"
    with pytest.raises(InvalidInput) as caught:
        SyntheticChain(seed=1, mean_txs_per_block=10**6)
    assert caught.value.field == "mean_txs_per_block"
    empty = SyntheticChain(seed=1, mean_txs_per_block=0)
    assert empty.transactions(0, 99).num_rows == 0
    assert set(empty.blocks(0, 99).column("transaction_count").to_pylist()) == {0}


def test_conform_restores_fixed_width_and_refuses_wrong_widths() -> None:
    txs = SyntheticChain(seed=SEED).transactions(0, 9)
    loose = txs.cast(stored_schema(TRANSACTION_SCHEMA))
    assert loose.schema.field("transaction_hash").type == pa.binary()
    assert conform(loose, TRANSACTION_SCHEMA).equals(txs)
    bad = loose.set_column(2, "transaction_hash", pa.array([b"x"] * txs.num_rows, pa.binary()))
    with pytest.raises(InvalidInput, match="transaction_hash") as caught:
        conform(bad, TRANSACTION_SCHEMA, field="inputs.transactions")
    assert caught.value.field == "inputs.transactions"
    with pytest.raises(InvalidInput, match="missing column 'success'"):
        conform(txs.drop_columns(["success"]), TRANSACTION_SCHEMA)


# --- Cryo file names ----------------------------------------------------------------------


def test_cryo_file_name_format() -> None:
    assert cryo_file_name("blocks", 0, 999) == "blocks_000000000000_000000000999.parquet"
    assert BLOCK_NUMBER_WIDTH == 12
    uri = partition_uri("s3://trace-lite/default/dataset/u1/version/v1/", "transactions", 5, 9)
    assert uri == (
        "s3://trace-lite/default/dataset/u1/version/v1/"
        "transactions_000000000005_000000000009.parquet"
    )


def test_cryo_names_sort_by_block_number_beyond_10_to_the_8() -> None:
    starts = [0, 999, 10**8 - 1000, 10**8, 2 * 10**8, 10**9, 10**11, 10**12 - 1000]
    names = [cryo_file_name("blocks", s, s + 999) for s in starts]
    assert sorted(names) == names
    assert sorted(reversed(names)) == names


@settings(max_examples=60)
@given(
    dataset=st.from_regex(r"[A-Za-z][A-Za-z0-9_-]{0,20}", fullmatch=True),
    start=st.integers(0, 10**12 - 1),
    length=st.integers(0, 10**6),
)
def test_cryo_names_round_trip(dataset: str, start: int, length: int) -> None:
    end = min(start + length, 10**12 - 1)
    name = cryo_file_name(dataset, start, end)
    assert parse_cryo_file_name(name) == CryoRange(dataset, start, end)


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("blocks_0_999.parquet", "exactly 12 digits"),
        ("blocks_0000000000000_000000000999.parquet", "exactly 12 digits"),
        ("blocks_000000000999_000000000000.parquet", "after end block"),
        ("blocks_000000000000_000000000999.csv", "not a Cryo file name"),
        ("blocks-000000000000-000000000999.parquet", "not a Cryo file name"),
        ("_000000000000_000000000999.parquet", "not a Cryo file name"),
        ("1blocks_000000000000_000000000999.parquet", "invalid dataset name"),
        ("a/blocks_000000000000_000000000999.parquet", "invalid dataset name"),
        ("blocks_00000000000x_000000000999.parquet", "not a Cryo file name"),
        ("", "not a Cryo file name"),
    ],
)
def test_malformed_cryo_names_are_rejected(name: str, reason: str) -> None:
    with pytest.raises(InvalidInput, match=reason) as caught:
        parse_cryo_file_name(name, field="files[3]")
    assert caught.value.field == "files[3]"


def test_cryo_names_reject_bad_arguments() -> None:
    for args, field in [
        (("blocks", 5, 4), "end"),
        (("blocks", -1, 4), "start"),
        (("blocks", 0, 10**12), "end"),
        (("bl ocks", 0, 1), "dataset"),
    ]:
        with pytest.raises(InvalidInput) as caught:
            cryo_file_name(*args)
        assert caught.value.field == field
    with pytest.raises(InvalidInput, match="must end with '/'") as caught:
        partition_uri("s3://trace-lite/default/dataset/u1/version/v1", "blocks", 0, 1)
    assert caught.value.field == "location"


def test_partition_ranges() -> None:
    assert partition_ranges(0, 2499, 1000) == [(0, 999), (1000, 1999), (2000, 2499)]
    assert partition_ranges(1500, 3200, 1000) == [(1500, 1999), (2000, 2999), (3000, 3200)]
    assert partition_ranges(5, 5, 10) == [(5, 5)]
    assert partition_ranges(10, 19, 10) == [(10, 19)]
    assert partition_ranges(9, 10, 10) == [(9, 9), (10, 10)]
    for args, field in [((0, 10, 0), "size"), ((3, 2, 10), "end"), ((-1, 2, 10), "start")]:
        with pytest.raises(InvalidInput) as caught:
            partition_ranges(*args)
        assert caught.value.field == field


@settings(max_examples=100)
@given(start=st.integers(0, 10**6), length=st.integers(0, 5000), size=st.integers(1, 700))
def test_partition_ranges_cover_the_range_on_aligned_boundaries(
    start: int, length: int, size: int
) -> None:
    end = start + length
    ranges = partition_ranges(start, end, size)
    assert ranges[0][0] == start
    assert ranges[-1][1] == end
    for (_, high), (next_low, _) in itertools.pairwise(ranges):
        assert next_low == high + 1
        assert (high + 1) % size == 0
    for low, high in ranges:
        assert low // size == high // size  # inside one aligned bucket


# --- where: filters -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "sql", "columns"),
    [
        ("value > 0", "`value` > 0", {"value"}),
        ("severity = 'critical'", "`severity` = 'critical'", {"severity"}),
        (
            "tx_count > 100 AND success_count >= 2",
            "`tx_count` > 100 AND `success_count` >= 2",
            {"tx_count", "success_count"},
        ),
        ("0 < value", "`value` > 0", {"value"}),
        ("-5 >= value", "`value` <= -5", {"value"}),
        ("a <> 1", "`a` != 1", {"a"}),
        ("a = 1.50", "`a` = 1.50", {"a"}),
        ("a = .5 or a = 5.", "`a` = 0.5 OR `a` = 5", {"a"}),
        ("s = 'it''s'", "`s` = 'it\\'s'", {"s"}),
        ("s = 'a\\b'", "`s` = 'a\\\\b'", {"s"}),
        ('"odd col`" = TRUE', "`odd col``` = TRUE", {"odd col`"}),
        ('"say ""hi""" is null', '`say "hi"` IS NULL', {'say "hi"'}),
        ("b IS NOT NULL", "`b` IS NOT NULL", {"b"}),
        ("n not in (1, 'x', false)", "`n` NOT IN (1, 'x', FALSE)", {"n"}),
        ("n BETWEEN 1 AND 5 AND m = 2", "(`n` BETWEEN 1 AND 5) AND `m` = 2", {"n", "m"}),
        ("NOT n NOT BETWEEN 1 AND 5", "NOT (`n` NOT BETWEEN 1 AND 5)", {"n"}),
        ("a = 1 OR b = 2 AND c = 3", "`a` = 1 OR (`b` = 2 AND `c` = 3)", {"a", "b", "c"}),
        ("(a = 1 OR b = 2) AND c = 3", "(`a` = 1 OR `b` = 2) AND `c` = 3", {"a", "b", "c"}),
        ("a = 1 AND (b = 2 AND (c = 3))", "`a` = 1 AND `b` = 2 AND `c` = 3", {"a", "b", "c"}),
        ("NOT NOT a = 1", "NOT (NOT (`a` = 1))", {"a"}),
        ("x=1 And(y=2)", "`x` = 1 AND `y` = 2", {"x", "y"}),
        ("  _x1\t>=\n-9223372036854775808 ", "`_x1` >= -9223372036854775808", {"_x1"}),
    ],
)
def test_parse_where_accepts_the_grammar(text: str, sql: str, columns: set[str]) -> None:
    predicate = parse_where(text)
    assert predicate.sql == sql
    assert predicate.columns == frozenset(columns)
    assert str(predicate) == sql


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "empty filter"),
        ("   ", "empty filter"),
        ("value >", "expected a literal, found the end of the filter at position 8"),
        ("lower(s) = 'a'", "function calls are not allowed at position 1"),
        ("s = lower('A')", "function calls are not allowed at position 5"),
        ("a = b", "comparing two columns is not supported"),
        ("1 = 1", "a comparison needs a column on one side"),
        ("a = NULL", "NULL is only allowed in IS NULL"),
        ("NULL = a", "NULL is only allowed in IS NULL"),
        ("a IN (1, NULL)", "NULL is only allowed in IS NULL"),
        ("a > 0; DROP TABLE x", "';' is not allowed"),
        ("a > 0 -- comment", "comments are not allowed at position 7"),
        ("a /* c */ > 0", "comments are not allowed at position 3"),
        ("a IN (SELECT b FROM t)", "expected a literal, found the column 'SELECT'"),
        ("EXISTS (SELECT 1)", "function calls are not allowed"),
        ("a = 'open", "unterminated string literal at position 5"),
        ('"open = 1', "unterminated quoted identifier at position 1"),
        ("a == 1", "expected a literal, found '='"),
        ("a > 1e5", "malformed number '1e'"),
        ("a > 1.2.3", "malformed number"),
        ("a > 99999999999999999999", "outside the 64-bit range"),
        ("a > 0." + "1" * 40, "more than 38 digits"),
        ("a IS 1", "expected NULL after IS"),
        ("a NOT > 1", "expected IN or BETWEEN after NOT"),
        ("a BETWEEN 1 OR 2", "expected AND in BETWEEN"),
        ("(a > 1", "expected ')'"),
        ("a > 1)", "expected AND, OR or the end of the filter, found ')'"),
        ("a > 1 b", "expected AND, OR or the end of the filter, found 'b' at position 7"),
        ("a + 1 > 2", "unexpected character '+'"),
        ("`a` > 1", "unexpected character '`'"),
        ('"" = 1', "empty quoted identifier"),
        ("AND = 1", "expected a column, a literal, NOT or '('"),
        ("a", "expected a comparison, IS, IN or BETWEEN"),
        ("NOT", "found the end of the filter"),
        ("(" * 70 + "a = 1" + ")" * 70, "nested deeper than 64 levels"),
        ("a = " + "1" * 5000, "longer than 4096 characters"),
    ],
)
def test_parse_where_rejects_everything_else(text: str, reason: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        parse_where(text, field="inputs.transactions.where")
    assert caught.value.field == "inputs.transactions.where"
    assert reason in caught.value.reason
    assert str(caught.value).startswith("inputs.transactions.where: ")


def test_parse_where_rejects_a_non_string() -> None:
    with pytest.raises(InvalidInput, match="must be a string") as caught:
        parse_where(5)  # type: ignore[arg-type]
    assert caught.value.field == "where"


def test_check_columns_and_schema_name_the_problem() -> None:
    predicate = parse_where("value > 0 AND sender = 'x' OR Success = TRUE")
    with pytest.raises(InvalidInput, match="unknown columns 'Success', 'sender'") as caught:
        predicate.check_columns(TRANSACTION_SCHEMA.names, field="inputs.tx.where")
    assert caught.value.field == "inputs.tx.where"
    parse_where("value > 0 AND success = TRUE").check_schema(TRANSACTION_SCHEMA)
    for text, column in [
        ("value = 'big'", "'value' is int64"),
        ("success = 1", "'success' is bool"),
        ("gas_used IN (1, TRUE)", "'gas_used' is int64"),
        ("from_address = 'x'", "'from_address' is fixed_size_binary"),
    ]:
        with pytest.raises(InvalidInput, match=column):
            parse_where(text).check_schema(TRANSACTION_SCHEMA)
    parse_where("from_address IS NULL").check_schema(TRANSACTION_SCHEMA)


NULLS = pa.table(
    {
        "id": pa.array(range(12), pa.int64()),
        "n": pa.array([1, 2, None, 5, 10, None, -3, 0, 7, 2, None, 12], pa.int64()),
        "s": pa.array(["a", "b", None, "it's", "", "a\\b", None, "B", "a", "zz", "b", None]),
        "b": pa.array([True, False, None, True, None, False, True, True, False, None, True, False]),
    }
)
"""A table with nulls in every filtered column, for SQL's three-valued logic."""

NULL_CASES = [
    ("n != 1", {1, 3, 4, 6, 7, 8, 9, 11}),
    ("NOT (n = 1)", {1, 3, 4, 6, 7, 8, 9, 11}),
    ("n NOT IN (1, 2)", {3, 4, 6, 7, 8, 11}),
    ("n IN (1, 2)", {0, 1, 9}),
    ("NOT (n BETWEEN 1 AND 5)", {4, 6, 7, 8, 11}),
    ("n = 1 OR b = TRUE", {0, 3, 6, 7, 10}),
    ("NOT (n > 4 AND b = TRUE)", {0, 1, 5, 6, 7, 8, 9, 11}),
    ("s IS NULL", {2, 6, 11}),
    ("s = 'it''s'", {3}),
    ("s = 'a\\b'", {5}),
    ("s > 'a'", {1, 3, 5, 9, 10}),
    ("id BETWEEN 3 AND 5 AND s IS NOT NULL", {3, 4, 5}),
    ("n > 1.5", {1, 3, 4, 8, 9, 11}),
    ("FALSE = b", {1, 5, 8, 11}),
]


def _arrow_ids(table: pa.Table, text: str) -> set[int]:
    predicate = parse_where(text)
    predicate.check_schema(table.schema)
    return set(table.filter(predicate.to_arrow()).column("id").to_pylist())


def _spark_ids(df: DataFrame, text: str) -> set[int]:
    return {row[0] for row in df.where(parse_where(text).sql).select("id").collect()}


@pytest.mark.parametrize(("text", "expected"), NULL_CASES)
def test_arrow_path_follows_sql_null_semantics(text: str, expected: set[int]) -> None:
    assert _arrow_ids(NULLS, text) == expected


@pytest.fixture(scope="module")
def nulls_frame(spark: SparkSession) -> DataFrame:
    return spark.createDataFrame(NULLS).coalesce(1)  # one task per query: tiny data


def test_spark_path_follows_sql_null_semantics(nulls_frame: DataFrame) -> None:
    for text, expected in NULL_CASES:
        assert _spark_ids(nulls_frame, text) == expected, text


_OPS = st.sampled_from(["=", "!=", "<>", "<", "<=", ">", ">="])
_ATOMS = st.one_of(
    st.builds("{} {} {}".format, st.sampled_from(["n", "id"]), _OPS, st.integers(-4, 13)),
    st.builds("{} {} {}".format, st.integers(-4, 13), _OPS, st.sampled_from(["n", "id"])),
    st.builds("n {} {}.5".format, _OPS, st.integers(-2, 11)),
    st.builds("s {} '{}'".format, _OPS, st.sampled_from(["a", "b", "it''s", "", "B", "zz"])),
    st.builds("b {} {}".format, st.sampled_from(["=", "!="]), st.sampled_from(["TRUE", "FALSE"])),
    st.builds(
        "{} IS {}NULL".format, st.sampled_from(["n", "s", "b"]), st.sampled_from(["", "NOT "])
    ),
    st.builds(
        "n {}IN ({})".format,
        st.sampled_from(["", "NOT "]),
        st.lists(st.integers(-3, 12), min_size=1, max_size=3).map(lambda v: ", ".join(map(str, v))),
    ),
    st.builds(
        "n {}BETWEEN {} AND {}".format,
        st.sampled_from(["", "NOT "]),
        st.integers(-3, 6),
        st.integers(0, 12),
    ),
)
_FILTERS = st.recursive(
    _ATOMS,
    lambda inner: st.one_of(
        st.builds("({}) AND ({})".format, inner, inner),
        st.builds("({}) OR ({})".format, inner, inner),
        st.builds("NOT ({})".format, inner),
    ),
    max_leaves=5,
)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_FILTERS)
def test_spark_and_arrow_agree_on_generated_filters(nulls_frame: DataFrame, text: str) -> None:
    assert _spark_ids(nulls_frame, text) == _arrow_ids(NULLS, text)


# --- Spark: writing, reading, aggregating ---------------------------------------------------


def _listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


@pytest.fixture(scope="module")
def chain_files(spark: SparkSession, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Blocks and transactions 0..299 of the chain, written through Spark in Cryo partitions."""
    root = tmp_path_factory.mktemp("chain")
    chain = SyntheticChain(seed=SEED)
    for start, end in partition_ranges(0, 299, 100):
        for dataset, table in (
            ("blocks", chain.blocks(start, end)),
            ("transactions", chain.transactions(start, end)),
        ):
            rows = write_arrow_parquet(spark, table, root / cryo_file_name(dataset, start, end))
            assert rows == table.num_rows
    return root


def test_write_arrow_parquet_keeps_rows_and_values(chain_files: Path) -> None:
    chain = SyntheticChain(seed=SEED)
    assert len(_listing(chain_files)) == 6  # no staging leftovers
    path = chain_files / cryo_file_name("transactions", 100, 199)
    stored = pq.read_table(path)
    # Spark stores fixed_size_binary as binary; everything else keeps its type.
    assert stored.schema.equals(stored_schema(TRANSACTION_SCHEMA))
    assert conform(stored, TRANSACTION_SCHEMA).equals(chain.transactions(100, 199))
    blocks = pq.read_table(chain_files / cryo_file_name("blocks", 0, 99))
    assert conform(blocks, BLOCK_SCHEMA).equals(chain.blocks(0, 99))


@pytest.mark.parametrize(
    "where",
    [
        "value > 0",
        "success = FALSE OR gas_price >= 50000000000",
        "transaction_index IN (0, 1, 2) AND NOT (value = 0)",
        "gas_used NOT BETWEEN 21000 AND 100000",
        "value > 1.5 AND 30 > transaction_index",
    ],
)
def test_spark_and_arrow_filter_transactions_alike(
    spark: SparkSession, chain_files: Path, where: str
) -> None:
    predicate = parse_where(where)
    predicate.check_schema(TRANSACTION_SCHEMA)
    frame = read_parquet_files(spark, [chain_files / cryo_file_name("transactions", 0, 99)])
    keys = frame.where(predicate.sql).select("block_number", "transaction_index").collect()
    table = SyntheticChain(seed=SEED).transactions(0, 99)
    kept = table.filter(predicate.to_arrow())
    assert 0 < kept.num_rows < table.num_rows  # the filter matters
    expected = zip(
        kept.column("block_number").to_pylist(),
        kept.column("transaction_index").to_pylist(),
        strict=True,
    )
    assert sorted((row[0], row[1]) for row in keys) == sorted(expected)


def _partitions(root: Path, dataset: str, start: int, end: int) -> list[Path]:
    paths = []
    for path in sorted(root.glob(f"{dataset}_*.parquet")):
        found = parse_cryo_file_name(path.name)
        if found.start <= end and found.end >= start:
            paths.append(path)
    return paths


@pytest.mark.parametrize(
    ("start", "end", "where"),
    [
        (0, 99, "value > 0"),
        (150, 299, None),
        (0, 299, "success = TRUE AND gas_price > 30000000000"),
    ],
)
def test_aggregate_blocks_matches_the_arrow_reference(
    spark: SparkSession, chain_files: Path, tmp_path: Path, start: int, end: int, where: str | None
) -> None:
    from pyspark.sql import functions as F

    in_range = F.col("block_number").between(start, end)
    blocks = read_parquet_files(spark, _partitions(chain_files, "blocks", start, end))
    txs = read_parquet_files(spark, _partitions(chain_files, "transactions", start, end))
    txs = txs.where(in_range)
    if where is not None:
        txs = txs.where(parse_where(where).sql)
    result = aggregate_blocks(blocks.where(in_range), txs)
    destination = tmp_path / "out" / cryo_file_name("block_aggregates", start, end)
    rows = commit_parquet(result, destination)

    assert rows == end - start + 1
    assert _listing(destination.parent) == [destination.name]
    written = pq.read_table(destination)
    assert [f.type for f in written.schema] == [f.type for f in AGGREGATE_SCHEMA]
    expected = reference_aggregates(SyntheticChain(seed=SEED), start, end, transactions_where=where)
    assert conform(written, AGGREGATE_SCHEMA).equals(expected)  # row for row, in order
    if start == 0:
        empty = expected.filter(pc.field("block_number") == 5).to_pylist()
        assert empty[0]["tx_count"] == 0  # the empty block keeps its row
        assert empty[0]["max_gas_price"] is None
    if where is not None:
        unfiltered = reference_aggregates(SyntheticChain(seed=SEED), start, end)
        assert pc.sum(expected["tx_count"]).as_py() < pc.sum(unfiltered["tx_count"]).as_py()


def test_commit_parquet_writes_one_file_and_replaces_it(
    spark: SparkSession, tmp_path: Path
) -> None:
    destination = tmp_path / "v" / "numbers_000000000000_000000000009.parquet"
    assert commit_parquet(spark.range(10).repartition(3), destination) == 10
    assert _listing(destination.parent) == [destination.name]
    assert sorted(pq.read_table(destination).column("id").to_pylist()) == list(range(10))

    assert commit_parquet(spark.range(100, 103), destination) == 3
    assert _listing(destination.parent) == [destination.name]
    assert pq.read_table(destination).column("id").to_pylist() == [100, 101, 102]

    assert commit_parquet(spark.range(0).selectExpr("id", "'x' AS label"), destination) == 0
    assert pq.read_table(destination).schema.names == ["id", "label"]


def test_commit_parquet_failure_keeps_the_previous_file(
    spark: SparkSession, tmp_path: Path
) -> None:
    from pyspark.errors import PySparkException
    from pyspark.sql import functions as F

    destination = tmp_path / "numbers.parquet"
    commit_parquet(spark.range(5), destination)
    before = destination.read_bytes()
    failing = spark.range(10).select(
        F.when(F.col("id") == 7, F.raise_error(F.lit("boom at 7"))).otherwise(F.col("id"))
    )
    with pytest.raises(PySparkException, match="boom at 7"):
        commit_parquet(failing, destination)
    assert destination.read_bytes() == before
    assert _listing(tmp_path) == ["numbers.parquet"]
    assert not any(name.startswith(STAGING_PREFIX) for name in _listing(tmp_path))


def test_commit_parquet_refuses_a_directory(spark: SparkSession, tmp_path: Path) -> None:
    with pytest.raises(InvalidInput) as caught:
        commit_parquet(spark.range(1), tmp_path)
    assert caught.value.field == "destination"
    with pytest.raises(InvalidInput) as caught:
        read_parquet_files(spark, [])
    assert caught.value.field == "paths"


# --- the session provider ---------------------------------------------------------------------


class _FakeSession:
    def __init__(self) -> None:
        self.stops = 0

    def stop(self) -> None:
        self.stops += 1


def test_provider_starts_one_session_for_concurrent_callers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    provider = SparkSessionProvider(SparkConfig())
    starts: list[_FakeSession] = []
    arrived = 0
    everyone_called = threading.Condition()

    def start() -> _FakeSession:
        # Hold the first starter until every thread has called get(): without
        # the provider's lock, the others would start sessions of their own.
        with everyone_called:
            everyone_called.wait_for(lambda: arrived == 8, timeout=10)
        session = _FakeSession()
        starts.append(session)
        return session

    monkeypatch.setattr(provider, "_start", start)
    monkeypatch.setattr(provider, "_death", lambda session: None)  # no JVM behind a fake
    results: list[object] = []

    def call() -> None:
        nonlocal arrived
        with everyone_called:
            arrived += 1
            everyone_called.notify_all()
        results.append(provider.get())

    threads = [threading.Thread(target=call) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(starts) == 1
    assert len(results) == 8
    assert all(result is starts[0] for result in results)
    assert provider.started
    provider.stop()
    provider.stop()
    assert starts[0].stops == 1
    assert not provider.started
    assert provider.get() is not starts[0]  # a stopped provider starts afresh
    assert len(starts) == 2


def test_spark_session_uses_the_configuration(spark: SparkSession) -> None:
    assert spark.conf.get("spark.sql.session.timeZone") == "UTC"
    assert spark.conf.get("spark.sql.shuffle.partitions") == "2"
    assert spark.sparkContext.getConf().get("spark.ui.enabled") == "false"


def test_modules_import_without_pyspark() -> None:
    code = (
        "import sys; sys.modules['pyspark'] = None\n"
        "import trace_lite.spark, trace_lite.pipeline.reference\n"
        "p = trace_lite.spark.SparkSessionProvider()\n"
        "assert not p.started\n"
        "try:\n"
        "    p.get()\n"
        "except ImportError:\n"
        "    print('lazy')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "lazy"
