"""Secret key files of the lite profile: created on first use, owner-only.

The credential minter's key and the local key-encryption key are 32 random
bytes each, in a file of the data directory that only its owner may read or
write. A file that exists but is someone else's, readable by others, a
symlink or of the wrong size is refused with a message naming it (never
its content).
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from trace_core.errors import ConfigurationError

__all__ = ["SECRET_BYTES", "read_or_create_secret"]

SECRET_BYTES = 32


def read_or_create_secret(path: Path, what: str) -> bytes:
    """The 32-byte secret in ``path``, created (mode 600, in a 700 directory) if absent.

    Raises :class:`ConfigurationError` naming ``what`` and ``path`` when the
    file is not a regular file of this user that nobody else can access, or
    does not hold exactly 32 bytes.
    """
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    flags = os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | flags, 0o600)
    except FileExistsError:
        pass
    else:
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, secrets.token_bytes(SECRET_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
    try:
        fd = os.open(path, os.O_RDONLY | flags)
    except OSError as exc:
        raise ConfigurationError(f"{what} {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ConfigurationError(
                f"{what} {path}: must be a regular file of this user that "
                f"nobody else can access (mode {stat.S_IMODE(st.st_mode):o}); chmod 600 it"
            )
        key = os.read(fd, SECRET_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != SECRET_BYTES:
        raise ConfigurationError(f"{what} {path}: must hold exactly {SECRET_BYTES} bytes")
    return key
