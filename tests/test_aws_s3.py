"""The S3 object store against moto, through credentials the STS minter minted.

Same interface and commit rules as the lite store: one ``PutObject`` under
the deterministic key (a retry replaces it), multipart above the threshold,
visible only when complete and aborted on failure. moto does not enforce
session policies, so confinement here is the store's client-side check
(:func:`~trace_core.security.minting.scope_allows`, the lite store's check);
IAM's enforcement is the real-AWS test in ``test_aws_sts.py``. Expired
credentials and throttling are what moto cannot produce: their error mapping
is tested with botocore's Stubber, and only that.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from botocore.stub import Stubber
from moto.server import ThreadedMotoServer

import tests.test_aws_sts as sts_tests
from trace_aws.errors import AwsRequestFailed, AwsUnavailable
from trace_aws.s3 import MIN_PART_SIZE, AccessDenied, NoSuchKey, S3ObjectStore, S3ScopedStore
from trace_aws.sts import StsCredentialMinter
from trace_core.errors import ConfigurationError, InvalidInput
from trace_core.security.minting import MintedCredentials
from trace_core.security.scopes import Scope

pytestmark = pytest.mark.anyio

# The AWS fixtures of the STS tests (fake credentials, mock_aws, a role);
# a later session moves them to a shared fixture module.
REGION = sts_tests.REGION
aws_env = sts_tests.aws_env
mocked = sts_tests.mocked
role_arn = sts_tests.role_arn

DATA, SCRATCH = "trace-data", "trace-scratch"
INPUT = f"s3://{DATA}/tenants/t1/datasets/orders/v3/"
OUTPUT = f"s3://{DATA}/tenants/t1/datasets/revenue/v12/"
TMP = f"s3://{SCRATCH}/tenants/t1/tasks/abc/1/"
SCOPE = Scope.from_capability([INPUT], OUTPUT, TMP)
BIG = 2 * MIN_PART_SIZE + 1234  # three parts


@pytest.fixture
def admin(mocked: None) -> Any:
    """The operator's own client (outside any task scope): sets up and inspects."""
    s3 = boto3.client("s3", region_name=REGION)
    for bucket in (DATA, SCRATCH):
        s3.create_bucket(Bucket=bucket)
    s3.put_object(Bucket=DATA, Key="tenants/t1/datasets/orders/v3/part-0", Body=b"input")
    s3.put_object(Bucket=DATA, Key="tenants/t2/datasets/orders/v3/part-0", Body=b"tenant 2")
    return s3


@pytest.fixture
async def minted(admin: Any, role_arn: str) -> MintedCredentials:
    minter = StsCredentialMinter(role_arn, region=REGION)
    return await minter.mint(SCOPE, session_name="task-abc-1", duration_seconds=900)


@pytest.fixture
def store(mocked: None) -> S3ObjectStore:
    # The smallest multipart settings S3 allows, so three parts stay small.
    return S3ObjectStore(region=REGION, multipart_threshold=MIN_PART_SIZE, part_size=MIN_PART_SIZE)


@pytest.fixture
def handle(store: S3ObjectStore, minted: MintedCredentials) -> S3ScopedStore:
    return store.handle(minted)


def wire(minted: MintedCredentials) -> dict[str, str]:
    return {
        "access_key_id": minted.access_key_id,
        "secret_access_key": minted.secret_access_key,
        "session_token": minted.session_token,
        "expiration": minted.expiration.isoformat(),
    }


def keys(admin: Any, bucket: str, prefix: str = "") -> list[str]:
    return [
        o["Key"] for o in admin.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    ]


# --- the interface of the lite store ------------------------------------------------


async def test_put_get_list_within_the_scope(handle: S3ScopedStore, admin: Any) -> None:
    assert handle.get(INPUT + "part-0") == b"input"
    handle.put(OUTPUT + "b.parquet", b"bee")
    handle.put(OUTPUT + "a.parquet", b"ay")
    handle.put(TMP + "spill", b"tmp")
    assert (
        admin.get_object(Bucket=DATA, Key="tenants/t1/datasets/revenue/v12/a.parquet")[
            "Body"
        ].read()
        == b"ay"
    )
    assert handle.list(OUTPUT) == [OUTPUT + "a.parquet", OUTPUT + "b.parquet"]
    assert handle.get(TMP + "spill") == b"tmp"


async def test_a_retry_replaces_the_same_object(handle: S3ScopedStore, admin: Any) -> None:
    handle.put(OUTPUT + "part-0", b"first attempt")
    handle.put(OUTPUT + "part-0", b"second attempt")
    assert keys(admin, DATA, "tenants/t1/datasets/revenue/") == [
        "tenants/t1/datasets/revenue/v12/part-0"
    ]
    assert (
        admin.get_object(Bucket=DATA, Key="tenants/t1/datasets/revenue/v12/part-0")["Body"].read()
        == b"second attempt"
    )


@pytest.mark.parametrize(
    ("action", "uri"),
    [
        ("get", f"s3://{DATA}/tenants/t2/datasets/orders/v3/part-0"),  # other tenant
        ("get", f"s3://{DATA}/tenants/t1/datasets/orders/v30/part-0"),  # neighbour
        ("get", OUTPUT + "part-0"),  # write does not imply read
        ("get", "s3://other-bucket/tenants/t1/datasets/orders/v3/part-0"),
        ("put", INPUT + "part-1"),  # read does not imply write
        ("put", f"s3://{DATA}/tenants/t2/datasets/revenue/v12/part-0"),
        ("put", f"s3://{DATA}/tenants/t1/datasets/revenue/v120/part-0"),
        ("put", OUTPUT + "../v11/part-0"),
        ("put", OUTPUT + "a//b"),
        ("list", f"s3://{DATA}/"),  # the whole bucket
        ("list", f"s3://{DATA}/tenants/t1/"),
        ("list", f"s3://{DATA}/tenants/t1/datasets/orders/v3"),  # without the slash
    ],
)
async def test_requests_outside_the_scope_are_denied_before_sending(
    handle: S3ScopedStore, admin: Any, action: str, uri: str
) -> None:
    sent: list[str] = []
    handle.client.meta.events.register("before-call.s3", lambda model, **_: sent.append(model.name))
    before = {b: keys(admin, b) for b in (DATA, SCRATCH)}
    verb = {"get": "read", "put": "write", "list": "list"}[action]
    with pytest.raises(AccessDenied, match=f"^{verb} of"):
        if action == "get":
            handle.get(uri)
        elif action == "put":
            handle.put(uri, b"x")
        else:
            handle.list(uri)
    assert sent == []
    assert {b: keys(admin, b) for b in (DATA, SCRATCH)} == before


async def test_wire_credentials_without_scope_still_refuse_non_canonical_keys(
    store: S3ObjectStore, minted: MintedCredentials, admin: Any
) -> None:
    handle = store.handle_for(wire(minted))
    assert handle.get(INPUT + "part-0") == b"input"
    for uri in (INPUT + "../../../t2/datasets/orders/v3/part-0", INPUT + "a//b", INPUT + "%2e"):
        with pytest.raises(AccessDenied, match="canonical"):
            handle.get(uri)
    scoped = store.handle_for(wire(minted), scope=SCOPE)
    with pytest.raises(AccessDenied, match="scope"):
        scoped.get(f"s3://{DATA}/tenants/t2/datasets/orders/v3/part-0")


@pytest.mark.parametrize("missing", ["access_key_id", "secret_access_key", "session_token"])
async def test_wire_credentials_missing_a_value_name_it(
    store: S3ObjectStore, minted: MintedCredentials, missing: str
) -> None:
    values = wire(minted)
    values[missing] = ""
    with pytest.raises(InvalidInput) as info:
        store.handle_for(values)
    assert info.value.field == f"credentials.{missing}"
    assert minted.secret_access_key not in str(info.value)


async def test_bad_expiration_is_named(store: S3ObjectStore, minted: MintedCredentials) -> None:
    with pytest.raises(InvalidInput) as info:
        store.handle_for({**wire(minted), "expiration": "soon"})
    assert info.value.field == "credentials.expiration"


async def test_missing_objects_and_buckets(handle: S3ScopedStore, admin: Any) -> None:
    with pytest.raises(NoSuchKey):
        handle.get(INPUT + "absent")
    admin.delete_object(Bucket=SCRATCH, Key="x")  # (nothing there) the bucket goes next
    admin.delete_bucket(Bucket=SCRATCH)
    with pytest.raises(NoSuchKey):
        handle.get(TMP + "spill")
    assert handle.list(TMP) == []
    # Writing into a deleted bucket is a configuration error, not a missing key.
    with pytest.raises(AwsRequestFailed, match=r"s3:PutObject.*NoSuchBucket"):
        handle.put(TMP + "spill", b"x")


# --- commit rules: single PUT, multipart, never half visible ---------------------------


def _etag(admin: Any, key: str) -> str:
    return str(admin.head_object(Bucket=DATA, Key=key)["ETag"]).strip('"')


async def test_large_put_is_one_multipart_upload(handle: S3ScopedStore, admin: Any) -> None:
    data = bytes(range(256)) * (BIG // 256) + b"tail"
    handle.put(OUTPUT + "big", data)
    handle.put(OUTPUT + "small", b"small")
    key = "tenants/t1/datasets/revenue/v12/big"
    assert admin.get_object(Bucket=DATA, Key=key)["Body"].read() == data
    # A multipart ETag is md5-of-part-md5s "-" part count; a single PUT's is the md5.
    assert _etag(admin, key).endswith("-3")
    assert (
        _etag(admin, "tenants/t1/datasets/revenue/v12/small") == hashlib.md5(b"small").hexdigest()
    )


async def test_put_file_uploads_a_finished_local_file(
    handle: S3ScopedStore, admin: Any, tmp_path: Path
) -> None:
    big, small = tmp_path / "big.parquet", tmp_path / "small.parquet"
    big.write_bytes(b"\x07" * BIG)
    small.write_bytes(b"one part")
    handle.put_file(OUTPUT + "big.parquet", big)
    handle.put_file(OUTPUT + "small.parquet", small)
    assert _etag(admin, "tenants/t1/datasets/revenue/v12/big.parquet").endswith("-3")
    assert handle.list(OUTPUT) == [OUTPUT + "big.parquet", OUTPUT + "small.parquet"]
    assert (
        admin.get_object(Bucket=DATA, Key="tenants/t1/datasets/revenue/v12/big.parquet")[
            "Body"
        ].read()
        == big.read_bytes()
    )


def _fail_part(handle: S3ScopedStore, number: int, failure: BaseException) -> None:
    """Make UploadPart ``number`` raise ``failure`` (as the call's own error)."""

    def hook(params: dict[str, Any], **_: Any) -> None:
        if params.get("PartNumber") == number:
            raise failure

    handle.client.meta.events.register("provide-client-params.s3.UploadPart", hook)


INTERNAL_ERROR: Any = {
    "Error": {"Code": "InternalError"},
    "ResponseMetadata": {"HTTPStatusCode": 500},
}


@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        (RuntimeError("operator cancelled"), RuntimeError),
        (
            ClientError(INTERNAL_ERROR, "UploadPart"),
            AwsUnavailable,
        ),
    ],
)
async def test_a_failed_multipart_upload_is_aborted_and_never_visible(
    handle: S3ScopedStore, admin: Any, failure: BaseException, expected: type[BaseException]
) -> None:
    handle.put(OUTPUT + "part-0", b"previous attempt")
    _fail_part(handle, 2, failure)
    with pytest.raises(expected):
        handle.put(OUTPUT + "part-0", b"\x01" * BIG)
    # The previous object is untouched, no upload is left pending.
    assert (
        admin.get_object(Bucket=DATA, Key="tenants/t1/datasets/revenue/v12/part-0")["Body"].read()
        == b"previous attempt"
    )
    assert admin.list_multipart_uploads(Bucket=DATA).get("Uploads", []) == []


async def test_get_file_downloads_whole_or_not_at_all(
    handle: S3ScopedStore, tmp_path: Path
) -> None:
    target = handle.get_file(INPUT + "part-0", tmp_path / "in" / "part-0")
    assert target.read_bytes() == b"input"
    with pytest.raises(NoSuchKey):
        handle.get_file(INPUT + "absent", tmp_path / "in" / "absent")
    assert sorted(p.name for p in (tmp_path / "in").iterdir()) == ["part-0"]


# --- AWS failures --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "code", "status", "expected", "text"),
    [
        # Stubber: moto neither expires STS credentials nor throttles.
        ("get_object", "ExpiredToken", 400, AccessDenied, "expired"),
        ("get_object", "AccessDenied", 403, AccessDenied, "AccessDenied"),
        ("get_object", "SlowDown", 503, AwsUnavailable, "SlowDown"),
        ("put_object", "ExpiredToken", 400, AccessDenied, "expired"),
        ("put_object", "ServiceUnavailable", 503, AwsUnavailable, "ServiceUnavailable"),
    ],
)
async def test_aws_errors_become_store_errors_without_secrets(
    store: S3ObjectStore,
    minted: MintedCredentials,
    caplog: pytest.LogCaptureFixture,
    method: str,
    code: str,
    status: int,
    expected: type[Exception],
    text: str,
) -> None:
    handle = store.handle(minted)
    stubber = Stubber(handle.client)
    stubber.add_client_error(
        method,
        service_error_code=code,
        service_message=minted.session_token,
        http_status_code=status,
    )
    caplog.set_level(logging.DEBUG, logger="trace_aws")
    with stubber, pytest.raises(expected) as info:
        if method == "get_object":
            handle.get(INPUT + "part-0")
        else:
            handle.put(OUTPUT + "part-0", b"x")
    message = str(info.value)
    assert text in message
    for secret in (minted.session_token, minted.secret_access_key):
        assert secret not in message and secret not in caplog.text
    assert minted.secret_access_key not in repr(handle) + repr(store)


def test_bad_settings_name_the_setting(aws_env: None) -> None:
    with pytest.raises(ConfigurationError, match="part_size"):
        S3ObjectStore(region=REGION, part_size=MIN_PART_SIZE - 1)
    with pytest.raises(ConfigurationError, match="multipart_threshold"):
        S3ObjectStore(region=REGION, multipart_threshold=0)
    with pytest.raises(ConfigurationError, match="region"):
        S3ObjectStore(region="")


# --- through an endpoint URL (moto's threaded server) -------------------------------


@pytest.fixture
def moto_server(aws_env: None) -> Iterator[str]:
    """moto's threaded server on a free loopback port (what a rehearsal's
    separate processes talk to); its URL."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


async def test_minter_and_store_work_through_an_endpoint_url(moto_server: str) -> None:
    iam = boto3.client("iam", region_name=REGION, endpoint_url=moto_server)
    arn = iam.create_role(
        RoleName="trace-task-role", AssumeRolePolicyDocument=json.dumps(sts_tests.TRUST)
    )["Role"]["Arn"]
    admin = boto3.client("s3", region_name=REGION, endpoint_url=moto_server)
    admin.create_bucket(Bucket=DATA)
    minter = StsCredentialMinter(arn, region=REGION, endpoint_url=moto_server)
    minted = await minter.mint(SCOPE, session_name="task-abc-1", duration_seconds=900)
    store = S3ObjectStore(region=REGION, endpoint_url=moto_server)
    handle = store.handle_for(wire(minted))
    handle.put(OUTPUT + "part-0", b"over http")
    assert handle.list(OUTPUT) == [OUTPUT + "part-0"]
    assert (
        admin.get_object(Bucket=DATA, Key="tenants/t1/datasets/revenue/v12/part-0")["Body"].read()
        == b"over http"
    )


# --- real AWS ------------------------------------------------------------------------


@pytest.mark.skipif(
    not sts_tests.INTEGRATION,
    reason="real-AWS test: set TRACE_AWS_INTEGRATION=1 with credentials, "
    "TRACE_AWS_ROLE_ARN and TRACE_AWS_BUCKET to run it",
)
async def test_real_aws_store_denials_are_access_denied() -> None:
    """Without a client-side scope the store relies on IAM alone: what the
    session policy denies surfaces as AccessDenied, what it grants works."""
    bucket = os.environ["TRACE_AWS_BUCKET"]
    region = os.environ.get("AWS_REGION", os.environ.get("AWS_DEFAULT_REGION", REGION))
    run = uuid.uuid4().hex
    base = f"s3://{bucket}/trace-it/{run}"
    scope = Scope.from_capability([f"{base}/t1/in/"], f"{base}/t1/out/", f"{base}/t1/s/")
    minter = StsCredentialMinter(os.environ["TRACE_AWS_ROLE_ARN"], region=region)
    minted = await minter.mint(scope, session_name=f"trace-it-{run[:20]}", duration_seconds=900)
    handle = S3ObjectStore(region=region).handle_for(wire(minted))
    admin = boto3.client("s3", region_name=region)
    try:
        handle.put(f"{base}/t1/out/part-0", b"\x02" * BIG)  # multipart under the policy
        assert handle.list(f"{base}/t1/out/") == [f"{base}/t1/out/part-0"]
        with pytest.raises(AccessDenied):
            handle.put(f"{base}/t2/out/part-0", b"no")
        with pytest.raises(AccessDenied):
            handle.get(f"{base}/t1/out/part-0")  # write does not imply read
        with pytest.raises(AccessDenied):
            handle.list(f"s3://{bucket}/trace-it/")
    finally:
        admin.delete_object(Bucket=bucket, Key=f"trace-it/{run}/t1/out/part-0")
