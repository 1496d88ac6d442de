"""How a Euterpe worker reaches the requester's object store (euterpe-contract.md §7, §11).

:class:`TranscodeStorage` opens a :class:`StorageHandle` for a job's opened
:class:`~trace_core.euterpe.credentials.StorageCredentials`; the handle reads
an object's size, downloads it to a local file (streaming, and stopping as
soon as more than ``max_bytes`` arrived: an object's stated size may lie) and
uploads a finished local file under a key. Implementations: the lite store
(:mod:`trace_lite.euterpe_storage`) and S3 (:mod:`trace_aws.euterpe_storage`).

Every failure is a :class:`TransferFailed` carrying the
:class:`~trace_core.euterpe.events.NormalizedError` the requester sees and,
where one applies, the HTTP status that :meth:`RetryPolicy.classify
<trace_core.retry.RetryPolicy.classify>` sorts on: a refused or expired
credential is :class:`StorageAuthFailed` (403: the credential refresh of §7),
a missing object :class:`ObjectMissing` (fatal), an object over the limit
:class:`SourceTooLarge` (fatal), an unreachable or throttling store
:class:`StorageUnavailable` (5xx / 429: retried).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from trace_core.errors import TraceError
from trace_core.euterpe.credentials import StorageCredentials
from trace_core.euterpe.events import NormalizedError

__all__ = [
    "ObjectMissing",
    "SourceTooLarge",
    "StorageAuthFailed",
    "StorageHandle",
    "StorageUnavailable",
    "TranscodeStorage",
    "TransferFailed",
]


class TransferFailed(TraceError):
    """A failure of the worker's object access, as the requester sees it."""

    def __init__(self, error: NormalizedError) -> None:
        super().__init__(f"{error.code}: {error.message}")
        self.error = error

    @property
    def http_status(self) -> int | None:
        """The status :meth:`~trace_core.retry.RetryPolicy.classify` sorts on."""
        return self.error.http_status


class StorageAuthFailed(TransferFailed):
    """The store refused the credentials (expired, revoked, out of scope):
    401/403, the credential refresh path (§7)."""

    def __init__(self, message: str, *, http_status: int = 403) -> None:
        super().__init__(NormalizedError("storage_forbidden", message, False, http_status))


class ObjectMissing(TransferFailed):
    """The source object does not exist: fatal, a retry finds nothing either."""

    def __init__(self, uri: str) -> None:
        super().__init__(
            NormalizedError("source_not_found", f"no object at {uri}", False, http_status=404)
        )


class SourceTooLarge(TransferFailed):
    """The source is over the worker's maximum source size (§11): fatal."""

    def __init__(self, uri: str, size: int | None, limit: int) -> None:
        seen = "more than that" if size is None else f"{size} bytes"
        super().__init__(
            NormalizedError(
                "source_too_large",
                f"{uri} is {seen}; the maximum source size is {limit} bytes",
                False,
            )
        )


class StorageUnavailable(TransferFailed):
    """The store did not answer, or answered 429/5xx: retried with backoff."""

    def __init__(self, message: str, *, http_status: int = 503) -> None:
        super().__init__(NormalizedError("storage_unavailable", message, True, http_status))


class StorageHandle(Protocol):
    """Object access with one set of credentials (blocking work runs off the loop)."""

    async def size(self, uri: str) -> int:
        """The size in bytes of the object at ``uri``, without reading it."""
        ...

    async def download(self, uri: str, path: Path, max_bytes: int) -> int:
        """Stream the object at ``uri`` into the new file ``path``; the bytes
        written. :class:`SourceTooLarge` as soon as more than ``max_bytes``
        arrived (whatever :meth:`size` said); ``path`` may then hold a part,
        which the caller removes with its temporary directory."""
        ...

    async def upload(self, path: Path, uri: str) -> None:
        """Store the finished local file ``path`` as the object at ``uri`` in
        one commit: readers see the whole object or none, and uploading to
        the same ``uri`` again replaces it."""
        ...


class TranscodeStorage(Protocol):
    """Opens handles on the requester's store for a job's credentials."""

    def open(self, credentials: StorageCredentials) -> StorageHandle:
        """A handle acting with ``credentials`` (no request is made yet;
        credentials the store will refuse fail at the first call, with
        :class:`StorageAuthFailed`)."""
        ...
