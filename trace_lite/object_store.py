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
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from trace_core.errors import TraceError
from trace_core.security.minting import LocalCredentialMinter, MintedCredentials, StoreAction
from trace_core.security.scopes import parse_object_uri

__all__ = ["AccessDenied", "LocalObjectStore", "ScopedObjectStore"]


class AccessDenied(TraceError, PermissionError):
    """The credentials do not allow this action on this key (deny by default)."""


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
        # parse_object_uri refuses traversal, encodings and empty segments, so
        # the joined path stays under root.
        bucket, key = parse_object_uri(uri, field="key", allow_empty=False)
        return self.root / bucket / key


class ScopedObjectStore:
    """Get, put and list within the prefixes of one set of credentials."""

    def __init__(self, store: LocalObjectStore, credentials: MintedCredentials) -> None:
        self._store = store
        self._credentials = credentials

    def get(self, uri: str) -> bytes:
        """The object at ``uri``; :class:`AccessDenied` outside the read prefixes."""
        self._require("read", uri)
        return self._store._path(uri).read_bytes()

    def put(self, uri: str, data: bytes) -> None:
        """Write the object at ``uri`` atomically; :class:`AccessDenied` outside
        the write prefixes."""
        self._require("write", uri)
        path = self._store._path(uri)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".put-")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
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
            relative = path.relative_to(base)
            # Dot-names are writes in progress (a put's temporary file, a
            # Spark staging directory): never visible as objects.
            if path.is_file() and not any(part.startswith(".") for part in relative.parts):
                key = relative.as_posix()
                if key.startswith(key_prefix):
                    found.append(f"s3://{bucket}/{key}")
        return sorted(found)

    def _require(self, action: StoreAction, uri: str) -> None:
        if not self._store.minter.check(self._credentials, action, uri):
            raise AccessDenied(f"{action} of {uri!r} is outside the task's scope")
