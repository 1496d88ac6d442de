"""The data directory lock: one live lite platform per data directory.

The data directory is the lite platform's alone. :func:`lock_data_directory`
takes an exclusive ``flock`` on ``<data dir>/lock`` for the life of the
process (or until :meth:`DataDirLock.release`). The kernel drops the lock when
its holder dies, however it dies (SIGKILL included), so a process that gets it
has *proved* that no earlier holder is alive: it may take back that holder's
leases at once instead of waiting for them to expire
(:mod:`trace_lite.takeover`). A second live process is refused with an error
naming the directory and the holder's pid.

The file also keeps the directory's identity (a random id made on the first
lock, kept by every later one): the in-process workers' ids start with
``trace-lite/<id>/``, so the leases a previous process of *this* directory
held are told apart from those of any other process on the same (Postgres)
state database.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trace_core.errors import ConfigurationError

__all__ = ["LOCK_FILE", "DataDirLock", "lock_data_directory"]

LOCK_FILE = "lock"
"""Name of the lock file inside the data directory."""


@dataclass
class DataDirLock:
    """A held lock on a data directory (see the module docstring)."""

    directory: Path
    directory_id: str
    """The directory's identity, the same for every process that locks it."""
    previous_pid: int | None
    """The pid of the last holder before this one (gone: the lock proves it)."""
    _fd: int | None

    @property
    def worker_prefix(self) -> str:
        """Start of every in-process worker id of this directory's processes."""
        return f"trace-lite/{self.directory_id}/"

    @property
    def worker_id(self) -> str:
        """This process's in-process worker id."""
        return f"{self.worker_prefix}{os.getpid()}"

    @property
    def held(self) -> bool:
        """Whether the lock is still held."""
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock (closing the file does); idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _read_record(fd: int) -> dict[str, Any]:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = b""
    while chunk := os.read(fd, 4096):
        raw += chunk
    try:
        record = json.loads(raw.decode("utf-8")) if raw.strip() else {}
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}  # a record cut off by a crash while it was written: start afresh
    return record if isinstance(record, dict) else {}


def _pid(value: Any) -> int | None:
    return value if isinstance(value, int) and value > 0 else None


def lock_data_directory(directory: Path) -> DataDirLock:
    """Lock ``directory`` (which must exist) for this process.

    Raises :class:`ConfigurationError` naming the directory and the holder's
    pid when another live process holds it, or naming the directory and the
    reason when the lock file cannot be opened or written (a full disk, a
    read-only filesystem).
    """
    path = directory / LOCK_FILE
    try:
        # Not truncated on open: the record is the holder's until we hold the lock.
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise ConfigurationError(
            f"data directory {directory}: cannot open its lock file: {exc.strerror or exc}"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ConfigurationError(
                    f"data directory {directory}: cannot lock {path}: {exc.strerror or exc}"
                ) from None
            holder = _pid(_read_record(fd).get("pid"))
            raise ConfigurationError(
                f"data directory {directory} is in use by another trace-lite process "
                f"(pid {holder if holder is not None else 'unknown'}); stop it first, "
                "or use another --data-dir"
            ) from None
        previous = _read_record(fd)
        directory_id = previous.get("directory_id")
        if not isinstance(directory_id, str) or not directory_id.isalnum():
            directory_id = uuid.uuid4().hex
        record = json.dumps({"directory_id": directory_id, "pid": os.getpid()}).encode()
        try:
            # Written over the old record, then cut to length: a write refused
            # (a full disk) leaves the directory's identity in place.
            os.pwrite(fd, record, 0)
            os.ftruncate(fd, len(record))
        except OSError as exc:
            raise ConfigurationError(
                f"data directory {directory}: cannot write its lock file: {exc.strerror or exc}"
            ) from None
        return DataDirLock(directory, directory_id, _pid(previous.get("pid")), fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
