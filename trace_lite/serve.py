"""``trace-lite serve``: the control-plane HTTP API with the Dispatcher running.

The internal token comes from the ``TRACE_INTERNAL_TOKEN`` environment
variable or from the file named by ``--internal-token-file`` (which wins when
both are given), never from the command line, where every local user could
read it in the process list. A token file readable or writable by others is
refused. Without a token the server does not start.

The Dispatcher's services run in the app's lifespan: started before the
first request is served, stopped (sources drained, loops finished) on
SIGINT/SIGTERM. A database outage stops none of them (each backs off and
carries on when the database is back); ``/healthz`` answers liveness and
``/readyz`` readiness (database reachable, every service loop healthy). Should
the services' task group end with an error all the same, the server stops
and the command exits with that error (status 1) instead of answering HTTP
with no Dispatcher behind it.

Task capabilities: the signing keys live in ``<data dir>/keys`` (a
:class:`~trace_lite.keys.LocalKeyStore`, created on first start), and every
claimed task gets a capability token (issuer ``trace-lite``, audience
``trace-task``) whose scratch prefix is
``<storage root><org>/scratch/<task_id>/<attempt>/``. The app serves the
key ring's JWKS, the ``/v1/task/*`` endpoints verified against the same
ring, and ``/v1/task/credentials`` through a
:class:`~trace_core.security.LocalCredentialMinter` whose key is kept in
``<data dir>/credentials.key`` (so credentials stay checkable across
restarts). Both key files are readable by their owner only.

Data: ``/v1/task/buffer-publish`` appends to the buffer in the data database
(``--data-db``, ``<data dir>/data.db`` by default), drained by a sink that
runs beside the server; ``/v1/task/query`` runs Spark SQL over the datasets
of the caller's token, in the object store under ``<data dir>/objects``
(Spark starts on the first query).

Serving: the state-database pool keeps enough connections for concurrent
requests beside the Dispatcher's services (an overflow connection is opened
and closed per use, a new Postgres backend each time), uvicorn's access
log (a line per request) is on only at ``--log-level debug``, and the event
loop is uvloop's when it is installed (the ``http`` extra).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import anyio

from trace_core.authoring.operators import OperatorRegistry, load_registry
from trace_core.clock import Clock, SystemClock
from trace_core.errors import ConfigurationError
from trace_core.security.jwks import KeyRing
from trace_core.storage.migrate import current_revision, head_revision
from trace_lite.credentials import (
    TOKEN_AUDIENCE,
    TOKEN_ISSUER,
    TOKEN_TTL_SECONDS,
    capability_issuer,
    token_verifier,
)
from trace_lite.secret_files import read_or_create_secret

__all__ = [
    "TOKEN_AUDIENCE",
    "TOKEN_ENV",
    "TOKEN_ISSUER",
    "TOKEN_TTL_SECONDS",
    "ServeConfig",
    "load_operators",
    "open_signing_keys",
    "read_internal_token",
    "read_minter_key",
    "serve",
]

TOKEN_ENV = "TRACE_INTERNAL_TOKEN"
_MAX_TOKEN_FILE = 4096
_MINTER_KEY_FILE = "credentials.key"
_POOL = 16  # state-database connections kept open: requests plus the services' loops


@dataclass(frozen=True)
class ServeConfig:
    """What ``trace-lite serve`` runs."""

    database_url: str
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    operators: str | None = None
    """``module:attribute`` naming an :class:`OperatorRegistry` (or a callable
    returning one) for ``runtime: dispatcher`` jobs; none by default."""
    data_dir: str = ".trace"
    """Where the signing keys (``keys/``), the credential minter's key and the
    object store (``objects/``, for the query service) live."""
    data_database_url: str | None = None
    """The data database of buffered tables (``<data_dir>/data.db`` by default)."""
    redis_url: str | None = None
    """Redis for the v1 worker streams (:mod:`trace_lite.redis_streams`); without
    it wake-ups stay in process and workers' claims read the database."""
    stream_idle_seconds: float = 120.0
    """A stream message pending this long at one worker is taken over by another."""
    fault_point: str | None = None
    """A fault point to arm, for tests only (:mod:`trace_lite.fault_points`)."""

    @property
    def data_url(self) -> str:
        """The data database URL."""
        return self.data_database_url or f"sqlite:///{Path(self.data_dir) / 'data.db'}"


def read_internal_token(token_file: str | None, environ: Mapping[str, str]) -> str:
    """The internal token from ``token_file`` or ``TRACE_INTERNAL_TOKEN``.

    Raises :class:`ConfigurationError` (never quoting the token) when there is
    none, the file is readable or writable by others, or it is malformed.
    """
    if token_file is not None:
        path = Path(token_file)
        try:
            mode = path.stat().st_mode
        except OSError as exc:
            raise ConfigurationError(
                f"--internal-token-file {token_file}: {exc.strerror}"
            ) from None
        if not stat.S_ISREG(mode):
            raise ConfigurationError(f"--internal-token-file {token_file}: not a regular file")
        if mode & (stat.S_IROTH | stat.S_IWOTH):
            raise ConfigurationError(
                f"--internal-token-file {token_file}: readable or writable by others "
                f"(mode {stat.S_IMODE(mode):o}); chmod 600 it"
            )
        with path.open("rb") as handle:
            raw = handle.read(_MAX_TOKEN_FILE + 1)
        if len(raw) > _MAX_TOKEN_FILE:
            raise ConfigurationError(f"--internal-token-file {token_file}: too large for a token")
        try:
            token = raw.decode("ascii").strip()
        except UnicodeDecodeError:
            raise ConfigurationError(
                f"--internal-token-file {token_file}: the token must be ASCII"
            ) from None
        source = f"--internal-token-file {token_file}"
    else:
        token = environ.get(TOKEN_ENV, "").strip()
        source = TOKEN_ENV
        if not token:
            raise ConfigurationError(
                f"no internal token: set {TOKEN_ENV} or pass --internal-token-file "
                "(a file only its owner can read); it is never taken from the command line"
            )
    from trace_core.api import check_internal_token

    try:
        check_internal_token(token)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{source}: {exc}") from None
    return token


def load_operators(reference: str | None) -> OperatorRegistry:
    """The registry named by ``module:attribute`` (an instance or a factory)."""
    if reference is None:
        return OperatorRegistry()
    return load_registry(reference, "--operators")


def open_signing_keys(data_dir: str | os.PathLike[str], clock: Clock) -> KeyRing:
    """The key ring of ``<data_dir>/keys``, created (with a first key) if absent."""
    from trace_lite.keys import LocalKeyStore

    return LocalKeyStore(Path(data_dir) / "keys", clock).open()


def read_minter_key(data_dir: str | os.PathLike[str]) -> bytes:
    """The credential minter's key from ``<data_dir>/credentials.key``, created if absent
    (see :func:`~trace_lite.secret_files.read_or_create_secret`)."""
    return read_or_create_secret(Path(data_dir) / _MINTER_KEY_FILE, "credential key")


def serve(config: ServeConfig, token: str) -> None:
    """Check the database schema, open the keys, then serve until interrupted."""
    from trace_lite.fault_points import check_fault_point

    check_fault_point(config.fault_point, redis_url=config.redis_url)
    revision, head = current_revision(config.database_url), head_revision()
    if revision != head:
        raise ConfigurationError(
            f"the database is at schema revision {revision or 'none'}, not {head}: "
            "run `trace-lite db upgrade` first"
        )
    operators = load_operators(config.operators)
    clock = SystemClock()
    # Disk work before the event loop starts: key files, created on first use.
    ring = open_signing_keys(config.data_dir, clock)
    from trace_lite.people_keys import open_people_keys

    people_ring = open_people_keys(config.data_dir, clock)
    minter_key = read_minter_key(config.data_dir)
    from trace_core.api.serving import event_loop_options

    anyio.run(
        _serve,
        config,
        token,
        operators,
        ring,
        minter_key,
        people_ring,
        backend_options=event_loop_options(),
    )


async def _serve(
    config: ServeConfig,
    token: str,
    operators: OperatorRegistry,
    ring: KeyRing,
    minter_key: bytes,
    people_ring: KeyRing | None = None,
) -> None:

    from trace_core.api.serving import serve_dispatcher
    from trace_core.dispatcher.service import Dispatcher, DispatcherConfig
    from trace_core.security import LocalCredentialMinter
    from trace_core.storage.engine import EngineSettings
    from trace_core.storage.sql import SqlRepository
    from trace_lite.buffered import BufferSink, DataDatabase, SqlDatasetBuffer
    from trace_lite.people_keys import people_api
    from trace_lite.pipeline.operators import ALERT_SCHEMA
    from trace_lite.query_service import SparkQueryService
    from trace_lite.spark import SparkSessionProvider

    clock = SystemClock()
    streams = None
    if config.redis_url:
        from trace_lite.fault_points import BETWEEN_COMMIT_AND_ACK, kill_between_commit_and_ack
        from trace_lite.redis_streams import RedisStreams

        armed = config.fault_point == BETWEEN_COMMIT_AND_ACK
        streams = RedisStreams.from_url(
            config.redis_url,
            claim_idle_seconds=config.stream_idle_seconds,
            between_commit_and_ack=kill_between_commit_and_ack if armed else None,
        )
    repo = SqlRepository(config.database_url, EngineSettings(pool_size=_POOL))
    data = DataDatabase(config.data_url)
    # Started on the first query only: a server without queries never pays for a JVM.
    spark = SparkSessionProvider()
    try:
        await data.open()
        capabilities = capability_issuer(ring, repo, clock, DispatcherConfig().storage_root)
        # Built inside the event loop: the Dispatcher's services own loop-bound primitives.
        dispatcher = Dispatcher(
            repo,
            operators=operators,
            clock=clock,
            capabilities=capabilities,
            wakeups=streams,
        )
        sink = BufferSink(data, repo, [ALERT_SCHEMA], gateway=dispatcher.gateway, clock=clock)
        await serve_dispatcher(
            dispatcher,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            beside=[sink],
            internal_token=token,
            jwks=ring.jwks,
            verifier=token_verifier(ring, clock),
            minter=LocalCredentialMinter(minter_key, clock=clock),
            buffer=SqlDatasetBuffer(data, clock=clock),
            query=SparkQueryService(
                spark, Path(config.data_dir) / "objects", data=data, state=repo
            ),
            people=people_api(repo, clock, ring=people_ring),
        )
    finally:
        await anyio.to_thread.run_sync(spark.stop)
        await data.close()
        await repo.close()
        if streams is not None:
            await streams.close()
