"""Spark for tests: one local session per test process, stopped when the session ends.

With pytest-xdist every worker is its own process, so each gets its own
session (and JVM); ``local[2]`` matches the two cores of the CI machines.
Starting a session takes seconds, so the provider is session-scoped and
starts the session only when the first test asks for ``spark``.

A test that kills or stops the JVM takes ``own_spark_provider``: pyspark
holds one context per process, so the shared session is stopped for it and
started again, lazily, by the next test that needs Spark. ``spark`` is
module-scoped for the same reason: a module after such a test gets the
session that is running then, not a stopped one.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from trace_lite.spark import DEFAULT_SPARK_CONF, SparkConfig, SparkSessionProvider

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

TEST_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
"""JVM flags of every test Spark JVM: a test JVM runs many tiny jobs for a few
minutes, so the C2 compiler's work never pays back (C1 only), and parallel GC
threads only compete with the other test workers for the two cores."""

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
        # (A query that must be cancelled has to be killable by Spark under C1:
        # see the query-timeout test.)
        "spark.driver.extraJavaOptions": DEFAULT_SPARK_CONF["spark.driver.extraJavaOptions"]
        + " "
        + TEST_JVM_OPTIONS,
    },
)
"""The configuration of the tests' session: small and quiet."""


@pytest.fixture(scope="session")
def spark_config(tmp_path_factory: pytest.TempPathFactory) -> SparkConfig:
    """:data:`TEST_SPARK_CONFIG` with the catalog's warehouse in a temporary
    directory: a view or table made by a test never lands in the checkout."""
    warehouse = tmp_path_factory.mktemp("spark-warehouse")
    conf = {**TEST_SPARK_CONFIG.conf, "spark.sql.warehouse.dir": str(warehouse)}
    return dataclasses.replace(TEST_SPARK_CONFIG, conf=conf)


@pytest.fixture(scope="session")
def spark_provider(spark_config: SparkConfig) -> Iterator[SparkSessionProvider]:
    """The process's provider; stopped at the end of the test session."""
    pytest.importorskip("pyspark")
    provider = SparkSessionProvider(spark_config)
    try:
        yield provider
    finally:
        provider.stop()


@pytest.fixture(scope="module")
def spark(spark_provider: SparkSessionProvider) -> SparkSession:
    """The running session of this test process."""
    return spark_provider.get()


@pytest.fixture
def own_spark_provider(
    spark_provider: SparkSessionProvider, spark_config: SparkConfig
) -> Iterator[SparkSessionProvider]:
    """A provider of this test's own, for tests that kill or stop its JVM.

    The shared session is stopped first (the JVM is the process's, and a
    second provider would share its context), and this one at the end.
    """
    spark_provider.stop()
    provider = SparkSessionProvider(spark_config)
    try:
        yield provider
    finally:
        provider.stop()


def kill_driver(session: SparkSession) -> int:
    """SIGKILL the driver JVM ``session`` runs on and wait for it to exit; its pid."""
    driver = session.sparkContext._gateway.proc  # type: ignore[union-attr]
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait(timeout=60)
    return int(driver.pid)
