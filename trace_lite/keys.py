"""The lite profile's signing keys: P-256 PEM files in one owner-only directory.

Layout of the key directory (mode 0700)::

    signing-20260101T000000Z-<kid>.pem   one private key per file, mode 0600
    keys.json                            each key's published/activated/retired times
    .lock                                serializes creation and rotation across processes

The kid is the key's RFC 7638 thumbprint. The first :meth:`LocalKeyStore.open`
creates a key that signs at once (the bootstrap key); :meth:`~LocalKeyStore.rotate`
adds a key that signs after the verifier-cache lead (see
:class:`~trace_core.security.jwks.KeyRing`). Files readable or writable by
group or others, owned by someone else, or reached through a symlink are
refused with an error naming the path: a key anyone else could read is not
a secret, and one anyone else could write is not ours.

Disk is written before memory: a crash leaves at worst a key file that
``keys.json`` does not name (never published, so it never signed; it is
ignored and logged).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import stat
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from trace_core.clock import Clock
from trace_core.errors import ConfigurationError
from trace_core.security.jwks import KeyRing, KeySchedule, RotationPolicy
from trace_core.security.signing import PrivateKeySigner

__all__ = ["STATE_FILE", "KeyFileError", "LocalKeyStore"]

log = logging.getLogger(__name__)

STATE_FILE = "keys.json"
_LOCK_FILE = ".lock"
_STATE_VERSION = 1
_KEY_FILE = re.compile(r"signing-(\d{8}T\d{6}Z)-([A-Za-z0-9_-]{43})\.pem")
_PRIVATE = 0o600
_PRIVATE_DIR = 0o700


class KeyFileError(ConfigurationError):
    """A key directory, key file or state file is unsafe or unreadable; names the path."""


def _check_owner_only(path: Path, st: os.stat_result, what: str, fix: str) -> None:
    if st.st_uid != os.geteuid():
        raise KeyFileError(f"{what} {path} is owned by uid {st.st_uid}, not by this user")
    if st.st_mode & 0o077:
        raise KeyFileError(
            f"{what} {path} is accessible by group or others "
            f"(mode {stat.S_IMODE(st.st_mode):04o}); refusing to use it: run `{fix} {path}`"
        )


def _read_owner_only(path: Path, what: str) -> bytes:
    """Read a regular file that only its owner (us) may access, never through a symlink."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise KeyFileError(f"cannot open {what} {path}: {exc.strerror}") from exc
    try:
        # fstat on the open descriptor: the checked file is the file we read.
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"{what} {path} is not a regular file")
        _check_owner_only(path, st, what, "chmod 600")
        with os.fdopen(os.dup(fd), "rb") as handle:
            return handle.read()
    finally:
        os.close(fd)


def _write_new(path: Path, data: bytes) -> None:
    """Create ``path`` (must not exist) with mode 0600 and durable contents."""
    fd = os.open(
        path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, _PRIVATE
    )
    try:
        os.fchmod(fd, _PRIVATE)  # the umask may have cleared bits, never added them
        with os.fdopen(os.dup(fd), "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _stamp(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")


def _time(value: object, field: str, path: Path) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            parsed = datetime.fromisoformat(value)
            if parsed.tzinfo is not None:
                return parsed
    raise KeyFileError(f"{path}: {field} must be an ISO 8601 timestamp with a timezone")


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


class LocalKeyStore:
    """P-256 signing keys kept as PEM files, exposed as one :class:`KeyRing`.

    Not async: it touches the disk at start-up and on rotation only. The
    :attr:`ring` object stays the same for the store's life, so a
    ``TokenIssuer`` built on it follows rotations.
    """

    def __init__(
        self, directory: str | os.PathLike[str], clock: Clock, policy: RotationPolicy | None = None
    ) -> None:
        self._dir = Path(directory)
        self._clock = clock
        self._policy = policy or RotationPolicy()
        self._ring = KeyRing(clock, self._policy)

    @property
    def directory(self) -> Path:
        """The key directory."""
        return self._dir

    @property
    def ring(self) -> KeyRing:
        """The key ring (empty until :meth:`open`)."""
        return self._ring

    def open(self) -> KeyRing:
        """Load the keys, creating the directory and a bootstrap key on first use."""
        with self._locked():
            keys = self._load()
            if not keys:
                keys = self._create_bootstrap()
            self._ring.restore(keys)
        return self._ring

    def rotate(self) -> KeySchedule:
        """Create a key that replaces the active one after the publish lead; return its schedule."""
        with self._locked():
            keys = self._load()
            if not keys:
                raise ConfigurationError(f"no keys in {self._dir}: call open() first")
            # Plan on a scratch ring (it validates), write to disk, then apply.
            scratch = KeyRing(self._clock, self._policy)
            scratch.restore(keys)
            private_key = ec.generate_private_key(ec.SECP256R1())
            signer = PrivateKeySigner(private_key)
            schedule = scratch.rotate(signer)
            self._write_key(private_key, schedule)
            signers = {s.kid: s for s, _ in keys} | {signer.kid: signer}
            planned = [(signers[s.kid], s) for s in scratch.schedules()]
            self._write_state([s for _, s in planned])
            self._ring.restore(planned)
        log.info("signing key %s published; it signs from %s", signer.kid, schedule.activated_at)
        return schedule

    def prune(self) -> list[str]:
        """Delete the files of keys that left the JWKS; return their kids."""
        with self._locked():
            keys = self._load()
            scratch = KeyRing(self._clock, self._policy)
            scratch.restore(keys)
            gone = scratch.prune()
            if gone:
                self._write_state(scratch.schedules())
                for kid in gone:
                    for path in self._dir.glob(f"signing-*-{kid}.pem"):
                        path.unlink()
                _fsync_dir(self._dir)
            self._ring.prune()
        return gone

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self._ensure_directory()
        fd = os.open(self._dir / _LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, _PRIVATE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def _ensure_directory(self) -> None:
        if not self._dir.exists():
            self._dir.mkdir(mode=_PRIVATE_DIR, parents=True, exist_ok=True)
            os.chmod(self._dir, _PRIVATE_DIR)  # mkdir's mode is filtered by the umask
        st = os.stat(self._dir)
        if not stat.S_ISDIR(st.st_mode):
            raise KeyFileError(f"key directory {self._dir} is not a directory")
        _check_owner_only(self._dir, st, "key directory", "chmod 700")

    def _load(self) -> list[tuple[PrivateKeySigner, KeySchedule]]:
        state_path = self._dir / STATE_FILE
        if not state_path.exists():
            strays = sorted(p.name for p in self._dir.glob("signing-*.pem"))
            if strays:
                raise KeyFileError(
                    f"{self._dir} holds key files {strays} but no {STATE_FILE}: "
                    "restore the state file or move the keys away"
                )
            return []
        try:
            state = json.loads(_read_owner_only(state_path, "key state file"))
        except ValueError as exc:
            raise KeyFileError(f"key state file {state_path} is not valid JSON") from exc
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise KeyFileError(f"key state file {state_path} has an unknown layout")
        records = state.get("keys")
        if not isinstance(records, list):
            raise KeyFileError(f"key state file {state_path} has no 'keys' list")
        keys = [self._load_key(record, state_path) for record in records]
        named = {record["file"] for record in records}
        for path in self._dir.glob("signing-*.pem"):
            if path.name not in named:
                log.warning("ignoring key file %s: %s does not name it", path, STATE_FILE)
        return keys

    def _load_key(self, record: Any, state_path: Path) -> tuple[PrivateKeySigner, KeySchedule]:
        if not isinstance(record, dict):
            raise KeyFileError(f"{state_path}: every key record must be an object")
        name, kid = record.get("file"), record.get("kid")
        match = _KEY_FILE.fullmatch(name) if isinstance(name, str) else None
        # The pattern admits no '/', so a record can only name a file in our directory.
        if match is None or match.group(2) != kid:
            raise KeyFileError(f"{state_path}: bad key file name for kid {kid!r}")
        path = self._dir / match.group(0)
        pem = _read_owner_only(path, "private key file")
        try:
            key = serialization.load_pem_private_key(pem, password=None)
        except (ValueError, TypeError) as exc:
            raise KeyFileError(f"private key file {path} is not an unencrypted PEM key") from exc
        if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(
            key.curve, ec.SECP256R1
        ):
            raise KeyFileError(f"private key file {path} is not a P-256 key")
        signer = PrivateKeySigner(key)
        if signer.kid != kid:
            raise KeyFileError(f"private key file {path} does not match its kid")
        published_at = _time(record.get("published_at"), "published_at", state_path)
        if published_at is None:
            raise KeyFileError(f"{state_path}: key {kid} has no published_at")
        schedule = KeySchedule(
            kid=kid,
            published_at=published_at,
            activated_at=_time(record.get("activated_at"), "activated_at", state_path),
            retired_at=_time(record.get("retired_at"), "retired_at", state_path),
            bootstrap=record.get("bootstrap") is True,
        )
        return signer, schedule

    def _create_bootstrap(self) -> list[tuple[PrivateKeySigner, KeySchedule]]:
        scratch = KeyRing(self._clock, self._policy)
        private_key = ec.generate_private_key(ec.SECP256R1())
        signer = PrivateKeySigner(private_key)
        schedule = scratch.bootstrap(signer)
        self._write_key(private_key, schedule)
        self._write_state([schedule])
        log.info("created signing key %s in %s", signer.kid, self._dir)
        return [(signer, schedule)]

    def _key_path(self, schedule: KeySchedule) -> Path:
        return self._dir / f"signing-{_stamp(schedule.published_at)}-{schedule.kid}.pem"

    def _write_key(self, private_key: ec.EllipticCurvePrivateKey, schedule: KeySchedule) -> None:
        pem = private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        _write_new(self._key_path(schedule), pem)
        _fsync_dir(self._dir)

    def _write_state(self, schedules: list[KeySchedule]) -> None:
        document = {
            "version": _STATE_VERSION,
            "keys": [
                {
                    "kid": s.kid,
                    "file": self._key_path(s).name,
                    "published_at": _iso(s.published_at),
                    "activated_at": _iso(s.activated_at),
                    "retired_at": _iso(s.retired_at),
                    "bootstrap": s.bootstrap,
                }
                for s in schedules
            ],
        }
        data = (json.dumps(document, indent=2) + "\n").encode()
        final = self._dir / STATE_FILE
        temporary = self._dir / f".{STATE_FILE}.{os.getpid()}.tmp"
        temporary.unlink(missing_ok=True)
        _write_new(temporary, data)
        # Atomic replace: readers see the old state or the new, never half.
        os.replace(temporary, final)
        _fsync_dir(self._dir)
