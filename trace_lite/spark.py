"""The lite profile's Spark session: configuration and a lazy, shared provider.

Operators that run on Spark get their session from one
:class:`SparkSessionProvider` per process: it starts the session on the first
:meth:`~SparkSessionProvider.get` (a local JVM takes seconds to start, so
nothing pays for it until Spark is actually used), hands every thread the same
session, and stops it once. pyspark is imported only inside those calls, so
this module imports without the ``spark`` extra installed.

A classic (local or cluster) session is a process-wide singleton in pyspark:
two providers in one process would share it, so keep one per process.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["DEFAULT_SPARK_CONF", "SparkConfig", "SparkSessionProvider"]

_LOG_LEVEL_KEY = "spark.log.level"

DEFAULT_SPARK_CONF: Mapping[str, str] = MappingProxyType(
    {
        # No web UI: it binds a port per session (clashes between test workers).
        "spark.ui.enabled": "false",
        # Partitions are small block ranges; the default 200 shuffle partitions
        # would mean 200 tiny tasks per aggregation.
        "spark.sql.shuffle.partitions": "4",
        # Timestamps are rendered and truncated in UTC whatever the host's zone.
        "spark.sql.session.timeZone": "UTC",
        # Applied when the context starts, before the first job logs anything.
        _LOG_LEVEL_KEY: "WARN",
        # No progress bars on the console (they interleave with test and CLI output).
        "spark.ui.showConsoleProgress": "false",
        # The driver is the executor in local mode. JVM DataFrames stay alive
        # until Python's cyclic GC frees their Py4J proxies; with the default
        # 1 GB heap a 10^6-block run ran out of memory (benchmarks/pipeline.py).
        "spark.driver.memory": "3g",
        # An out-of-memory error kills Spark's scheduler thread and every later
        # job waits forever: exit instead, so the attempt fails and is seen.
        "spark.driver.extraJavaOptions": "-XX:+ExitOnOutOfMemoryError",
    }
)
"""The configuration :class:`SparkConfig` starts from."""


@dataclass(frozen=True)
class SparkConfig:
    """How to reach Spark: a local or cluster ``master``, or a Spark Connect ``remote``.

    ``remote`` (``sc://host:port``) wins over ``master`` when set. ``conf``
    is applied to the session builder and replaces :data:`DEFAULT_SPARK_CONF`
    (extend it with ``{**DEFAULT_SPARK_CONF, ...}``); Spark Connect applies
    only runtime (``spark.sql.*``-like) settings and ignores the rest.
    """

    master: str = "local[*]"
    remote: str | None = None
    app_name: str = "trace-lite"
    conf: Mapping[str, str] = field(default_factory=lambda: DEFAULT_SPARK_CONF)


class SparkSessionProvider:
    """One lazily started session shared by every thread of the process."""

    def __init__(self, config: SparkConfig | None = None) -> None:
        self.config = config or SparkConfig()
        self._lock = threading.Lock()
        self._session: SparkSession | None = None

    @property
    def started(self) -> bool:
        """Whether a session is running (started and not stopped)."""
        return self._session is not None

    def get(self) -> SparkSession:
        """The session, started on the first call; concurrent callers get the same one.

        After :meth:`stop`, the next call starts a new session.
        """
        session = self._session
        if session is not None:
            return session
        with self._lock:
            # Double-checked: another thread may have started it while we waited.
            if self._session is None:
                self._session = self._start()
            return self._session

    def stop(self) -> None:
        """Stop the session if one is running; calling it again does nothing."""
        with self._lock:
            session, self._session = self._session, None
            if session is not None:
                session.stop()

    def _start(self) -> SparkSession:
        from pyspark.sql import SparkSession

        builder = SparkSession.builder.appName(self.config.app_name)
        if self.config.remote is not None:
            builder = builder.remote(self.config.remote)
        else:
            builder = builder.master(self.config.master)
        for key, value in self.config.conf.items():
            builder = builder.config(key, value)
        session = builder.getOrCreate()
        if self.config.remote is None:
            # Covers a session that was already running (getOrCreate reused it
            # and spark.log.level only applies at context start).
            session.sparkContext.setLogLevel(self.config.conf.get(_LOG_LEVEL_KEY, "WARN"))
        return session
