"""Fault tools: kill, pause and restart worker processes; crash-restart the
throwaway Postgres; hold a transaction (and its snapshot) open; fill a disk.

:class:`WorkerFleet` runs workers as OS processes (``multiprocessing``'s
spawn context: a fresh interpreter each, nothing inherited but the
arguments). A worker is a picklable entry point ``target(config, stats,
stop)``: ``config`` a frozen dataclass with a ``name`` field, ``stats`` a
shared ``RawArray`` of counters (a SIGKILL at any instant cannot corrupt it,
unlike a pipe), ``stop`` a :class:`StopFlag` to end gracefully.
:mod:`trace_testing.workers` has one that claims tasks and records effects.

Faults are real signals: SIGKILL (no cleanup, no rollback from the
worker's side), SIGSTOP and SIGCONT (the process is frozen past its lease and
thaws unaware of it), ``pg_ctl stop -m immediate`` then a start (crash
recovery, every session cut).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import multiprocessing
import os
import random
import signal
import sqlite3
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from trace_lite.pgcluster import PostgresCluster
from trace_testing.postgres import PostgresServer

__all__ = [
    "HeldSnapshot",
    "StopFlag",
    "WorkerFleet",
    "crash_restart",
    "fill_disk",
    "hold_snapshot",
    "process_state",
    "small_filesystem",
]


def process_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (``R``, ``S``, ``T`` stopped,
    ``Z`` zombie...); ``"gone"`` once it no longer exists (Linux ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            stat = fh.read()
    except FileNotFoundError:
        return "gone"
    # The command name (in parentheses) may hold spaces; the state follows it.
    return stat.rpartition(")")[2].split()[0]


class StopFlag:
    """A stop request shared with worker processes, without a lock.

    A ``multiprocessing.Event`` takes a lock on every ``is_set``/``wait``:
    a worker SIGKILLed while holding it leaves it held for ever, and every
    other worker (and the parent's ``set``) hangs. This flag is one shared
    byte that each side only reads or writes.
    """

    def __init__(self, ctx: Any) -> None:
        """A flag in shared memory of ``ctx`` (a multiprocessing context)."""
        self._value = ctx.RawValue("b", 0)

    def set(self) -> None:
        """Ask every worker to stop."""
        self._value.value = 1

    def is_set(self) -> bool:
        """Whether a stop was asked for."""
        return bool(self._value.value)

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for a stop; whether one was asked."""
        deadline = time.monotonic() + timeout
        while not self.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            # Polled: no lock a killed process could leave behind.
            time.sleep(min(remaining, 0.01))
        return True


class WorkerFleet:
    """Worker processes of one test, their shared counters and the faults
    done to them (see the module docstring)."""

    def __init__(
        self,
        target: Callable[[Any, Any, Any], None],
        stat_names: Sequence[str],
        *,
        rng: random.Random | None = None,
    ) -> None:
        """Workers run ``target``; each gets ``len(stat_names)`` counters.
        ``rng`` picks the victims of :meth:`kill_random` (seed it to replay)."""
        self.ctx = multiprocessing.get_context("spawn")
        self.target = target
        self.stat_names = tuple(stat_names)
        self.rng = rng or random.Random()
        self.stop_event = StopFlag(self.ctx)
        self.procs: dict[str, Any] = {}
        self.stats: dict[str, Any] = {}
        self.configs: dict[str, Any] = {}
        self.killed: list[str] = []
        """Every worker SIGKILLed, in order."""
        self._generation = 0

    # --- running ------------------------------------------------------------

    def start(self, config: Any) -> str:
        """Start a worker for ``config`` (named ``config.name``); its name."""
        name = str(config.name)
        if name in self.procs:
            raise ValueError(f"a worker named {name!r} was already started")
        stats = self.ctx.RawArray("q", len(self.stat_names))
        proc = self.ctx.Process(
            target=self.target, args=(config, stats, self.stop_event), name=name
        )
        proc.start()
        self.procs[name] = proc
        self.stats[name] = stats
        self.configs[name] = config
        return name

    def alive(self) -> list[str]:
        """Names of the workers still running (a paused one included)."""
        return [name for name, proc in self.procs.items() if proc.is_alive()]

    def pid(self, name: str) -> int:
        """The process id of worker ``name``."""
        pid = self.procs[name].pid
        assert pid is not None
        return int(pid)

    def stat(self, name: str, key: str) -> int:
        """Counter ``key`` of worker ``name`` (still readable after it died)."""
        return int(self.stats[name][self.stat_names.index(key)])

    def total(self, key: str) -> int:
        """Counter ``key`` summed over every worker ever started."""
        return sum(self.stat(name, key) for name in self.stats)

    def totals(self) -> dict[str, int]:
        """Every counter summed over every worker."""
        return {key: self.total(key) for key in self.stat_names}

    # --- faults -------------------------------------------------------------

    def kill(self, name: str) -> None:
        """SIGKILL worker ``name`` and reap it."""
        proc = self.procs[name]
        proc.kill()
        proc.join(10)
        self.killed.append(name)

    def kill_random(self) -> str:
        """SIGKILL one live worker picked by the fleet's ``rng``; its name."""
        alive = sorted(self.alive())
        if not alive:
            raise RuntimeError("no live worker to kill")
        victim = self.rng.choice(alive)
        self.kill(victim)
        return victim

    def restart(self, name: str, **changes: Any) -> str:
        """Start a successor of (dead) worker ``name``: its config with a new
        name and ``changes`` (e.g. another seed); the successor's name."""
        if self.procs[name].is_alive():
            raise RuntimeError(f"worker {name!r} is still running; kill it first")
        self._generation += 1
        successor = f"{name}.r{self._generation}"
        config = dataclasses.replace(self.configs[name], name=successor, **changes)
        return self.start(config)

    def pause(self, name: str) -> None:
        """SIGSTOP worker ``name``: frozen mid-work, its leases run out."""
        os.kill(self.pid(name), signal.SIGSTOP)

    def resume(self, name: str) -> None:
        """SIGCONT worker ``name``: it carries on unaware of the time it lost."""
        os.kill(self.pid(name), signal.SIGCONT)

    @contextlib.contextmanager
    def paused(self, name: str) -> Iterator[None]:
        """Worker ``name`` stopped for the block, resumed after (also on error)."""
        self.pause(name)
        try:
            yield
        finally:
            self.resume(name)

    # --- the end ------------------------------------------------------------

    def shutdown(self, timeout: float = 20.0) -> dict[str, int | None]:
        """Ask every worker to stop, SIGKILL those that do not within
        ``timeout``; each worker's exit code (negative: killed by a signal)."""
        self.stop_event.set()
        for proc in self.procs.values():
            if proc.is_alive():
                # A paused worker would never see the stop event.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
        codes: dict[str, int | None] = {}
        deadline = time.monotonic() + timeout
        for name, proc in self.procs.items():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            codes[name] = proc.exitcode
            proc.close()
        self.procs.clear()
        return codes


def crash_restart(server: PostgresServer | PostgresCluster) -> float:
    """``pg_ctl restart -m immediate`` on the throwaway cluster: every session
    is cut, the server runs crash recovery and comes back on the same port.
    Seconds it was unreachable. A user's own server (``--trace-postgres-url``)
    is never crashed: :class:`RuntimeError`.

    The test run's cluster is not durable (``synchronous_commit`` and
    ``fsync`` off, :data:`~trace_testing.postgres.NON_DURABLE`): commits of
    the last moments before the crash may be lost. A test that counts on
    every acknowledged commit surviving crashes a cluster of its own with
    the durable defaults (``PostgresCluster()``), or checkpoints first."""
    cluster = server.cluster if isinstance(server, PostgresServer) else server
    if cluster is None:
        raise RuntimeError(
            "crash_restart needs the throwaway cluster; this run uses the user's own server"
        )
    started = time.monotonic()
    cluster.crash_restart()
    return time.monotonic() - started


@dataclasses.dataclass
class HeldSnapshot:
    """An open, idle transaction that holds a snapshot (see :func:`hold_snapshot`)."""

    engine: str
    connection: Any
    """The raw DB-API connection (psycopg or sqlite3) holding the transaction."""
    backend_pid: int | None
    """The Postgres server process of the session (None on SQLite)."""
    first_read: Any
    """What the snapshot's first read returned (the count of the table read)."""


def _sqlite_path(url: str) -> str:
    prefix = url.split("///", 1)
    if len(prefix) != 2 or not url.startswith("sqlite"):
        raise ValueError(f"not a SQLite file URL: {url!r}")
    return prefix[1]


def _psycopg_url(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    return f"postgresql://{rest}" if sep and scheme.startswith("postgresql") else url


@contextlib.contextmanager
def hold_snapshot(url: str, *, table: str = "tasks") -> Iterator[HeldSnapshot]:
    """Hold a transaction with a snapshot open and idle for the block.

    On Postgres: ``BEGIN ISOLATION LEVEL REPEATABLE READ`` and a first read
    (``SELECT count(*) FROM <table>``), which takes the snapshot, so vacuum
    cannot remove a tuple dead since (a bare ``BEGIN; SELECT 1`` in READ
    COMMITTED holds none). On SQLite (WAL): a read transaction, which keeps
    its view of the database and holds the checkpoint back. The transaction
    rolls back when the block ends.
    """
    if url.startswith("sqlite"):
        conn = sqlite3.connect(_sqlite_path(url), isolation_level=None)
        try:
            conn.execute("BEGIN")
            count = conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0]
            yield HeldSnapshot("sqlite", conn, None, count)
        finally:
            conn.execute("ROLLBACK")
            conn.close()
        return
    import psycopg
    from psycopg import sql

    # Autocommit, so the explicit BEGIN below is the transaction (psycopg
    # would otherwise open one of its own, in READ COMMITTED, first).
    with psycopg.connect(_psycopg_url(url), autocommit=True) as pg:
        pg.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        try:
            query = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))
            row = pg.execute(query).fetchone()
            assert row is not None
            yield HeldSnapshot("postgres", pg, pg.info.backend_pid, row[0])
        finally:
            with contextlib.suppress(psycopg.Error):
                pg.execute("ROLLBACK")


@contextlib.contextmanager
def small_filesystem(size_bytes: int = 4 * 1024 * 1024) -> Iterator[Path]:
    """A tmpfs of ``size_bytes`` mounted on a fresh directory for the block,
    to fill (:func:`fill_disk`) without touching a real disk.

    Mounting needs root (and a kernel that lets this process mount): the
    test is skipped, with the reason, where it cannot.
    """
    if size_bytes < 64 * 1024:
        raise ValueError("size_bytes must be at least 64 KiB")
    if os.geteuid() != 0:
        pytest.skip("a small filesystem is a tmpfs mount, which needs root")
    mount_point = Path(tempfile.mkdtemp(prefix="trace-small-fs-"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        mount_point.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        # Lazy: a file a test left open must not keep the mount (and the run) stuck.
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, check=False)
        mount_point.rmdir()


def fill_disk(directory: Path) -> Path:
    """Fill the filesystem of ``directory`` to the last byte with one file;
    its path (delete it to give the space back)."""
    filler = directory / ".trace-filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        # Big chunks first, then smaller ones into what is left.
        for size in (1 << 20, 1 << 16, 1 << 12, 1 << 9, 1):
            chunk = b"\0" * size
            while True:
                try:
                    os.write(fd, chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    return filler
