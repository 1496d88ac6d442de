"""The lite platform: all of Trace in one process.

:class:`TraceLite` wires, for one state database URL and one data directory,
everything the other profiles run as separate services: migrations, the
Dispatcher (outbox relay, router, launcher, reaper, retries, sources, cron,
backpressure, scaler, promoter), the in-process runner with its worker
threads, capability tokens signed with a local PEM key ring, credentials
minted per attempt for the local object store, the shared Spark session,
and the buffered-dataset sink on a separate data database.

Layout of the data directory (created with mode 700)::

    keys/            signing key ring (PEM, owner-only; created on first start)
    credentials.key  the credential minter's key (owner-only)
    kek.key          the local key-encryption key (owner-only)
    objects/         the object store: s3://<bucket>/<key> -> objects/<bucket>/<key>
    trace.db         the state database, unless a URL is given
    data.db          the data database (buffered tables), unless a URL is given
    lock             the data directory lock (one live platform per directory)

Starting locks the data directory (:mod:`trace_lite.data_dir_lock`; a second
live process is refused, naming the holder's pid), takes back at once the
leases of the directory's previous process and sweeps its stale staging
directories (:mod:`trace_lite.takeover`), applies migrations and creates the
keys on first run; stopping drains sources, lets in-flight tasks finish
(bounded by ``LiteConfig.drain_seconds``), flushes the sink, stops Spark and
releases the lock.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType

import anyio
import anyio.abc

from trace_core.authoring.operators import OperatorRegistry, OperatorSpec
from trace_core.clock import Clock, SystemClock
from trace_core.dag import DagDocument, DeployResult
from trace_core.dag.loader import load_dag
from trace_core.dispatcher.service import Dispatcher, DispatcherConfig
from trace_core.errors import ConfigurationError
from trace_core.security import LocalCredentialMinter
from trace_core.storage.migrate import upgrade
from trace_core.storage.sql import SqlRepository
from trace_lite.buffered import BufferSink, DataDatabase, SinkConfig, SqlDatasetBuffer
from trace_lite.credentials import CredentialBroker, capability_issuer, token_verifier
from trace_lite.data_dir_lock import DataDirLock, lock_data_directory
from trace_lite.disk_space import MIN_FREE_BYTES, check_free_space
from trace_lite.envelope import LocalKeyEncryption
from trace_lite.object_store import LocalObjectStore
from trace_lite.pipeline.operators import ALERT_SCHEMA, PipelineRuntime, pipeline_operators
from trace_lite.query_service import SparkQueryService
from trace_lite.secret_files import read_or_create_secret
from trace_lite.serve import open_signing_keys, read_minter_key
from trace_lite.spark import SparkConfig, SparkSessionProvider
from trace_lite.takeover import Takeover, reclaim_previous_leases, sweep_staging

__all__ = ["LiteConfig", "TraceLite"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LiteConfig:
    """What :class:`TraceLite` runs on."""

    data_dir: Path = Path(".trace")
    database_url: str | None = None
    """The state database; ``sqlite:///<data_dir>/trace.db`` by default."""
    data_database_url: str | None = None
    """The data database of buffered tables; ``sqlite:///<data_dir>/data.db`` by default."""
    workers: int = 4
    """Worker threads running in-process operators at once."""
    spark: SparkConfig = field(default_factory=SparkConfig)
    dispatcher: DispatcherConfig | None = None
    """Every Dispatcher service's settings (``workers`` sets the runner's concurrency)."""
    sink: SinkConfig = field(default_factory=SinkConfig)
    drain_seconds: float = 60.0
    """How long :meth:`TraceLite.stop` waits for in-flight tasks before cancelling them."""
    min_free_bytes: int = MIN_FREE_BYTES
    """Free space the data directory's filesystem needs to start (and for
    ``trace-lite run`` to go on); 0 disables the check."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigurationError("LiteConfig.workers must be >= 1")
        if self.drain_seconds < 0:
            raise ConfigurationError("LiteConfig.drain_seconds must be >= 0")
        if self.min_free_bytes < 0:
            raise ConfigurationError("LiteConfig.min_free_bytes must be >= 0")

    @property
    def state_url(self) -> str:
        """The state database URL."""
        return self.database_url or f"sqlite:///{self.data_dir / 'trace.db'}"

    @property
    def data_url(self) -> str:
        """The data database URL."""
        return self.data_database_url or f"sqlite:///{self.data_dir / 'data.db'}"

    def dispatcher_config(self) -> DispatcherConfig:
        """The Dispatcher's settings with the runner sized to ``workers``."""
        base = self.dispatcher or DispatcherConfig()
        return replace(base, runner=replace(base.runner, concurrency=self.workers))


@dataclass(frozen=True)
class _Parts:
    store: LocalObjectStore
    buffer: SqlDatasetBuffer
    sink: BufferSink
    data: DataDatabase
    spark: SparkSessionProvider
    encryption: LocalKeyEncryption
    query: SparkQueryService | None


class TraceLite:
    """The whole system in one process (see the module docstring).

    Use it as an async context manager, or call :meth:`start` and :meth:`stop`.
    ``operators`` adds operators of your own to the shipped pipeline ones.
    ``spark`` shares a session provider the caller owns (and stops); by
    default the platform makes one from ``config.spark`` and stops it.
    """

    def __init__(
        self,
        config: LiteConfig | None = None,
        *,
        operators: Iterable[OperatorSpec] = (),
        clock: Clock | None = None,
        spark: SparkSessionProvider | None = None,
    ) -> None:
        self.config = config or LiteConfig()
        self._shared_spark = spark
        self.clock = clock or SystemClock()
        self._extra_operators = list(operators)
        self._stack: contextlib.AsyncExitStack | None = None
        self._group: anyio.abc.TaskGroup | None = None
        self._dispatcher: Dispatcher | None = None
        self._repo: SqlRepository | None = None
        self._parts: _Parts | None = None
        self._lock: DataDirLock | None = None
        self.takeover: Takeover | None = None
        """What the last start took over from the data directory's previous process."""

    # --- the wired parts (available once started) ------------------------------

    @property
    def dispatcher(self) -> Dispatcher:
        """The Dispatcher (raises before :meth:`start`)."""
        if self._dispatcher is None:
            raise ConfigurationError("TraceLite is not started")
        return self._dispatcher

    @property
    def repo(self) -> SqlRepository:
        """The state database repository (raises before :meth:`start`)."""
        if self._repo is None:
            raise ConfigurationError("TraceLite is not started")
        return self._repo

    @property
    def store(self) -> LocalObjectStore:
        """The local object store (tasks get scoped handles only)."""
        return self._started().store

    @property
    def buffer(self) -> SqlDatasetBuffer:
        """The buffer of buffered datasets."""
        return self._started().buffer

    @property
    def sink(self) -> BufferSink:
        """The sink that drains :attr:`buffer` into the data database."""
        return self._started().sink

    @property
    def data(self) -> DataDatabase:
        """The data database."""
        return self._started().data

    @property
    def spark(self) -> SparkSessionProvider:
        """The shared, lazily started Spark session."""
        return self._started().spark

    @property
    def query(self) -> SparkQueryService:
        """The query service over this platform's object store and data database,
        for ``create_app(query=...)`` when serving the HTTP API (classic Spark only)."""
        query = self._started().query
        if query is None:
            raise ConfigurationError(
                "the query service needs a classic Spark session, not Spark Connect"
            )
        return query

    @property
    def encryption(self) -> LocalKeyEncryption:
        """Envelope encryption under the local key-encryption key."""
        return self._started().encryption

    def _started(self) -> _Parts:
        if self._parts is None:
            raise ConfigurationError("TraceLite is not started")
        return self._parts

    # --- lifecycle -------------------------------------------------------------

    async def __aenter__(self) -> TraceLite:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Migrate, open (or create) the keys, wire everything, start the services."""
        if self._stack is not None:
            raise ConfigurationError("TraceLite is already started")
        data_dir = self.config.data_dir
        try:
            data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigurationError(
                f"data directory {data_dir}: cannot create it: {exc.strerror or exc}"
            ) from None
        lock = lock_data_directory(data_dir)
        try:
            check_free_space(data_dir, self.config.min_free_bytes)
            await self._start_locked(lock)
        except BaseException:
            lock.release()
            raise
        self._lock = lock

    async def _start_locked(self, lock: DataDirLock) -> None:
        cfg, clock = self.config, self.clock
        data_dir = cfg.data_dir
        await anyio.to_thread.run_sync(upgrade, cfg.state_url)
        staging = await anyio.to_thread.run_sync(sweep_staging, data_dir / "objects")
        ring = await anyio.to_thread.run_sync(open_signing_keys, data_dir, clock)
        minter = LocalCredentialMinter(read_minter_key(data_dir), clock=clock)
        kek = read_or_create_secret(data_dir / "kek.key", "key-encryption key")
        dispatcher_config = cfg.dispatcher_config()

        stack = contextlib.AsyncExitStack()
        try:
            repo = SqlRepository(cfg.state_url)
            stack.push_async_callback(repo.close)
            data = DataDatabase(cfg.data_url)
            stack.push_async_callback(data.close)
            await data.open()
            spark = self._shared_spark or SparkSessionProvider(cfg.spark)
            if self._shared_spark is None:
                stack.push_async_callback(anyio.to_thread.run_sync, spark.stop)
            store = LocalObjectStore(data_dir / "objects", minter)
            buffer = SqlDatasetBuffer(data, clock=clock)
            dispatcher = Dispatcher(
                repo,
                operators=OperatorRegistry(),
                clock=clock,
                config=dispatcher_config,
                capabilities=capability_issuer(ring, repo, clock, dispatcher_config.storage_root),
                credentials=CredentialBroker(token_verifier(ring, clock), minter),
                worker_id=lock.worker_id,
            )
            runtime = PipelineRuntime(store, spark, buffer, dispatcher.state)
            for spec in [*pipeline_operators(runtime), *self._extra_operators]:
                dispatcher.operators.register(spec)
            sink = BufferSink(
                data, repo, [ALERT_SCHEMA], gateway=dispatcher.gateway, clock=clock, config=cfg.sink
            )
            # Before the workers start: they share the prefix of the leases taken back.
            takeover = await reclaim_previous_leases(dispatcher, lock)
            takeover.staging = staging
            group = await stack.enter_async_context(anyio.create_task_group())
            await dispatcher.start(group)
            await sink.start(group)
        except BaseException:
            await stack.aclose()
            raise
        # The query service inspects plans in classic sessions only (not Spark Connect).
        query = (
            None if spark.config.remote else SparkQueryService(spark, store, data=data, state=repo)
        )
        self._parts = _Parts(store, buffer, sink, data, spark, LocalKeyEncryption(kek), query)
        self._stack, self._group, self._dispatcher = stack, group, dispatcher
        self._repo = repo
        self.takeover = takeover
        log.info("trace-lite started: state %s, data dir %s", repo.url.render(), data_dir)

    async def abort(self) -> None:
        """Stop at once, without draining sources or tasks nor flushing the sink
        (a full disk: every write would fail). In-flight work is cancelled; the
        next start takes over its leases at once, and the buffer's records,
        kept in the data database, are flushed then."""
        stack, group = self._stack, self._group
        if stack is None or group is None:
            return
        self._stack = self._group = self._dispatcher = self._repo = None
        self._parts = None
        try:
            group.cancel_scope.cancel()
            await stack.aclose()
        finally:
            lock, self._lock = self._lock, None
            if lock is not None:
                lock.release()

    async def stop(self) -> None:
        """Drain sources and in-flight tasks, flush the sink, stop everything."""
        stack, group, dispatcher = self._stack, self._group, self._dispatcher
        if stack is None or group is None or dispatcher is None:
            return
        try:
            await dispatcher.stop()
            with anyio.move_on_after(self.config.drain_seconds) as scope:
                await dispatcher.runner.drain()
            if scope.cancelled_caught:
                log.warning(
                    "%d tasks still running after %.0f s; cancelling them (their leases "
                    "expire and the reaper retries them on the next start)",
                    dispatcher.runner.in_flight,
                    self.config.drain_seconds,
                )
            await self.sink.stop()
            await self.sink.run_once()  # what the last tasks published
            group.cancel_scope.cancel()
        finally:
            self._stack = self._group = self._dispatcher = self._repo = None
            self._parts = None
            try:
                await stack.aclose()
            finally:
                lock, self._lock = self._lock, None
                if lock is not None:
                    lock.release()

    # --- using it ----------------------------------------------------------------

    async def deploy(self, dag: DagDocument | str | Path) -> DeployResult:
        """Deploy a DAG document or YAML file against the registered operators."""
        document = (
            dag
            if isinstance(dag, DagDocument)
            else load_dag(dag, operators=self.dispatcher.operators.names())
        )
        return await self.dispatcher.deploy(document)
