"""The lite profile's object store: ``s3://bucket/key`` mapped to files.

A task never gets the store itself, only a :class:`ScopedObjectStore` handle
built from the credentials it was minted (``/v1/task/credentials``): every
read, write and listing is checked by :meth:`LocalCredentialMinter.check` —
the same deny-by-default policy an STS session policy enforces on AWS — before
the file system is touched, so reads and writes outside the task's prefixes
fail. Keys are validated by the same canonical rules (no ``..``, no empty
segments, no encodings), so a key can never name a file outside the root.
Writes are atomic (a temporary file renamed into place): a half-written
object is never visible.

Keys map to files one to one (:func:`key_path`): an ordinary key is its own
path (``root/bucket/a/b.parquet``, which Spark and the query service read
directly), and only what a file name cannot say literally is escaped with
``%`` — a character no canonical key contains, so the escapes never clash
with a real key:

* a key ending in ``/`` (a folder marker, distinct from the key without it)
  is the file ``%`` in that folder;
* a segment starting with ``.`` (``.`` itself, or a name that would be
  hidden like a write in progress) is stored as ``%.…``;
* a segment longer than a file name may be (255 bytes) is cut into pieces
  of at most 200 bytes: ``%+piece/`` folders, then the rest.

Listing decodes the paths back to the keys (in S3 order, by UTF-8 bytes).
What one file system cannot hold at once, an object ``a`` next to objects
under ``a/``, is refused with :class:`KeyConflict`; a missing object is
:class:`NoSuchKey`. Neither is a raw OS error.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from trace_core.errors import InvalidInput, TraceError
from trace_core.security.minting import LocalCredentialMinter, MintedCredentials, StoreAction
from trace_core.security.scopes import parse_object_uri

__all__ = [
    "AccessDenied",
    "KeyConflict",
    "LocalObjectStore",
    "NoSuchKey",
    "ScopedObjectStore",
    "key_of_path",
    "key_path",
]

MAX_KEY_BYTES = 1024
"""S3's limit on a key (UTF-8)."""
_NAME_MAX = 255  # bytes of one file name (Linux, macOS)
_PIECE = 200  # bytes of one piece of a segment too long for a file name
_ESCAPE = "%"
_MARKER = "%"  # the file of a key ending in '/'
_PIECE_MARK = "%+"


class AccessDenied(TraceError, PermissionError):
    """The credentials do not allow this action on this key (deny by default)."""


class NoSuchKey(TraceError, FileNotFoundError):
    """No object is stored under this key."""


class KeyConflict(InvalidInput):
    """The key cannot be stored next to objects already there: an object ``a``
    and objects under ``a/`` exclude each other in a file system."""


def _utf8(text: str) -> int:
    return len(text.encode("utf-8"))


def _name(segment: str) -> str:
    """The file name of a short segment: itself, or escaped (see the module doc)."""
    if not segment:
        return _MARKER
    if segment.startswith("."):
        return _ESCAPE + segment
    return segment


def _pieces(segment: str) -> list[str]:
    """The path components of one key segment (``%+`` pieces, then its name)."""
    parts: list[str] = []
    while _utf8(_name(segment)) > _NAME_MAX:
        size, cut = 0, 0
        for char in segment:  # cut at a character boundary, at most _PIECE bytes
            width = _utf8(char)
            if size + width > _PIECE:
                break
            size, cut = size + width, cut + 1
        parts.append(_PIECE_MARK + segment[:cut])
        segment = segment[cut:]
    parts.append(_name(segment))
    return parts


def key_path(key: str) -> list[str]:
    """The path components of the file of ``key`` (one to one; see the module doc).

    Raises :class:`InvalidInput` (field ``key``) for a key S3 would refuse:
    empty, or over 1024 bytes.
    """
    if not key or _utf8(key) > MAX_KEY_BYTES:
        raise InvalidInput("key", f"must be 1..{MAX_KEY_BYTES} bytes of UTF-8")
    return [part for segment in key.split("/") for part in _pieces(segment)]


def key_of_path(parts: list[str]) -> str | None:
    """The key whose file is at ``parts`` (relative to the bucket), or ``None``
    for a file the store did not write under that name (a write in progress,
    a stray file)."""
    segments: list[str] = []
    pending = ""
    for part in parts:
        if part.startswith("."):
            return None  # a write in progress (a put's temporary file, Spark staging)
        if part.startswith(_PIECE_MARK):
            pending += part[len(_PIECE_MARK) :]
            continue
        if part == _MARKER:
            segment = ""
        elif part.startswith(_ESCAPE + "."):
            segment = part[1:]
        elif _ESCAPE in part:
            return None
        else:
            segment = part
        segments.append(pending + segment)
        pending = ""
    if pending or not segments:
        return None
    key = "/".join(segments)
    try:
        # Only the one canonical spelling of a key is that key's file.
        return key if key_path(key) == parts else None
    except InvalidInput:
        return None


class LocalObjectStore:
    """Buckets are directories under ``root``; objects are files."""

    def __init__(self, root: str | Path, minter: LocalCredentialMinter) -> None:
        self.root = Path(root)
        self.minter = minter

    def handle(self, credentials: MintedCredentials) -> ScopedObjectStore:
        """A handle confined to what ``credentials`` allow."""
        return ScopedObjectStore(self, credentials)

    def handle_for(self, values: Mapping[str, str]) -> ScopedObjectStore:
        """A handle for credentials in their wire form (a task context's
        ``credentials``); forged or expired ones raise
        :class:`~trace_core.errors.InvalidInput`."""
        return ScopedObjectStore(self, self.minter.restore(values))

    def _path(self, uri: str) -> Path:
        # parse_object_uri refuses traversal, encodings and empty segments, and
        # key_path escapes '.' names, so the joined path stays under root.
        bucket, key = parse_object_uri(uri, field="key", allow_empty=False)
        return self.root.joinpath(bucket, *key_path(key))


class ScopedObjectStore:
    """Get, put and list within the prefixes of one set of credentials."""

    def __init__(self, store: LocalObjectStore, credentials: MintedCredentials) -> None:
        self._store = store
        self._credentials = credentials

    def get(self, uri: str) -> bytes:
        """The object at ``uri``; :class:`AccessDenied` outside the read prefixes,
        :class:`NoSuchKey` if there is none."""
        self._require("read", uri)
        try:
            return self._store._path(uri).read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise NoSuchKey(f"no object {uri!r}") from None

    def put(self, uri: str, data: bytes) -> None:
        """Write the object at ``uri`` atomically; :class:`AccessDenied` outside
        the write prefixes, :class:`KeyConflict` where an object ``a`` and
        objects under ``a/`` would meet."""
        self._require("write", uri)
        path = self._store._path(uri)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise KeyConflict("key", f"{uri!r}: a shorter key is an object here") from None
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".put-")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except (IsADirectoryError, NotADirectoryError):
            Path(tmp).unlink(missing_ok=True)
            raise KeyConflict("key", f"{uri!r}: other objects are stored under it") from None
        except OSError as exc:
            Path(tmp).unlink(missing_ok=True)
            if exc.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                raise KeyConflict("key", f"{uri!r}: other objects are stored under it") from None
            raise
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def local_path(self, uri: str, action: StoreAction) -> Path:
        """The file behind ``uri`` for a tool that does its own file I/O (Spark,
        pyarrow); checked like :meth:`get` (``read``) or :meth:`put` (``write``).
        Such a writer must itself write atomically (stage, then rename)."""
        self._require(action, uri)
        return self._store._path(uri)

    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (sorted ``s3://`` URIs); :class:`AccessDenied`
        unless listing that prefix is allowed."""
        self._require("list", prefix)
        bucket, key_prefix = parse_object_uri(prefix, field="prefix", allow_empty=True)
        base = self._store.root / bucket
        if not base.is_dir():
            return []
        found = []
        for path in base.rglob("*"):
            if not path.is_file():
                continue
            # Dot-names are writes in progress (a put's temporary file, a
            # Spark staging directory): never visible as objects.
            key = key_of_path(list(path.relative_to(base).parts))
            if key is not None and key.startswith(key_prefix):
                found.append(key)
        # S3 lists in UTF-8 byte order, which is code point order.
        return [f"s3://{bucket}/{key}" for key in sorted(found)]

    def _require(self, action: StoreAction, uri: str) -> None:
        if not self._store.minter.check(self._credentials, action, uri):
            raise AccessDenied(f"{action} of {uri!r} is outside the task's scope")
