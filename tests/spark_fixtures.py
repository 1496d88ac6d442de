"""Spark for tests: one local session per test process, stopped when the session ends.

With pytest-xdist every worker is its own process, so each gets its own
session (and JVM); ``local[2]`` matches the two cores of the CI machines.
Starting a session takes seconds, so it is session-scoped and started only
by the first test that asks for ``spark``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from trace_lite.spark import DEFAULT_SPARK_CONF, SparkConfig, SparkSessionProvider

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

TEST_SPARK_CONFIG = SparkConfig(
    master="local[2]",
    app_name="trace-tests",
    conf={
        **DEFAULT_SPARK_CONF,
        "spark.sql.shuffle.partitions": "2",
        "spark.default.parallelism": "2",
        # Expected failures (a test's failing write) log executor stack traces at
        # WARN; tests only want real errors on the console.
        "spark.log.level": "ERROR",
    },
)
"""The configuration of the tests' session: small and quiet."""


@pytest.fixture(scope="session")
def spark_provider() -> Iterator[SparkSessionProvider]:
    """The process's provider; stopped at the end of the test session."""
    pytest.importorskip("pyspark")
    provider = SparkSessionProvider(TEST_SPARK_CONFIG)
    try:
        yield provider
    finally:
        provider.stop()


@pytest.fixture(scope="session")
def spark(spark_provider: SparkSessionProvider) -> SparkSession:
    """The started session of this test process."""
    return spark_provider.get()
