"""Throwaway PostgreSQL clusters for tests, benchmarks and local rehearsals.

Runtime code starts one too (``trace-aws rehearse``), so the cluster stays in
this package; the test-run parts (the pool of migrated databases, the choice
of an external server) are :mod:`trace_testing.postgres`.

`PostgresCluster` runs ``initdb`` into a fresh temporary directory, starts a
``postgres`` server that listens on 127.0.0.1 only (its unix socket lives in
the same directory), and removes everything again on `PostgresCluster.stop`,
on leaving the ``with`` block, or at interpreter exit.

psycopg is imported lazily (it is the ``postgres`` extra), so importing this
module costs nothing when no cluster is started.
"""

from __future__ import annotations

import atexit
import os
import pwd
import re
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import quote

if TYPE_CHECKING:
    from psycopg import Connection
    from psycopg.rows import TupleRow

__all__ = ["PostgresCluster", "find_postgres_bindir"]

SUPERUSER = "trace"
HOST = "127.0.0.1"
# PostgreSQL refuses to run as root, so a root caller drops to this account.
_SYSTEM_USER = "postgres"
_REQUIRED_BINARIES = ("initdb", "pg_ctl", "postgres", "pg_isready")
_PORT_ATTEMPTS = 5
_MAX_SOCKET_PATH = 103
_BIND_FAILURE = re.compile(r"could not (bind|create any TCP/IP sockets)|Address already in use")


def _has_server_binaries(bindir: Path) -> bool:
    return all(os.access(bindir / name, os.X_OK) for name in _REQUIRED_BINARIES)


def _version_key(path: Path) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", path.parent.name))


def find_postgres_bindir() -> Path:
    """Locate the directory holding ``initdb``, ``pg_ctl`` and ``postgres``.

    Tries ``pg_config --bindir``, then the highest ``/usr/lib/postgresql/*/bin``,
    then ``pg_ctl`` on PATH. Raises FileNotFoundError when no server is installed.
    """
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        result = subprocess.run(
            [pg_config, "--bindir"], capture_output=True, text=True, check=False
        )
        if result.returncode == 0 and result.stdout.strip():
            candidates.append(Path(result.stdout.strip()))
    candidates.extend(
        sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=_version_key, reverse=True)
    )
    pg_ctl = shutil.which("pg_ctl")
    if pg_ctl is not None:
        # Resolve symlinks: pg_ctl finds `postgres` next to its real location.
        candidates.append(Path(pg_ctl).resolve().parent)
    for bindir in candidates:
        # A client-only pg_config (libpq-dev) can point at a directory with no server.
        if _has_server_binaries(bindir):
            return bindir
    raise FileNotFoundError(
        "PostgreSQL server binaries (initdb, pg_ctl, postgres) not found; "
        "run `./dev setup` or install the `postgresql` package"
    )


def _free_port() -> int:
    # The kernel picks an unused port; another process may still take it before
    # postgres binds, which start() detects and retries.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _traversable_by_others(path: Path) -> bool:
    return all(p.stat().st_mode & stat.S_IXOTH for p in (path, *path.parents))


def _ensure_system_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(_SYSTEM_USER)
    except KeyError:
        subprocess.run(
            [
                "useradd",
                "--system",
                "--user-group",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                _SYSTEM_USER,
            ],
            check=True,
            capture_output=True,
        )
        return pwd.getpwnam(_SYSTEM_USER)


class PostgresCluster:
    """A private PostgreSQL server in a temporary directory, for one process's lifetime.

    Use as a context manager, or call `start` and `stop`. The superuser role is
    ``trace`` with trust authentication; the server accepts TCP connections on
    127.0.0.1 only. Durability settings stay at PostgreSQL's defaults unless
    ``settings`` says otherwise (a test suite's throwaway cluster may turn
    ``fsync`` off; a benchmark's must not).
    """

    def __init__(
        self,
        *,
        bindir: Path | None = None,
        base_dir: Path | None = None,
        max_connections: int = 200,
        shared_buffers: str = "64MB",
        startup_timeout: float = 60.0,
        settings: Mapping[str, str] | None = None,
    ) -> None:
        """Configure the cluster; nothing runs until `start`.

        ``bindir`` overrides binary discovery; ``base_dir`` is where the temporary
        directory is created (default: the system temp dir). ``settings`` are
        more server parameters (``-c name=value``), applied after the defaults.
        """
        if max_connections < 1:
            raise ValueError("max_connections must be positive")
        if startup_timeout <= 0:
            raise ValueError("startup_timeout must be positive")
        self._bindir = bindir
        self._base_dir = base_dir
        self._max_connections = max_connections
        self._shared_buffers = shared_buffers
        self._startup_timeout = startup_timeout
        self._settings = dict(settings or {})
        self._lock = threading.Lock()
        self._root: Path | None = None
        self._port: int | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._run_as: pwd.struct_passwd | None = None
        self._owner_pid: int | None = None

    # -- lifecycle ---------------------------------------------------------

    def __enter__(self) -> PostgresCluster:
        """Start the cluster and return it."""
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop the cluster and delete its directory."""
        self.stop()

    def start(self) -> None:
        """Create the cluster, start the server and wait until it accepts connections.

        Raises RuntimeError if already started or if the server does not come up
        within ``startup_timeout`` seconds; a failed start leaves nothing behind.
        """
        with self._lock:
            if self._root is not None:
                raise RuntimeError("cluster already started")
            self._owner_pid = os.getpid()
            # Registered before anything exists on disk, so even a start that dies
            # half-way is cleaned up at exit.
            atexit.register(self.stop)
            try:
                self._start_locked()
            except BaseException:
                self._stop_locked()
                raise

    def stop(self) -> None:
        """Stop the server (``pg_ctl stop -m fast``) and delete the directory. Idempotent."""
        with self._lock:
            self._stop_locked()

    def halt(self, mode: str = "immediate") -> None:
        """Stop the server but keep the cluster (``pg_ctl stop -m <mode>``), to
        simulate an outage; :meth:`resume` starts it again on the same port.

        ``immediate`` is a crash: no checkpoint, every session cut at once, and
        the next start runs crash recovery. ``fast`` is a clean shutdown.
        """
        if mode not in ("immediate", "fast", "smart"):
            raise ValueError(f"mode must be immediate, fast or smart, not {mode!r}")
        with self._lock:
            self._require_root()
            process, self._process = self._process, None
            if process is None or process.poll() is not None:
                raise RuntimeError("the server is not running")
            assert self._bindir is not None
            self._run(
                [
                    str(self._bindir / "pg_ctl"),
                    "stop",
                    "-D",
                    str(self.data_dir),
                    "-m",
                    mode,
                    "-w",
                    "-t",
                    "30",
                ]
            )
            process.wait(timeout=30)

    def resume(self) -> None:
        """Start the server halted by :meth:`halt` again, on the same port, and
        wait until it accepts connections (after crash recovery, if any)."""
        with self._lock:
            self._require_root()
            if self._process is not None and self._process.poll() is None:
                raise RuntimeError("the server is already running")
            assert self._bindir is not None and self._port is not None
            self._process = self._spawn_postgres(self._bindir, self.data_dir, self._port)
            deadline = time.monotonic() + self._startup_timeout
            if not self._wait_ready(self._bindir, deadline):
                raise RuntimeError(
                    f"postgres did not restart on port {self._port}:\n{self._log_tail()}"
                )

    def crash_restart(self) -> None:
        """``pg_ctl restart -m immediate``: crash the server and start it again
        on the same port (:meth:`halt` then :meth:`resume`)."""
        self.halt("immediate")
        self.resume()

    def _start_locked(self) -> None:
        bindir = self._bindir or find_postgres_bindir()
        self._bindir = bindir
        if os.geteuid() == 0:
            self._run_as = _ensure_system_user()
        self._root = self._make_root()
        data_dir = self.data_dir
        self._run(
            [
                str(bindir / "initdb"),
                "-D",
                str(data_dir),
                "-U",
                SUPERUSER,
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C",
            ],
        )
        deadline = time.monotonic() + self._startup_timeout
        attempt = 1
        while True:
            self._port = _free_port()
            self._process = self._spawn_postgres(bindir, data_dir, self._port)
            if self._wait_ready(bindir, deadline):
                return
            log = self._log_tail()
            if attempt >= _PORT_ATTEMPTS or not _BIND_FAILURE.search(log):
                raise RuntimeError(f"postgres did not start on port {self._port}:\n{log}")
            attempt += 1

    def _make_root(self) -> Path:
        base = self._base_dir
        if base is None:
            base = Path(tempfile.gettempdir())
            # The server user must reach the directory; a root TMPDIR such as
            # /root/tmp is not reachable by `postgres`.
            if self._run_as is not None and not _traversable_by_others(base):
                base = Path("/tmp")
        elif self._run_as is not None and not _traversable_by_others(base):
            raise ValueError(f"base_dir must be traversable by the {_SYSTEM_USER!r} user: {base}")
        root = Path(tempfile.mkdtemp(prefix="trace-pg-", dir=base))
        # Unix socket paths are limited to ~107 bytes; fail clearly, not inside postgres.
        if len(str(root / ".s.PGSQL.65535")) > _MAX_SOCKET_PATH:
            shutil.rmtree(root)
            raise ValueError(f"temporary directory path too long for a unix socket: {root}")
        if self._run_as is not None:
            os.chown(root, self._run_as.pw_uid, self._run_as.pw_gid)
        return root

    def _subprocess_kwargs(self) -> dict[str, Any]:
        # cwd inside our directory: initdb fails if it cannot read the caller's cwd
        # (e.g. /root) after dropping privileges. LC_ALL=C keeps server messages in
        # English, which the port-collision check reads, and avoids warnings about
        # the caller's locale not being installed.
        kwargs: dict[str, Any] = {"cwd": self._root, "env": {**os.environ, "LC_ALL": "C"}}
        if self._run_as is not None:
            # Same effect as `setpriv --reuid postgres --regid postgres --clear-groups`
            # without needing util-linux, and the pid we hold is the server's own.
            kwargs.update(user=self._run_as.pw_uid, group=self._run_as.pw_gid, extra_groups=[])
        return kwargs

    def _run(self, argv: list[str]) -> None:
        result = subprocess.run(
            argv, capture_output=True, text=True, check=False, **self._subprocess_kwargs()
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"{Path(argv[0]).name} failed ({result.returncode}):\n"
                f"{result.stdout}{result.stderr}"
            )

    def _spawn_postgres(self, bindir: Path, data_dir: Path, port: int) -> subprocess.Popen[bytes]:
        settings = {
            "listen_addresses": HOST,
            "port": str(port),
            "unix_socket_directories": str(self.socket_dir),
            "max_connections": str(self._max_connections),
            "shared_buffers": self._shared_buffers,
            **self._settings,
        }
        argv = [str(bindir / "postgres"), "-D", str(data_dir)]
        for name, value in settings.items():
            argv += ["-c", f"{name}={value}"]
        log: IO[bytes]
        # Truncate on every attempt so a bind failure is judged on this attempt's log.
        with open(self.log_path, "wb") as log:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                **self._subprocess_kwargs(),
            )

    def _wait_ready(self, bindir: Path, deadline: float) -> bool:
        assert self._process is not None and self._port is not None
        # Probe the unix socket, not the TCP port: only our server can create a
        # socket in our private directory, whereas a foreign process that grabbed
        # the port would answer (or stall) a TCP probe. Postgres creates the TCP
        # listener before the unix socket and exits if TCP binding fails, so a
        # ready unix socket also means TCP is up.
        probe = [str(bindir / "pg_isready"), "-q", "-h", str(self.socket_dir),
                 "-p", str(self._port), "-U", SUPERUSER, "-d", "postgres"]  # fmt: skip
        delay = 0.01
        while time.monotonic() < deadline:
            # A server that exited (port taken, bad setting) will never become ready.
            if self._process.poll() is not None:
                return False
            if subprocess.run(probe, check=False).returncode == 0:
                return self._process.poll() is None
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
        return False

    def _log_tail(self, limit: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return "(no log)"

    def _stop_locked(self) -> None:
        # A forked child inherits the atexit hook; only the creator may tear down.
        if self._owner_pid is not None and os.getpid() != self._owner_pid:
            return
        atexit.unregister(self.stop)
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            assert self._bindir is not None
            try:
                self._run(
                    [
                        str(self._bindir / "pg_ctl"),
                        "stop",
                        "-D",
                        str(self.data_dir),
                        "-m",
                        "fast",
                        "-w",
                        "-t",
                        "30",
                    ]
                )
            except RuntimeError:
                process.kill()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        root, self._root = self._root, None
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
        self._port = None

    # -- addresses ---------------------------------------------------------

    def _require_root(self) -> Path:
        if self._root is None:
            raise RuntimeError("cluster is not running")
        return self._root

    @property
    def data_dir(self) -> Path:
        """The cluster's data directory (inside the temporary directory)."""
        return self._require_root() / "data"

    @property
    def socket_dir(self) -> Path:
        """The directory holding the server's unix socket."""
        return self._require_root()

    @property
    def log_path(self) -> Path:
        """The server's log file."""
        return self._require_root() / "postgres.log"

    @property
    def port(self) -> int:
        """The TCP port the server listens on (on 127.0.0.1)."""
        if self._port is None:
            raise RuntimeError("cluster is not running")
        return self._port

    def url(self, dbname: str = "postgres") -> str:
        """Return ``postgresql://trace@127.0.0.1:<port>/<dbname>``."""
        return f"postgresql://{SUPERUSER}@{HOST}:{self.port}/{quote(dbname, safe='')}"

    # -- databases ---------------------------------------------------------

    def create_database(self, name: str, template: str | None = None) -> None:
        """Create database ``name``, optionally as a copy of ``template``.

        Names are quoted identifiers (case is kept). Other sessions on the template
        are terminated first, since PostgreSQL refuses to copy a database that
        anyone is connected to.
        """
        from psycopg import errors, sql

        statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template is not None:
            statement += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
        with self._admin_connection() as conn:
            deadline = time.monotonic() + 10
            while True:
                if template is not None:
                    _terminate_sessions(conn, template)
                try:
                    conn.execute(statement)
                    return
                except errors.ObjectInUse:
                    # A client reconnected between terminate and copy; try again.
                    if template is None or time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)

    def drop_database(self, name: str) -> None:
        """Drop database ``name`` if it exists, disconnecting its sessions (PostgreSQL 13+)."""
        from psycopg import sql

        with self._admin_connection() as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )

    def _admin_connection(self) -> Connection[TupleRow]:
        import psycopg

        return psycopg.connect(self.url("postgres"), autocommit=True)


def _terminate_sessions(conn: Connection[TupleRow], dbname: str) -> None:
    conn.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE datname = %s AND pid <> pg_backend_pid()",
        (dbname,),
    )
