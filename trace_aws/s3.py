"""The aws profile's object store: S3 through a task's minted credentials.

Same interface and commit rules as the lite store
(:mod:`trace_lite.object_store`): a task never gets the store itself, only a
:class:`S3ScopedStore` handle built from the credentials it was minted
(``/v1/task/credentials``), with ``get``, ``put`` and ``list`` on
``s3://bucket/key`` URIs and the same errors (:class:`AccessDenied`,
:class:`NoSuchKey`).

Commit rules. An output lands under its deterministic key in one request:
a single ``PutObject`` up to ``multipart_threshold``, above it one multipart
upload, which S3 makes visible only at ``CompleteMultipartUpload``. So a
reader sees the whole object or none, and a retry replaces the same object.
A multipart upload that fails is aborted (its parts are never visible and
stop costing storage); the session policy grants
``s3:AbortMultipartUpload`` for exactly that. Tools that write files
themselves (Spark writes its single part locally) hand the finished file to
:meth:`S3ScopedStore.put_file`, the S3 counterpart of the lite commit's
rename; :meth:`S3ScopedStore.get_file` brings an input to a local file.

Enforcement is IAM's (the session policy the STS minter sent). When the
handle knows the credentials' scope (:meth:`S3ObjectStore.handle`, or
``scope=`` to :meth:`S3ObjectStore.handle_for`) every request is first
checked with :func:`~trace_core.security.minting.scope_allows`, the same
check the lite store makes, so a request outside the scope fails the same
way in both profiles without a round trip. Keys breaking the canonical path
rules (``..``, ``a//b``, ``%``, ``\\``) are refused before any request in
every case: S3 keys are literal, but a client or proxy that normalized the
path would reach another object.

One difference from the lite store: S3 holds an object ``a`` next to objects
under ``a/``, so :class:`~trace_lite.object_store.KeyConflict` never arises.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import threading
from collections.abc import Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, NoReturn

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from trace_aws.errors import aws_error, error_code
from trace_core.errors import ConfigurationError, InvalidInput
from trace_core.security.minting import (
    MintedCredentials,
    StoreAction,
    scope_allows,
    wire_credentials,
)
from trace_core.security.scopes import InvalidScope, Scope, parse_object_uri
from trace_lite.object_store import AccessDenied, NoSuchKey

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_s3.type_defs import CompletedPartTypeDef

__all__ = [
    "MAX_PARTS",
    "MIN_PART_SIZE",
    "AccessDenied",
    "NoSuchKey",
    "S3ObjectStore",
    "S3ScopedStore",
]

_log = logging.getLogger(__name__)

MiB = 1024 * 1024
MIN_PART_SIZE = 5 * MiB
"""S3's smallest part (every part but the last)."""
MAX_PARTS = 10_000
"""S3's most parts in one upload; the part size grows for larger files."""
MAX_SINGLE_PUT = 5 * 1024 * MiB
"""S3's largest single ``PutObject``."""
_DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "ExpiredToken",
        "InvalidAccessKeyId",
        "InvalidToken",
        "SignatureDoesNotMatch",
        "TokenRefreshRequired",
    }
)
_MISSING_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "404", "NotFound"})


class S3ObjectStore:
    """Opens :class:`S3ScopedStore` handles on one region (and endpoint).

    ``multipart_threshold`` is the largest object sent as one ``PutObject``;
    larger ones go as multipart uploads of ``part_size`` parts (grown so that
    no upload needs more than 10,000 parts). ``endpoint_url`` overrides the
    S3 endpoint (a moto server, LocalStack, a VPC endpoint).
    """

    def __init__(
        self,
        *,
        region: str,
        endpoint_url: str | None = None,
        multipart_threshold: int = 64 * MiB,
        part_size: int = 16 * MiB,
        config: Config | None = None,
    ) -> None:
        """Validate the settings; no request is made here."""
        if not isinstance(region, str) or not region:
            raise ConfigurationError("region: is required (an AWS region such as us-east-1)")
        if isinstance(part_size, bool) or not isinstance(part_size, int):
            raise ConfigurationError("part_size: must be an integer number of bytes")
        if part_size < MIN_PART_SIZE:
            raise ConfigurationError(f"part_size: must be at least {MIN_PART_SIZE} bytes (S3)")
        if isinstance(multipart_threshold, bool) or not isinstance(multipart_threshold, int):
            raise ConfigurationError("multipart_threshold: must be an integer number of bytes")
        if not 0 < multipart_threshold <= MAX_SINGLE_PUT:
            raise ConfigurationError(
                f"multipart_threshold: must be 1..{MAX_SINGLE_PUT} bytes (S3's single PUT limit)"
            )
        self.region = region
        self.endpoint_url = endpoint_url
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        self._config = config or Config(retries={"mode": "standard", "max_attempts": 5})
        # One session for every handle's client: building clients from a
        # session is not thread-safe (the clients themselves are), and
        # handles are opened from operator threads.
        self._session = boto3.session.Session()
        self._lock = threading.Lock()

    def handle(self, credentials: MintedCredentials) -> S3ScopedStore:
        """A handle on ``credentials`` that also checks their scope client-side."""
        if not isinstance(credentials, MintedCredentials):
            raise InvalidInput("credentials", "must be MintedCredentials")
        return S3ScopedStore(self, self._client(credentials), credentials.scope)

    def handle_for(self, values: Mapping[str, str], *, scope: Scope | None = None) -> S3ScopedStore:
        """A handle for credentials in their wire form (a task context's
        ``credentials``: ``access_key_id``, ``secret_access_key``,
        ``session_token``, ``expiration``). STS credentials do not carry their
        scope; pass ``scope`` (the capability's) to check it client-side too.
        A missing value raises :class:`~trace_core.errors.InvalidInput` naming it."""
        wire = wire_credentials(values)
        expiration = values.get("expiration")
        if expiration is not None:
            try:
                datetime.fromisoformat(str(expiration))
            except ValueError:
                raise InvalidInput("credentials.expiration", "must be an ISO 8601 time") from None
        client = self._client_for(
            wire["access_key_id"], wire["secret_access_key"], wire["session_token"]
        )
        return S3ScopedStore(self, client, scope)

    def _client(self, credentials: MintedCredentials) -> S3Client:
        return self._client_for(
            credentials.access_key_id, credentials.secret_access_key, credentials.session_token
        )

    def _client_for(self, access_key_id: str, secret: str, token: str) -> S3Client:
        with self._lock:
            return self._session.client(
                "s3",
                region_name=self.region,
                endpoint_url=self.endpoint_url,
                aws_access_key_id=access_key_id,
                aws_secret_access_key=secret,
                aws_session_token=token,
                config=self._config,
            )

    def __repr__(self) -> str:
        return f"S3ObjectStore(region={self.region!r}, endpoint_url={self.endpoint_url!r})"


class S3ScopedStore:
    """Get, put and list with one set of task credentials (see the module doc)."""

    def __init__(self, store: S3ObjectStore, client: S3Client, scope: Scope | None) -> None:
        self._store = store
        self._client = client
        self._scope = scope

    def __repr__(self) -> str:
        # Never the client: its credentials are secrets.
        scope = self._scope.as_dict() if self._scope is not None else None
        return f"S3ScopedStore(scope={scope!r})"

    @property
    def client(self) -> S3Client:
        """The S3 client on this handle's credentials (thread-safe)."""
        return self._client

    def get(self, uri: str) -> bytes:
        """The object at ``uri``; :class:`AccessDenied` outside the read prefixes,
        :class:`NoSuchKey` if there is none."""
        bucket, key = self._require("read", uri)
        try:
            response = self._client.get_object(Bucket=bucket, Key=key)
            return response["Body"].read()
        except (ClientError, BotoCoreError) as exc:
            _raise("s3:GetObject", uri, exc)

    def get_file(self, uri: str, path: str | Path) -> Path:
        """Download ``uri`` to ``path`` (written beside it, then renamed: a
        reader of ``path`` never sees half a file). Errors as :meth:`get`."""
        bucket, key = self._require("read", uri)
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".get-")
        try:
            with os.fdopen(fd, "wb") as fh:
                try:
                    body = self._client.get_object(Bucket=bucket, Key=key)["Body"]
                    for chunk in body.iter_chunks(MiB):
                        fh.write(chunk)
                except (ClientError, BotoCoreError) as exc:
                    _raise("s3:GetObject", uri, exc)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return target

    def put(self, uri: str, data: bytes) -> None:
        """Write the object at ``uri`` in one commit; :class:`AccessDenied`
        outside the write prefixes. Above the multipart threshold the bytes
        go as one multipart upload (invisible until complete, aborted on failure)."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise InvalidInput("data", "must be bytes")
        bucket, key = self._require("write", uri)
        view = memoryview(data)
        if len(view) <= self._store.multipart_threshold:
            self._put_object(bucket, key, bytes(view), uri)
            return
        size = self._part_size(len(view))
        parts = (bytes(view[i : i + size]) for i in range(0, len(view), size))
        self._multipart(bucket, key, uri, parts)

    def put_file(self, uri: str, path: str | Path) -> None:
        """Upload the finished local file ``path`` as the object at ``uri``
        (the commit of a file a tool wrote itself, e.g. Spark's single part);
        same rules as :meth:`put`, read part by part so memory stays bounded."""
        bucket, key = self._require("write", uri)
        source = Path(path)
        size = source.stat().st_size
        with source.open("rb") as fh:
            if size <= self._store.multipart_threshold:
                self._put_object(bucket, key, fh.read(), uri)
                return
            self._multipart(bucket, key, uri, _chunks(fh, self._part_size(size)))

    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (sorted ``s3://`` URIs); :class:`AccessDenied`
        unless listing that prefix is allowed. A missing bucket lists nothing."""
        bucket, key_prefix = self._require("list", prefix)
        found: list[str] = []
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=key_prefix
            )
            for page in pages:
                found.extend(item["Key"] for item in page.get("Contents", []))
        except ClientError as exc:
            if error_code(exc) == "NoSuchBucket":
                return []
            _raise("s3:ListBucket", prefix, exc)
        except BotoCoreError as exc:
            _raise("s3:ListBucket", prefix, exc)
        # S3 lists in UTF-8 byte order, which is code point order; sort all
        # the same so the answer does not depend on an S3-compatible server.
        return [f"s3://{bucket}/{key}" for key in sorted(found)]

    def _put_object(self, bucket: str, key: str, body: bytes, uri: str) -> None:
        try:
            self._client.put_object(Bucket=bucket, Key=key, Body=body)
        except (ClientError, BotoCoreError) as exc:
            _raise("s3:PutObject", uri, exc)

    def _part_size(self, size: int) -> int:
        return max(self._store.part_size, math.ceil(size / MAX_PARTS))

    def _multipart(self, bucket: str, key: str, uri: str, parts: Iterator[bytes]) -> None:
        """One multipart upload of ``parts``: completed, or aborted on any failure."""
        try:
            upload_id = self._client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        except (ClientError, BotoCoreError) as exc:
            _raise("s3:CreateMultipartUpload", uri, exc)
        operation = "s3:UploadPart"
        try:
            done: list[CompletedPartTypeDef] = []
            for number, body in enumerate(parts, start=1):
                answer = self._client.upload_part(
                    Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body
                )
                done.append({"PartNumber": number, "ETag": answer["ETag"]})
            operation = "s3:CompleteMultipartUpload"
            self._client.complete_multipart_upload(
                Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": done}
            )
        except BaseException as exc:
            self._abort(bucket, key, upload_id)
            if isinstance(exc, ClientError | BotoCoreError):
                _raise(operation, uri, exc)
            raise

    def _abort(self, bucket: str, key: str, upload_id: str) -> None:
        try:
            self._client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
        except (ClientError, BotoCoreError) as exc:
            # The upload's error is what the caller needs; an abandoned
            # upload is invisible and a bucket lifecycle rule removes it.
            _log.warning(
                "could not abort multipart upload of s3://%s/%s (%s)",
                bucket,
                key,
                error_code(exc) if isinstance(exc, ClientError) else type(exc).__name__,
            )

    def _require(self, action: StoreAction, uri: str) -> tuple[str, str]:
        """``(bucket, key)`` of ``uri`` if the request may be sent; else :class:`AccessDenied`."""
        try:
            bucket, key = parse_object_uri(uri, field="key", allow_empty=action == "list")
        except InvalidScope:
            raise AccessDenied(f"{action} of {uri!r} is not a canonical key") from None
        if self._scope is not None and not scope_allows(self._scope, action, uri):
            raise AccessDenied(f"{action} of {uri!r} is outside the task's scope")
        return bucket, key


def _chunks(fh: IO[bytes], part: int) -> Iterator[bytes]:
    while chunk := fh.read(part):
        yield chunk


def _raise(operation: str, uri: str, exc: ClientError | BotoCoreError) -> NoReturn:
    """Raise the store error for ``exc``: denied and missing as the lite store
    raises them, everything else through :func:`~trace_aws.errors.aws_error`."""
    if isinstance(exc, ClientError):
        code = error_code(exc)
        if code in _DENIED_CODES:
            detail = "the credentials expired" if code == "ExpiredToken" else code
            raise AccessDenied(f"AWS {operation} of {uri!r} was denied ({detail})") from None
        # A missing bucket is a missing object only to a read; a write into
        # one is a configuration error (aws_error keeps its code).
        if code in _MISSING_CODES and operation == "s3:GetObject":
            raise NoSuchKey(f"no object {uri!r}") from None
    raise aws_error(operation, exc) from None
