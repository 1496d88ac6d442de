"""Euterpe's object access in the lite profile: the local object store.

:class:`LiteTranscodeStorage` opens handles on a
:class:`~trace_lite.object_store.LocalObjectStore` for a job's credentials
(the local minter's, in their wire form). Every call is checked by the
store's deny-by-default policy before the file system is touched: forged,
expired or out-of-scope credentials answer like S3 would, 403
(:class:`~trace_core.euterpe.storage_access.StorageAuthFailed`, the
credential refresh path). Downloads stream in chunks and stop past the
limit; uploads copy to a hidden temporary file beside the object and rename
it into place, so an object is whole or absent and a retry replaces it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import anyio.to_thread

from trace_core.errors import InvalidInput
from trace_core.euterpe.credentials import StorageCredentials
from trace_core.euterpe.events import NormalizedError
from trace_core.euterpe.storage_access import (
    ObjectMissing,
    SourceTooLarge,
    StorageAuthFailed,
    StorageHandle,
    TransferFailed,
)
from trace_core.security.minting import StoreAction
from trace_lite.object_store import AccessDenied, KeyConflict, LocalObjectStore, ScopedObjectStore

__all__ = ["LiteStorageHandle", "LiteTranscodeStorage"]

_CHUNK = 1024 * 1024


class LiteTranscodeStorage:
    """:class:`~trace_core.euterpe.storage_access.TranscodeStorage` over a local store."""

    def __init__(self, store: LocalObjectStore, *, chunk_bytes: int = _CHUNK) -> None:
        self.store = store
        self.chunk_bytes = chunk_bytes

    def open(self, credentials: StorageCredentials) -> StorageHandle:
        """A handle on ``credentials``; they are checked at each call."""
        return LiteStorageHandle(self, credentials)


class LiteStorageHandle:
    """Object access with one set of local credentials (see the module docstring)."""

    def __init__(self, storage: LiteTranscodeStorage, credentials: StorageCredentials) -> None:
        self._storage = storage
        self._credentials = credentials

    def __repr__(self) -> str:
        return f"LiteStorageHandle({self._credentials!r})"

    def _path(self, uri: str, action: StoreAction) -> Path:
        """The file behind ``uri`` if the credentials allow ``action`` on it."""
        try:
            scoped: ScopedObjectStore = self._storage.store.handle_for(self._credentials.as_wire())
            return scoped.local_path(uri, action)
        except AccessDenied:
            raise StorageAuthFailed(f"{action} of {uri} denied for these credentials") from None
        except InvalidInput as exc:
            # handle_for refuses forged and expired credentials (S3: 403)
            if exc.field.startswith("credentials"):
                raise StorageAuthFailed(f"credentials refused ({exc.reason})") from None
            raise TransferFailed(
                NormalizedError("invalid_object_key", f"{uri}: {exc.reason}", False)
            ) from None

    async def size(self, uri: str) -> int:
        """The object's size from the file system."""
        path = self._path(uri, "read")
        try:
            return (await anyio.to_thread.run_sync(os.stat, path)).st_size
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectMissing(uri) from None

    async def download(self, uri: str, path: Path, max_bytes: int) -> int:
        """Copy the object chunk by chunk, refusing it past ``max_bytes``."""
        source = self._path(uri, "read")
        return await anyio.to_thread.run_sync(self._copy, uri, source, path, max_bytes)

    def _copy(self, uri: str, source: Path, target: Path, max_bytes: int) -> int:
        written = 0
        try:
            reader = source.open("rb")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectMissing(uri) from None
        with reader, target.open("xb") as writer:
            while chunk := reader.read(self._storage.chunk_bytes):
                written += len(chunk)
                if written > max_bytes:
                    raise SourceTooLarge(uri, None, max_bytes)
                writer.write(chunk)
        return written

    async def upload(self, path: Path, uri: str) -> None:
        """Commit ``path`` as the object (stage beside it, then rename)."""
        target = self._path(uri, "write")
        await anyio.to_thread.run_sync(_commit, path, target, uri)


def _commit(source: Path, target: Path, uri: str) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise _conflict(uri) from None
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".put-")
    try:
        with os.fdopen(fd, "wb") as out, source.open("rb") as src:
            shutil.copyfileobj(src, out, _CHUNK)
        os.replace(tmp, target)
    except (IsADirectoryError, NotADirectoryError):
        Path(tmp).unlink(missing_ok=True)
        raise _conflict(uri) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _conflict(uri: str) -> TransferFailed:
    reason = KeyConflict("key", f"{uri}: an object and objects under it cannot meet here")
    return TransferFailed(NormalizedError("output_key_conflict", str(reason), False))
