"""``trace-lite serve``: the control-plane HTTP API with the Dispatcher running.

The internal token comes from the ``TRACE_INTERNAL_TOKEN`` environment
variable or from the file named by ``--internal-token-file`` (which wins when
both are given), never from the command line, where every local user could
read it in the process list. A token file readable or writable by others is
refused. Without a token the server does not start.

The Dispatcher's services run in the app's lifespan: started before the
first request is served, stopped (sources drained, loops finished) on
SIGINT/SIGTERM.
"""

from __future__ import annotations

import importlib
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import anyio

from trace_core.dispatcher.operators import OperatorRegistry
from trace_core.errors import ConfigurationError
from trace_core.storage.migrate import current_revision, head_revision

__all__ = ["TOKEN_ENV", "ServeConfig", "load_operators", "read_internal_token", "serve"]

TOKEN_ENV = "TRACE_INTERNAL_TOKEN"
_MAX_TOKEN_FILE = 4096


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
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise ConfigurationError(f"--operators {reference!r}: expected 'module:attribute'")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"--operators {reference!r}: {exc}") from None
    registry = found() if callable(found) and not isinstance(found, OperatorRegistry) else found
    if not isinstance(registry, OperatorRegistry):
        raise ConfigurationError(f"--operators {reference!r} is not an OperatorRegistry")
    return registry


def serve(config: ServeConfig, token: str) -> None:
    """Check the database schema, then serve until interrupted."""
    revision, head = current_revision(config.database_url), head_revision()
    if revision != head:
        raise ConfigurationError(
            f"the database is at schema revision {revision or 'none'}, not {head}: "
            "run `trace-lite db upgrade` first"
        )
    operators = load_operators(config.operators)
    anyio.run(_serve, config, token, operators)


async def _serve(config: ServeConfig, token: str, operators: OperatorRegistry) -> None:
    import uvicorn

    from trace_core.api import create_app
    from trace_core.dispatcher.service import Dispatcher
    from trace_core.storage.sql import SqlRepository

    repo = SqlRepository(config.database_url)
    try:
        # Built inside the event loop: the Dispatcher's services own loop-bound primitives.
        dispatcher = Dispatcher(repo, operators=operators)
        app = create_app(dispatcher, internal_token=token, run_dispatcher=True)
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                host=config.host,
                port=config.port,
                log_level=config.log_level,
                lifespan="on",
                server_header=False,
            )
        )
        await server.serve()
    finally:
        await repo.close()
