"""Euterpe's object access in the aws profile: S3 with the requester's credentials.

:class:`S3TranscodeStorage` opens a handle per job credentials (an STS
session, or long-term keys: the session token is optional here) on the
region and endpoint of an :class:`~trace_aws.s3.S3ObjectStore`, whose
multipart settings and commit rules the uploads reuse
(:meth:`~trace_aws.s3.S3ScopedStore.put_file`: one ``PutObject``, or one
multipart upload visible only when complete, so a retry replaces the same
object). Sizes come from ``HeadObject``; downloads stream ``GetObject`` in
chunks and stop past the limit.

S3's answers become the worker's errors
(:mod:`trace_core.euterpe.storage_access`): 401/403 and the expired or
invalid token codes are :class:`StorageAuthFailed` (the credential refresh
of §7), a missing key or bucket on a read :class:`ObjectMissing`, throttling
and 5xx :class:`StorageUnavailable`, anything else a fatal error naming the
operation and AWS's code (never AWS's message, which may echo values).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import anyio.to_thread
import boto3
from botocore.exceptions import BotoCoreError, ClientError

from trace_aws.errors import AwsRequestFailed, AwsUnavailable, error_code, is_transient
from trace_aws.s3 import AccessDenied, S3ObjectStore, S3ScopedStore
from trace_core.euterpe.credentials import StorageCredentials
from trace_core.euterpe.events import NormalizedError
from trace_core.euterpe.storage_access import (
    ObjectMissing,
    SourceTooLarge,
    StorageAuthFailed,
    StorageHandle,
    StorageUnavailable,
    TransferFailed,
)
from trace_core.security.scopes import InvalidScope, parse_object_uri

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

__all__ = ["S3StorageHandle", "S3TranscodeStorage"]

_CHUNK = 1024 * 1024
# Credential problems S3 answers with a 400 rather than a 403.
_CREDENTIAL_CODES = frozenset({"ExpiredToken", "InvalidToken", "TokenRefreshRequired"})
_MISSING_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "404", "NotFound"})


class S3TranscodeStorage:
    """:class:`~trace_core.euterpe.storage_access.TranscodeStorage` on S3."""

    def __init__(self, store: S3ObjectStore, *, chunk_bytes: int = _CHUNK) -> None:
        self.store = store
        self.chunk_bytes = chunk_bytes
        # Building clients from one session is not thread-safe; clients are.
        self._session = boto3.session.Session()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"S3TranscodeStorage({self.store!r})"

    def open(self, credentials: StorageCredentials) -> StorageHandle:
        """A handle whose client signs with ``credentials`` (no request yet)."""
        with self._lock:
            client: S3Client = self._session.client(
                "s3",
                region_name=self.store.region,
                endpoint_url=self.store.endpoint_url,
                aws_access_key_id=credentials.access_key_id,
                aws_secret_access_key=credentials.secret_access_key,
                aws_session_token=credentials.session_token,
            )
        return S3StorageHandle(self, S3ScopedStore(self.store, client, None))


class S3StorageHandle:
    """Object access with one set of credentials (see the module docstring)."""

    def __init__(self, storage: S3TranscodeStorage, scoped: S3ScopedStore) -> None:
        self._storage = storage
        self._scoped = scoped

    def __repr__(self) -> str:
        return "S3StorageHandle()"  # never the client: its credentials are secrets

    async def size(self, uri: str) -> int:
        """``ContentLength`` of ``HeadObject``."""
        bucket, key = _split(uri)

        def head() -> int:
            try:
                return int(self._scoped.client.head_object(Bucket=bucket, Key=key)["ContentLength"])
            except (ClientError, BotoCoreError) as exc:
                _fail("s3:HeadObject", uri, exc, read=True)

        return await anyio.to_thread.run_sync(head)

    async def download(self, uri: str, path: Path, max_bytes: int) -> int:
        """Stream ``GetObject`` into ``path``, refusing it past ``max_bytes``."""
        bucket, key = _split(uri)

        def get() -> int:
            written = 0
            with path.open("xb") as out:
                try:
                    body = self._scoped.client.get_object(Bucket=bucket, Key=key)["Body"]
                    try:
                        for chunk in body.iter_chunks(self._storage.chunk_bytes):
                            written += len(chunk)
                            if written > max_bytes:
                                raise SourceTooLarge(uri, None, max_bytes)
                            out.write(chunk)
                    finally:
                        body.close()
                except (ClientError, BotoCoreError) as exc:
                    _fail("s3:GetObject", uri, exc, read=True)
            return written

        return await anyio.to_thread.run_sync(get)

    async def upload(self, path: Path, uri: str) -> None:
        """Commit ``path`` as the object at ``uri`` (the S3 store's rules)."""
        _split(uri)

        def put() -> None:
            try:
                self._scoped.put_file(uri, path)
            except AccessDenied as exc:
                raise StorageAuthFailed(str(exc)) from None
            except AwsUnavailable as exc:
                raise StorageUnavailable(str(exc)) from None
            except AwsRequestFailed as exc:
                raise TransferFailed(NormalizedError("storage_error", str(exc), False)) from None

        await anyio.to_thread.run_sync(put)


def _split(uri: str) -> tuple[str, str]:
    try:
        return parse_object_uri(uri, field="key")
    except InvalidScope as exc:
        raise TransferFailed(NormalizedError("invalid_object_key", str(exc), False)) from None


def _fail(operation: str, uri: str, exc: ClientError | BotoCoreError, *, read: bool) -> NoReturn:
    """Raise the worker's error for an S3 failure (module docstring)."""
    if not isinstance(exc, ClientError):
        raise StorageUnavailable(f"AWS {operation} of {uri}: no answer ({type(exc).__name__})")
    code = error_code(exc)
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if status in (401, 403) or code in _CREDENTIAL_CODES:
        raise StorageAuthFailed(
            f"AWS {operation} of {uri} was denied ({code})",
            http_status=status if status in (401, 403) else 403,
        )
    if read and (code in _MISSING_CODES or status == 404):
        raise ObjectMissing(uri)
    if is_transient(exc) or status == 429:
        raise StorageUnavailable(
            f"AWS {operation} of {uri} failed transiently ({code})",
            http_status=status if isinstance(status, int) and status >= 429 else 503,
        )
    raise TransferFailed(
        NormalizedError("storage_error", f"AWS {operation} of {uri} failed ({code})", False, status)
    )
