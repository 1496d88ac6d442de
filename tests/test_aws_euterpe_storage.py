"""Euterpe's S3 object access against moto (in-process ``mock_aws``): sizes,
streaming downloads with the limit, uploads under deterministic keys, missing
objects, and 403 from S3 (moto's IAM simulation) taking the credential
refresh path, through a whole worker job on both engines."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto.core.authorization import enable_iam_authentication

import tests.euterpe_worker_fixtures as fx
import tests.test_aws_sts as sts_tests
from tests.euterpe_worker_fixtures import SOURCE, Env, RefreshEndpoint, make_env, refresher
from trace_aws.euterpe_storage import S3TranscodeStorage
from trace_aws.s3 import S3ObjectStore
from trace_core.clock import ManualClock
from trace_core.euterpe.copy_processor import CopyProcessor
from trace_core.euterpe.credentials import StorageCredentials
from trace_core.euterpe.storage_access import (
    ObjectMissing,
    SourceTooLarge,
    StorageAuthFailed,
)
from trace_core.euterpe.worker import EuterpeWorker
from trace_core.euterpe.worker_config import WorkerConfig
from trace_core.euterpe.worker_job import WorkerParts
from trace_core.retry import RetryClass, RetryPolicy
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio

REGION = sts_tests.REGION
aws_env = sts_tests.aws_env
mocked = sts_tests.mocked
serve = fx.serve
BUCKET = "media"
DATA = b"source bytes " * 100
POLICY = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
}


@pytest.fixture
def admin(mocked: None) -> Any:
    s3 = boto3.client("s3", region_name=REGION)
    s3.create_bucket(Bucket=BUCKET)
    s3.put_object(Bucket=BUCKET, Key="in/clip.mp4", Body=DATA)
    return s3


@pytest.fixture
def user_keys(admin: Any) -> StorageCredentials:
    """Long-term keys of an IAM user allowed S3 (moto checks them under IAM auth)."""
    iam = boto3.client("iam", region_name=REGION)
    iam.create_user(UserName="requester")
    iam.put_user_policy(UserName="requester", PolicyName="s3", PolicyDocument=json.dumps(POLICY))
    key = iam.create_access_key(UserName="requester")["AccessKey"]
    return StorageCredentials(key["AccessKeyId"], key["SecretAccessKey"])


@pytest.fixture
def iam_auth(user_keys: StorageCredentials) -> Iterator[None]:
    with enable_iam_authentication():
        yield


@pytest.fixture
def storage(mocked: None) -> S3TranscodeStorage:
    return S3TranscodeStorage(S3ObjectStore(region=REGION), chunk_bytes=256)


BOGUS = StorageCredentials("AKIAIOSFODNN7BOGUS00", "not-the-secret-of-any-key", "token")


async def test_size_download_and_upload(
    storage: S3TranscodeStorage, admin: Any, user_keys: StorageCredentials, tmp_path: Path
) -> None:
    handle = storage.open(user_keys)
    assert await handle.size(SOURCE) == len(DATA)
    target = tmp_path / "source"
    assert await handle.download(SOURCE, target, len(DATA)) == len(DATA)
    assert target.read_bytes() == DATA
    out = tmp_path / "out.mp4"
    for body in (b"first", b"second"):  # a retry replaces the same object
        out.write_bytes(body)
        await handle.upload(out, f"s3://{BUCKET}/out/j1/p.mp4")
    got = admin.get_object(Bucket=BUCKET, Key="out/j1/p.mp4")["Body"].read()
    assert got == b"second"
    listed = admin.list_objects_v2(Bucket=BUCKET, Prefix="out/")["Contents"]
    assert [o["Key"] for o in listed] == ["out/j1/p.mp4"]


async def test_the_limit_is_enforced_while_streaming(
    storage: S3TranscodeStorage, admin: Any, user_keys: StorageCredentials, tmp_path: Path
) -> None:
    handle = storage.open(user_keys)
    with pytest.raises(SourceTooLarge) as info:
        await handle.download(SOURCE, tmp_path / "source", len(DATA) - 1)
    assert info.value.error.code == "source_too_large" and not info.value.error.retryable


async def test_a_missing_object_is_fatal_with_its_code(
    storage: S3TranscodeStorage, admin: Any, user_keys: StorageCredentials, tmp_path: Path
) -> None:
    handle = storage.open(user_keys)
    for call in (
        lambda: handle.size(f"s3://{BUCKET}/in/none.mp4"),
        lambda: handle.download(f"s3://{BUCKET}/in/none.mp4", tmp_path / "x", 10),
    ):
        with pytest.raises(ObjectMissing) as info:
            await call()
        assert info.value.error.code == "source_not_found" and not info.value.error.retryable


async def test_403_from_s3_is_the_refresh_path(
    storage: S3TranscodeStorage, admin: Any, iam_auth: None, tmp_path: Path
) -> None:
    handle = storage.open(BOGUS)
    for call in (
        lambda: handle.size(SOURCE),
        lambda: handle.download(SOURCE, tmp_path / "s", 10**6),
        lambda: handle.upload(Path(__file__), f"s3://{BUCKET}/out/x"),
    ):
        with pytest.raises(StorageAuthFailed) as info:
            await call()
        assert info.value.http_status == 403
        assert RetryPolicy().classify(info.value.http_status) is RetryClass.CREDENTIAL_REFRESH
        assert BOGUS.secret_access_key not in str(info.value)


async def test_a_worker_job_on_s3_refreshes_refused_credentials(
    repo: SqlRepository,
    clock: ManualClock,
    tmp_path: Path,
    storage: S3TranscodeStorage,
    admin: Any,
    user_keys: StorageCredentials,
    iam_auth: None,
    serve: Any,
) -> None:
    env: Env = await make_env(repo, clock, tmp_path)

    async def fresh(job_id: Any) -> StorageCredentials:
        return user_keys

    endpoint = await serve(RefreshEndpoint(env, replace=True, credentials=fresh))
    job, prefix = await env.enqueue(refresh_url=endpoint.url)
    # the job was sealed with the lite minter's credentials, which S3 does not know: 403
    parts = WorkerParts(
        jobs=env.jobs,
        vault=env.vault,
        storage=storage,
        processor=CopyProcessor(),
        config=WorkerConfig(temp_dir=env.work_dir, heartbeat_seconds=0.05),
        refresher=refresher(),
    )
    [outcome] = await EuterpeWorker(parts, worker_id="w-s3").run_once()
    assert outcome.result == "succeeded", outcome.error
    status = await env.jobs.status(job)
    assert (status.attempt_count, status.credential_refresh_count) == (1, 1)
    key = prefix.removeprefix(f"s3://{BUCKET}/") + "mp4-h264-360p.mp4"
    reader = boto3.client(
        "s3",
        region_name=REGION,
        aws_access_key_id=user_keys.access_key_id,
        aws_secret_access_key=user_keys.secret_access_key,
    )  # under IAM auth the admin's fake keys are refused
    body = reader.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    assert status.outputs == [
        {
            "key": prefix + "mp4-h264-360p.mp4",
            "preset": "mp4-h264-360p",
            "size": len(DATA),
            "sha256": hashlib.sha256(DATA).hexdigest(),
        }
    ]
    assert body == DATA and env.leftovers() == []
