"""The lite profile's Spark session: configuration and a lazy, shared provider.

Operators that run on Spark get their session from one
:class:`SparkSessionProvider` per process: it starts the session on the first
:meth:`~SparkSessionProvider.get` (a local JVM takes seconds to start, so
nothing pays for it until Spark is actually used), hands every thread the same
session, and stops it once. pyspark is imported only inside those calls, so
this module imports without the ``spark`` extra installed.

The provider outlives a dead driver: when the JVM exits (out of memory under
``-XX:+ExitOnOutOfMemoryError``, killed, crashed) every later call on the old
session fails, so :meth:`~SparkSessionProvider.get` checks, cheaply, that the
session it hands out is alive and otherwise starts a new one (logged at
WARNING). Tasks that were running on the dead JVM fail and are retried by the
Dispatcher; their retries get the new session.

A classic (local or cluster) session is a process-wide singleton in pyspark:
two providers in one process would share it, so keep one per process.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["DEFAULT_SPARK_CONF", "SparkConfig", "SparkSessionProvider"]

log = logging.getLogger(__name__)

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
    """One lazily started session shared by every thread of the process.

    A session found dead on :meth:`get` is replaced (see the module docstring):
    a classic session whose driver JVM exited or whose context was stopped,
    a Spark Connect session whose client was closed or whose server-side
    session was lost (the server's JVM is not this process's to restart).
    """

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

        A session that died since the last call is replaced by a new one,
        started once however many threads ask at the same time. After
        :meth:`stop`, the next call starts a new session.
        """
        session = self._session
        if session is not None and self._death(session) is None:
            return session
        with self._lock:
            # Checked again: another thread may have started (or replaced) it
            # while we waited for the lock.
            session = self._session
            if session is not None and (death := self._death(session)) is not None:
                log.warning(
                    "Spark session %r: %s; starting a new one", self.config.app_name, death.reason
                )
                self._forget(session, death)
                session = self._session = None
            if session is None:
                session = self._session = self._start()
            return session

    def stop(self) -> None:
        """Stop the session if one is running; calling it again does nothing."""
        with self._lock:
            session, self._session = self._session, None
            if session is None:
                return
            death = self._death(session)
            if self.config.remote is not None:
                _stop_remote(session)
            elif death is None:
                session.stop()
            else:
                self._forget(session, death)

    def _start(self) -> SparkSession:
        from pyspark.sql import SparkSession

        builder = SparkSession.builder.appName(self.config.app_name)
        if self.config.remote is not None:
            _probe_connect_server(self.config.remote)
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

    def _death(self, session: SparkSession) -> _Death | None:
        """Why ``session`` can no longer be used, or ``None`` while it can."""
        if self.config.remote is not None:
            # A flag of the client (no round trip): set by stop() and when the
            # server reports that the session it knew is gone.
            remote: Any = session  # a pyspark.sql.connect SparkSession
            return _Death("the Spark Connect session is closed") if remote.is_stopped else None
        return _classic_death(session)

    def _forget(self, session: SparkSession, death: _Death) -> None:
        """Drop a dead session without waiting on the JVM it ran on."""
        if self.config.remote is not None:
            _stop_remote(session)
        else:
            _forget_classic(session, death)


_CONNECT_DEFAULT_PORT = 15002
_CONNECT_PROBE_TIMEOUT_S = 10.0


def _probe_connect_server(remote: str) -> None:
    """Fail at once, naming host and port, when nothing listens at ``remote``.

    The Spark Connect client retries its first call for about ten minutes
    before it reports an unreachable server; a wrong URL should say so now.
    Only host and port are named: the URL may carry a token.
    """
    parsed = urllib.parse.urlparse(remote)
    if parsed.scheme != "sc" or not parsed.hostname:
        raise ValueError("spark remote: expected sc://host[:port][/;param=value...]")
    host, port = parsed.hostname, parsed.port or _CONNECT_DEFAULT_PORT
    try:
        with socket.create_connection((host, port), timeout=_CONNECT_PROBE_TIMEOUT_S):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConnectionError(
            f"no Spark Connect server accepts connections at {host}:{port} ({reason})"
        ) from exc


def _stop_remote(session: Any) -> None:
    """Stop a Spark Connect client, releasing its server-side session with one try.

    With the client's default retry policy a release to a server that is gone
    waits about ten minutes; a session that cannot be released in one call
    dies with its server anyway. Best effort, never raises; clears pyspark's
    default and active session.
    """
    with contextlib.suppress(Exception):  # an older client without the setter
        session.client.set_retry_policies([])
    session.stop()


@dataclass(frozen=True)
class _Death:
    """Why a session can no longer be used."""

    reason: str
    """For the log: no URL (a Spark Connect URL may carry a token)."""
    jvm_lost: bool = False
    """Classic sessions: the driver JVM itself is gone (exited or not answering),
    so the next session needs a new one, not just a new context."""


def _classic_death(session: Any) -> _Death | None:
    """:meth:`SparkSessionProvider._death` of a classic session.

    The driver process is polled first (a system call): calling into a JVM
    that exited fails slowly and noisily. Then one trivial gateway call,
    which also sees a context that Spark itself stopped.
    """
    from py4j.protocol import Py4JError  # type: ignore[import-untyped]

    context = session.sparkContext
    driver = _driver_process(context._gateway)
    if driver is not None and (code := driver.poll()) is not None:
        return _Death(f"the driver JVM (pid {driver.pid}) exited with code {code}", jvm_lost=True)
    jsc = context._jsc
    if jsc is None:
        return _Death("its SparkContext was stopped")
    try:
        stopped = jsc.sc().isStopped()
    except (Py4JError, OSError) as exc:
        return _Death(f"the driver JVM does not answer ({type(exc).__name__})", jvm_lost=True)
    return _Death("its SparkContext was stopped") if stopped else None


def _forget_classic(session: Any, death: _Death) -> None:
    """Clear what pyspark caches of a dead session.

    ``SparkSession.stop`` would call into the JVM (and raise, or wait, when it
    is gone); this only resets the Python side, so that ``getOrCreate`` builds
    a new context, on a new JVM when the old one is lost.
    """
    from pyspark.core.context import SparkContext
    from pyspark.sql import SparkSession, SQLContext

    context = session.sparkContext
    gateway = context._gateway
    context._jsc = None  # anyone still holding the context sees it stopped
    if context._accumulatorServer is not None:
        context._accumulatorServer.shutdown()
        context._accumulatorServer = None
    with SparkContext._lock:
        if SparkContext._active_spark_context is context:
            SparkContext._active_spark_context = None
        if death.jvm_lost and SparkContext._gateway is gateway:
            # The next context launches a new JVM instead of dialing the lost one.
            SparkContext._gateway = None
            SparkContext._jvm = None
    SparkSession._instantiatedSession = None
    SparkSession._activeSession = None
    SQLContext._instantiatedContext = None
    if death.jvm_lost and gateway is not None:
        gateway.close()  # the Python side's sockets and callback server
        driver = _driver_process(gateway)
        if driver is not None and driver.stdin is not None:
            with contextlib.suppress(OSError):
                # Left open, the pipe warns when collected; closed, it also ends
                # a lost JVM that still runs (its gateway exits at end of input).
                driver.stdin.close()


def _driver_process(gateway: Any) -> Any:
    """The ``Popen`` of the driver JVM behind ``gateway``, if this process launched it.

    A gateway handed over by ``spark-submit`` (``PYSPARK_GATEWAY_PORT``) has none.
    """
    return getattr(gateway, "proc", None)
