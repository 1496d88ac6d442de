"""Throwaway Redis servers for tests and local development.

:class:`RedisServer` starts the Debian ``redis-server`` on a free loopback
port with a fresh temporary directory as its working directory, without
persistence (no RDB snapshots, no append-only file) unless asked, and
removes everything again on :meth:`RedisServer.stop`, on leaving the
``with`` block, or at interpreter exit. :meth:`RedisServer.restart` stops and
starts it on the same port (for fault tests: without persistence a restart
loses every stream, like a crash of an unpersisted production Redis).
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from trace_core.errors import ConfigurationError

__all__ = ["HOST", "RedisServer", "find_redis_server"]

HOST = "127.0.0.1"
_START_TIMEOUT = 10.0


def find_redis_server() -> str | None:
    """The path of ``redis-server`` on ``PATH`` (or the Debian location), or None."""
    found = shutil.which("redis-server")
    if found:
        return found
    debian = Path("/usr/bin/redis-server")
    return str(debian) if debian.exists() else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` on ``127.0.0.1``, started by :meth:`start`.

    ``persistent`` turns on the append-only file (in the temporary
    directory), so a :meth:`restart` keeps the data; off by default.
    """

    def __init__(self, *, persistent: bool = False, binary: str | None = None) -> None:
        found = binary or find_redis_server()
        if found is None:
            raise ConfigurationError(
                "redis-server: not installed (Debian package 'redis-server'; ./dev installs it)"
            )
        if not os.access(found, os.X_OK):
            raise ConfigurationError(f"redis-server: {found} is not an executable file")
        self.binary = found
        self.persistent = persistent
        self.port = 0
        self.directory: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The ``redis://`` URL of the running server (database 0)."""
        if self._process is None:
            raise ConfigurationError("RedisServer.url: the server is not running")
        return f"redis://{HOST}:{self.port}/0"

    def start(self) -> RedisServer:
        """Start the server and wait (bounded) until it answers ``PING``."""
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix="trace-redis-"))
            atexit.register(self.stop)
        if not self.port:
            self.port = _free_port()
        command = [
            self.binary,
            "--bind",
            HOST,
            "--port",
            str(self.port),
            "--dir",
            str(self.directory),
            "--save",
            "",
            "--appendonly",
            "yes" if self.persistent else "no",
            "--protected-mode",
            "yes",
            "--daemonize",
            "no",
            "--logfile",
            str(self.directory / "redis.log"),
        ]
        self._process = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + _START_TIMEOUT
        while not _answers_ping(self.port):
            if self._process.poll() is not None or time.monotonic() > deadline:
                log = self._log_tail()
                self._halt()
                raise ConfigurationError(f"redis-server did not start on port {self.port}: {log}")
            time.sleep(0.02)
        return self

    def _log_tail(self) -> str:
        assert self.directory is not None
        try:
            return (self.directory / "redis.log").read_text()[-2000:]
        except OSError:
            return "(no log)"

    def _halt(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def restart(self) -> None:
        """Stop the server and start it again on the same port (data lost
        unless ``persistent``)."""
        self._halt()
        self.start()

    def stop(self) -> None:
        """Stop the server and remove its directory (idempotent)."""
        self._halt()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
