"""Shared pieces of the queue benchmarks: statistics, output, throwaway databases."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import sqlalchemy as sa

from trace_core.storage.migrate import upgrade
from trace_core.storage.url import create_sync_engine, parse_database_url

__all__ = [
    "Databases",
    "Engine",
    "checkpoint",
    "count_tasks",
    "current_rss_mb",
    "emit",
    "load_average",
    "machine_busy_s",
    "median",
    "peak_rss_mb",
    "percentile",
    "server_cpu_s",
    "summarize",
    "trace_revision",
]

log = logging.getLogger("benchmarks")

Engine = Literal["sqlite", "postgres"]


# --- statistics --------------------------------------------------------------


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """Stop a child the benchmark started: SIGTERM, then SIGKILL after ``timeout``."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def benchmark_parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """The parser every benchmark starts from: ``--engine`` and ``--db``."""
    p = argparse.ArgumentParser(prog=prog, description=(doc or "").split("\n")[0])
    p.add_argument("--engine", choices=("sqlite", "postgres"), required=True)
    p.add_argument(
        "--db",
        help="Postgres: a server URL (a new database is created on it per run); "
        "SQLite: a file URL (deleted and recreated per run). Default: throwaway.",
    )
    return p


def require_positive(p: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """Exit with ``p``'s usage error naming the first of the options ``names``
    (attribute names: ``tasks``, ``per_run``) given below 1."""
    for name in names:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")


def configure_logging(verbose: bool, *quiet: str) -> None:
    """Log to stderr (stdout carries the JSON); alembic and ``quiet`` loggers at WARNING."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(message)s",
    )
    for name in ("alembic", *quiet):
        logging.getLogger(name).setLevel(logging.WARNING)


def median(values: Sequence[float]) -> float:
    """The median (0.0 for no values)."""
    return float(statistics.median(values)) if values else 0.0


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile: the smallest value with ``pct`` % of values at or below it."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return float(ordered[rank - 1])


def summarize(rows: Sequence[Mapping[str, Any]], keys: Iterable[str]) -> dict[str, float]:
    """``median_<key>`` over ``rows`` for each numeric ``key`` present."""
    out: dict[str, float] = {}
    for key in keys:
        values = [float(r[key]) for r in rows if isinstance(r.get(key), int | float)]
        if values:
            out[f"median_{key}"] = round(median(values), 3)
    return out


# --- output ------------------------------------------------------------------


_REVISION: str | None = None


def emit(obj: Mapping[str, Any]) -> None:
    """Print one JSON object on one line of stdout (with the Trace revision measured)."""
    global _REVISION
    if _REVISION is None:
        _REVISION = trace_revision()
    out = {**obj, "trace_revision": _REVISION}
    sys.stdout.write(json.dumps(out, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def peak_rss_mb() -> float:
    """This process's peak resident set size so far (``ru_maxrss``), in MiB."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def current_rss_mb() -> float:
    """This process's resident set size now (``/proc/self/statm``), in MiB."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


def trace_revision() -> str:
    """The Trace code measured: git commit of ``trace_core`` (``+dirty`` if it has
    uncommitted changes), else ``$TRACE_REVISION``, else ``unknown``."""
    import subprocess

    import trace_core

    root = Path(trace_core.__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", "trace_core"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("TRACE_REVISION", "unknown")
    return head + ("+dirty" if dirty else "")


def utcnow() -> datetime:
    return datetime.now(UTC)


def _proc_stat(pid: int | str) -> tuple[int, float] | None:
    """(parent pid, CPU seconds incl. reaped children) of one process, or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    # Fields 4 (ppid) and 14-17 (utime, stime, cutime, cstime) of the full line.
    return int(fields[1]), sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def server_cpu_s(postmaster: int) -> float:
    """CPU seconds used so far by one Postgres server: the postmaster and its
    children (a closed backend's time lands in the postmaster's ``cutime``)."""
    total = 0.0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        st = _proc_stat(proc.name)
        if st is not None and (st[0] == postmaster or int(proc.name) == postmaster):
            total += st[1]
    return total


def machine_busy_s() -> float:
    """Busy CPU seconds of the whole machine since boot (``/proc/stat``)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def load_average() -> float:
    """The 1-minute load average: other work on the machine skews every figure."""
    return round(os.getloadavg()[0], 2)


# --- databases -----------------------------------------------------------------


class Databases:
    """Fresh, migrated databases for benchmark runs.

    SQLite: a new file per run (in a temporary directory, or the ``--db`` path,
    which is deleted first). Postgres: a new database per run on the server of
    ``--db``, or on a throwaway :class:`~trace_lite.pgcluster.PostgresCluster`
    started here and stopped on exit.
    """

    def __init__(self, engine: Engine, db: str | None, *, keep: bool = False) -> None:
        self.engine = engine
        self._db = db
        self._keep = keep
        self._cluster: Any = None
        self._tmp: Path | None = None
        self._server_url: sa.URL | None = None
        self._made: list[str] = []
        self.server_info: dict[str, Any] = {}
        self.postmaster: int | None = None
        """The server's postmaster pid when it runs on this machine (for its CPU time)."""

    def __enter__(self) -> Databases:
        if self.engine == "postgres":
            if self._db is None:
                from trace_lite.pgcluster import PostgresCluster

                log.info("starting a throwaway Postgres cluster")
                self._cluster = PostgresCluster()
                self._cluster.start()
                self._server_url = sa.make_url(self._cluster.url("postgres"))
            else:
                self._server_url = parse_database_url(self._db).sync_url
            self.server_info = self._pg_settings()
        elif self._db is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="trace-bench-"))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._keep:
            for url in self._made:
                self.drop(url)
        if self._cluster is not None:
            self._cluster.stop()
        if self._tmp is not None and not self._keep:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def fresh(self, label: str) -> str:
        """Create and migrate a new database; return its URL."""
        if self.engine == "postgres":
            url = self._new_pg_database(label)
        else:
            url = self._new_sqlite_file(label)
        upgrade(url)
        self._made.append(url)
        return url

    def drop(self, url: str) -> None:
        """Remove a database made by :meth:`fresh` (idempotent)."""
        if self.engine == "postgres":
            import psycopg
            from psycopg import sql

            name = sa.make_url(url).database
            with psycopg.connect(self._admin_conninfo(), autocommit=True) as conn:
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                        sql.Identifier(str(name))
                    )
                )
        else:
            path = Path(str(sa.make_url(url).database))
            for suffix in ("", "-wal", "-shm", "-journal"):
                Path(str(path) + suffix).unlink(missing_ok=True)

    def _admin_conninfo(self) -> str:
        assert self._server_url is not None
        return self._server_url.set(drivername="postgresql").render_as_string(hide_password=False)

    def _pg_settings(self) -> dict[str, Any]:
        import psycopg

        names = ("server_version", "fsync", "synchronous_commit", "wal_level", "shared_buffers")
        with psycopg.connect(self._admin_conninfo(), autocommit=True) as conn:
            info = {
                name: conn.execute(f"SHOW {name}").fetchone()[0]  # type: ignore[index]
                for name in names
            }
            backend = _proc_stat(conn.info.backend_pid)
        # A server on another host: no CPU figures for it.
        self.postmaster = backend[0] if backend is not None else None
        return info

    def _new_pg_database(self, label: str) -> str:
        import psycopg
        from psycopg import sql

        assert self._server_url is not None
        name = f"trace_bench_{label}_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(self._admin_conninfo(), autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self._server_url.set(drivername="postgresql", database=name).render_as_string(
            hide_password=False
        )

    def _new_sqlite_file(self, label: str) -> str:
        if self._db is not None:
            path = Path(str(parse_database_url(self._db).sync_url.database))
        else:
            assert self._tmp is not None
            path = self._tmp / f"{label}-{uuid.uuid4().hex[:8]}.db"
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(str(path) + suffix).unlink(missing_ok=True)
        return f"sqlite:///{path}"


def checkpoint(url: str) -> None:
    """``CHECKPOINT`` the Postgres server of ``url``: what one measurement left
    dirty is flushed before the next starts, so neither pays for the other's
    writes (the role needs the right to checkpoint, as a throwaway cluster's has)."""
    import psycopg

    with psycopg.connect(parse_database_url(url).conninfo(), autocommit=True) as conn:
        conn.execute("CHECKPOINT")


def count_tasks(url: str) -> dict[str, int]:
    """``{status: count}`` of the tasks table."""
    engine = create_sync_engine(parse_database_url(url))
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT status, count(*) FROM tasks GROUP BY status"))
            return {str(r[0]): int(r[1]) for r in rows}
    finally:
        engine.dispose()
