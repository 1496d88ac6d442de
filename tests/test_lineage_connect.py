"""Column lineage on Spark Connect: the analyzed plan's text, parsed.

The text parser is checked on a plan as a Connect server prints it, then
the classic and the Connect path are compared on the same tiny frames
(select, withColumn, rename, filter, groupBy/agg, join, union, window and
the chain pipeline's aggregation). The Connect server is the one PySpark
ships, started inside the tests' classic JVM (one per test session: no
second JVM); the client is a real Connect session over gRPC on loopback.
"""

from __future__ import annotations

import importlib
import os
import shutil
import socket
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

from trace_core.dag.lineage import ColumnEdge
from trace_lite.lineage_plan import LineageUnavailable
from trace_lite.lineage_plan_text import analyzed_section, inputs_by_shape, parse_analyzed
from trace_lite.lineage_spark import derive_lineage
from trace_lite.pipeline.transforms import aggregate_blocks

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    from trace_lite.spark import SparkSessionProvider

# As a Connect server explains txs.where(...).groupBy().agg(...).join(blocks)
# .withColumnRenamed().withColumn(): ids differ from the inputs' own plans.
EXPLAINED = "\n".join(
    [
        "== Parsed Logical Plan ==",
        "Project [block_number#21L]",
        "+- LocalRelation [block_number#21L]",
        "",
        "== Analyzed Logical Plan ==",
        "block_number: bigint, n: bigint, v: bigint, ts: bigint, hash: string, x: bigint",
        "Project [block_number#21L, n#27L, v#28L, ts#43L, hash#40, "
        "(v#28L * cast(2 as bigint)) AS x#45L]",
        "+- Project [block_number#21L, n#27L, v#28L, timestamp#39L AS ts#43L, hash#40]",
        "   +- Project [block_number#21L, n#27L, v#28L, timestamp#39L, hash#40]",
        "      +- Join Inner, (block_number#21L = block_number#38L)",
        "         :- Aggregate [block_number#21L], "
        "[block_number#21L, count(1) AS n#27L, sum(value#23L) AS v#28L]",
        "         :  +- Filter (value#23L > cast(0 as bigint))",
        "         :     +- LocalRelation [block_number#21L, success#22, value#23L, "
        "gas_used#24L, gas_price#25L, from_address#26]",
        "         +- LocalRelation [block_number#38L, timestamp#39L, hash#40]",
        "",
        "== Optimized Logical Plan ==",
        "LocalRelation [block_number#21L]",
    ]
)
TXS = (
    "LocalRelation [block_number#69L, success#70, value#71L, gas_used#72L, gas_price#73L, "
    "from_address#74]"
)
BLOCKS = "LocalRelation [block_number#86L, timestamp#87L, hash#88]"

TX = "block_number long, success boolean, value long, gas_used long, gas_price long, "
TX += "from_address string"


def table(edges: list[ColumnEdge]) -> set[tuple[str, str, str, str]]:
    return {(e.output_column, e.input_dataset, e.input_column, e.kind) for e in edges}


class _Explained:
    """A stand-in for a Connect DataFrame: what its server explains."""

    def __init__(self, text: str) -> None:
        self.text = text

    def _explain_string(self, extended: bool = False) -> str:
        return self.text if extended else ""


def _explained(tree: str) -> _Explained:
    return _Explained(f"== Analyzed Logical Plan ==\nschema: bigint\n{tree}\n\n== Optimized ==\n")


def test_the_analyzed_text_gives_the_edges_with_inputs_recognised_by_shape() -> None:
    out = _Explained(EXPLAINED)
    inputs = {"transactions": _explained(TXS), "blocks": _explained(BLOCKS)}

    got = table(derive_lineage(out, inputs))  # type: ignore[arg-type]

    assert got == {
        ("block_number", "transactions", "block_number", "IDENTITY"),
        ("n", "transactions", "*", "AGGREGATION"),
        ("v", "transactions", "value", "AGGREGATION"),
        ("ts", "blocks", "timestamp", "IDENTITY"),
        ("hash", "blocks", "hash", "IDENTITY"),
        ("x", "transactions", "value", "AGGREGATION"),  # value → sum → * 2
        ("*", "transactions", "value", "FILTER"),
        ("*", "transactions", "block_number", "GROUP_BY"),
        ("*", "transactions", "block_number", "JOIN"),
        ("*", "blocks", "block_number", "JOIN"),
    }
    root = parse_analyzed(analyzed_section(EXPLAINED))
    assert [a.name for a in root.output] == ["block_number", "n", "v", "ts", "hash", "x"]


def test_text_the_connect_path_cannot_read_is_refused_with_the_reason() -> None:
    wide = _Explained(EXPLAINED.replace("hash#40]", "hash#40, ... 3 more fields]"))
    same = {"a": _explained(BLOCKS), "b": _explained(BLOCKS.replace("#8", "#9"))}
    cases: list[tuple[Any, dict[str, Any], str]] = [
        (wide, {"blocks": _explained(BLOCKS)}, "spark.sql.debug.maxToStringFields"),
        (_Explained(EXPLAINED), same, "cannot be told apart"),
        (_Explained("== Parsed Logical Plan ==\nx\n"), {}, "no analyzed logical plan"),
        (
            _explained("Filter exists#5 []\n:  +- LocalRelation [a#1]\n+- LocalRelation [b#2]"),
            {},
            "subquery",
        ),
        (object(), {}, "explains no plan"),
    ]
    for frame, inputs, reason in cases:
        with pytest.raises(LineageUnavailable, match=reason):
            derive_lineage(frame, inputs)


# --- the same frames on both paths --------------------------------------------------

Frames = tuple["DataFrame", dict[str, "DataFrame"]]


def _renamed_and_aggregated(spark: Any, F: Any) -> Frames:
    orders = spark.createDataFrame(
        [(1, 7, 2.5, "x")], "order_id long, customer long, amount double, note string"
    )
    customers = spark.createDataFrame([(7, "ann", "se")], "id long, name string, country string")
    renamed = orders.withColumnRenamed("amount", "price").withColumn(
        "gross", F.col("price") * F.lit(1.25)
    )
    per_customer = (
        renamed.where(F.col("note") != "void")
        .groupBy("customer")
        .agg(F.sum("gross").alias("spent"), F.count("*").alias("orders"))
    )
    joined = per_customer.join(customers, per_customer.customer == customers.id)
    out = joined.select(
        F.col("name").alias("who"), F.upper("country").alias("country_code"), "spent", "orders"
    )
    return out, {"orders": orders, "customers": customers}


def _union_window_and_global_aggregate(spark: Any, F: Any) -> Frames:
    from pyspark.sql.window import Window

    a = spark.createDataFrame([(1, 2)], "k long, v long")
    b = spark.createDataFrame([(1, "x", 3)], "k long, tag string, w long")
    both = a.select("k", "v").union(b.select("k", F.col("w").alias("v")))
    ranked = both.withColumn("running", F.sum("v").over(Window.partitionBy("k").orderBy("v")))
    totals = ranked.groupBy().agg(F.max("running").alias("top"), F.count(F.lit(1)).alias("n"))
    return totals.crossJoin(b.select(F.col("tag").alias("label"))).distinct(), {"a": a, "b": b}


def _chain_aggregation(spark: Any, F: Any) -> Frames:
    blocks = spark.createDataFrame([(1, 10, "h")], "block_number long, timestamp long, hash string")
    txs = spark.createDataFrame([(1, True, 5, 2, 3, "a")], TX)
    return aggregate_blocks(blocks, txs.where("value > 0")), {"blocks": blocks, "transactions": txs}


# What each case must derive (besides agreeing across the paths).
EXPECTED: dict[str, set[tuple[str, str, str, str]]] = {
    "renamed-derived-filtered-aggregated-joined": {
        ("who", "customers", "name", "IDENTITY"),
        ("country_code", "customers", "country", "TRANSFORMATION"),
        ("spent", "orders", "amount", "AGGREGATION"),  # amount → price → gross → sum
        ("orders", "orders", "*", "AGGREGATION"),
        ("*", "orders", "note", "FILTER"),
        ("*", "orders", "customer", "GROUP_BY"),
        ("*", "orders", "customer", "JOIN"),
        ("*", "customers", "id", "JOIN"),
    },
    "union-window-global-aggregate": {
        # the union's v is a's v and b's w; b read a second time is still b
        ("top", "a", "v", "AGGREGATION"),
        ("top", "b", "w", "AGGREGATION"),
        ("n", "a", "*", "AGGREGATION"),
        ("n", "b", "*", "AGGREGATION"),
        ("label", "b", "tag", "IDENTITY"),
        ("*", "b", "w", "WINDOW"),
        ("*", "b", "tag", "CONDITIONAL"),  # distinct()
    },
    "chain-aggregation": {
        ("tx_count", "transactions", "*", "AGGREGATION"),
        ("timestamp", "blocks", "timestamp", "TRANSFORMATION"),
        ("*", "transactions", "value", "FILTER"),
        ("*", "blocks", "block_number", "SORT"),
    },
}

CASES: dict[str, Callable[[Any, Any], Frames]] = {
    "renamed-derived-filtered-aggregated-joined": _renamed_and_aggregated,
    "union-window-global-aggregate": _union_window_and_global_aggregate,
    "chain-aggregation": _chain_aggregation,
}


def _classic_text_lineage(out: DataFrame, inputs: dict[str, DataFrame]) -> list[ColumnEdge]:
    """The text front end on the classic session's own analyzed plan text,
    with the inputs known by ``exprId`` (the classic plan shares them)."""
    from trace_lite.lineage_plan import plan_lineage

    known = {}
    for name, frame in inputs.items():
        for attr in parse_analyzed(_classic_text(frame)).output:
            known[attr.expr_id] = (name, attr.name)
    text = _classic_text(out)
    known |= inputs_by_shape(text, {name: _classic_text(f) for name, f in inputs.items()})
    return plan_lineage(parse_analyzed(text), known)


def _classic_text(frame: DataFrame) -> str:
    explained = frame._sc._jvm.PythonSQLUtils.explainString(  # type: ignore[union-attr]
        frame._jdf.queryExecution(), "extended"
    )
    return analyzed_section(str(explained))


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_text_front_end_reads_the_classic_plan_text_alike(
    spark: SparkSession, case: str
) -> None:
    from pyspark.sql import functions as F

    out, inputs = CASES[case](spark, F)
    classic = table(derive_lineage(out, inputs))
    assert table(_classic_text_lineage(out, inputs)) == classic
    assert classic >= EXPECTED[case]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _connect_client_available() -> None:
    """Skip unless the Spark Connect client's dependencies import."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # pyspark's pandas version notice
        import pyspark.testing.utils as checks

        if not checks.should_test_connect:
            # The classic session imported it under the tests' warnings-as-errors,
            # which made the pandas notice look like a missing dependency (and left
            # pyspark.sql.connect.functions empty): check again without that.
            importlib.reload(checks)
        if not checks.should_test_connect:
            pytest.skip(
                f"the Spark Connect client cannot run: {checks.connect_requirement_message}"
            )


class _ConnectServer:
    """A Spark Connect server in the classic session's JVM, and a client session of it.

    Another test may stop or kill the process's JVM (``own_spark_provider``)
    between two tests of this module, so the server follows the classic
    session: a new JVM gets a new server. A client whose server died is only
    closed: releasing its session would retry against the dead port for ten
    minutes.
    """

    def __init__(self) -> None:
        self._classic: SparkSession | None = None
        self._service: Any = None
        self._remote: ConnectSession | None = None

    def session_for(self, classic: SparkSession) -> ConnectSession:
        """The client session of a server in ``classic``'s JVM, started if needed."""
        if self._remote is not None and classic is self._classic:
            return self._remote
        self.close(server_alive=False)
        context = classic._jsc.sc()  # type: ignore[union-attr]
        port = _free_port()
        context.conf().set("spark.connect.grpc.binding.address", "127.0.0.1")
        context.conf().set("spark.connect.grpc.binding.port", str(port))
        service = classic._jvm.org.apache.spark.sql.connect.service.SparkConnectService  # type: ignore[union-attr]
        service.start(context)
        self._classic, self._service = classic, service
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # pyspark's pandas version notice
            from pyspark.sql.connect.session import SparkSession as Remote

            self._remote = Remote.builder.remote(f"sc://127.0.0.1:{port}").create()
        return self._remote

    def close(self, *, server_alive: bool) -> None:
        """Close the client (releasing its session only on a live server), then the server."""
        remote, self._remote = self._remote, None
        if remote is None:
            return
        remote.release_session_on_close = server_alive
        remote.stop()
        if server_alive:
            jvm: Any = self._classic._jvm  # type: ignore[union-attr]
            self._service.stop(jvm.scala.Option.empty(), jvm.scala.Option.empty())


@pytest.fixture(scope="session")
def _connect_server(spark_provider: SparkSessionProvider) -> Iterator[_ConnectServer]:
    server = _ConnectServer()
    try:
        yield server
    finally:
        # Torn down before the provider (it depends on it): the JVM is the
        # server's only if the provider still runs the session it was started in.
        alive = spark_provider.started and spark_provider.get() is server._classic
        server.close(server_alive=alive)


@pytest.fixture
def connect_session(
    spark_provider: SparkSessionProvider, _connect_server: _ConnectServer
) -> ConnectSession:
    """A Spark Connect session whose server runs in the tests' classic JVM."""
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("no Java: a Spark Connect server needs a JVM")
    classic = spark_provider.get()
    _connect_client_available()
    return _connect_server.session_for(classic)


@pytest.mark.parametrize("case", sorted(CASES))
def test_connect_derives_the_classic_paths_edges(
    spark: SparkSession,
    connect_session: ConnectSession,
    case: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pyspark.sql import functions as F

    out, inputs = CASES[case](spark, F)
    classic = table(derive_lineage(out, inputs))
    with monkeypatch.context() as patch:
        # pyspark.sql.functions build Connect columns only in Connect mode
        patch.setenv("SPARK_CONNECT_MODE_ENABLED", "1")
        remote_out, remote_inputs = CASES[case](connect_session, F)
    assert getattr(remote_out, "_jdf", None) is None  # really a Connect DataFrame
    connect = table(derive_lineage(remote_out, remote_inputs))
    assert connect == classic
    assert connect >= EXPECTED[case]
