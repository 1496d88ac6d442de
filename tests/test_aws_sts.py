"""The STS credential minter against moto, with the session policy it sends evaluated.

moto does not enforce session policies: credentials from ``AssumeRole`` with
any ``Policy`` can do whatever the moto backend allows. So the policy
document actually passed to ``AssumeRole`` is captured from the minter's
own client (a botocore ``provide-client-params`` hook) and decided with the
in-repository :class:`~trace_core.security.policy.PolicyEvaluator` against
adversarial keys: neighbouring prefixes, ``..``, other buckets, other
tenants. The real-AWS test (the one ``dispatcher.md`` requires: minted
credentials cannot read or write outside their scope) runs only with
``TRACE_AWS_INTEGRATION=1``.

Throttling and expired caller credentials cannot be produced by moto; their
error mapping is tested with botocore's Stubber, and only that.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.stub import Stubber
from moto import mock_aws

from trace_aws.errors import AwsRequestFailed, AwsUnavailable
from trace_aws.sts import StsCredentialMinter
from trace_core.errors import ConfigurationError, InvalidInput
from trace_core.security.minting import CredentialMinter, scope_allows
from trace_core.security.policy import (
    PolicyEvaluator,
    PolicyTooLarge,
    bucket_arn,
    object_arn,
    packed_policy,
)
from trace_core.security.scopes import S3Prefix, Scope

pytestmark = pytest.mark.anyio

REGION = "us-east-1"
ROLE_NAME = "trace-task-role"
TRUST = {
    "Version": "2012-10-17",
    "Statement": [
        {"Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "sts:AssumeRole"},
    ],
}
SCOPE = Scope.from_capability(
    ["s3://trace-data/tenants/t1/datasets/orders/v3/"],
    "s3://trace-data/tenants/t1/datasets/revenue/v12/",
    "s3://trace-scratch/tenants/t1/tasks/abc/1/",
)
SESSION = "task-0192c7e2a1b24c3d8e9f00112233aabb-1"


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake credentials and region: no test may reach real AWS by accident."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)


@pytest.fixture
def mocked(aws_env: None) -> Iterator[None]:
    with mock_aws():
        yield


@pytest.fixture
def role_arn(mocked: None) -> str:
    iam = boto3.client("iam", region_name=REGION)
    role = iam.create_role(RoleName=ROLE_NAME, AssumeRolePolicyDocument=json.dumps(TRUST))
    arn: str = role["Role"]["Arn"]
    return arn


class Captured:
    """The AssumeRole parameters the minter's client actually sent."""

    def __init__(self, minter: StsCredentialMinter) -> None:
        self.calls: list[dict[str, Any]] = []
        minter.client.meta.events.register("provide-client-params.sts.AssumeRole", self._record)

    def _record(self, params: dict[str, Any], **_: Any) -> None:
        self.calls.append(dict(params))

    @property
    def policy(self) -> dict[str, Any]:
        assert len(self.calls) == 1
        parsed: dict[str, Any] = json.loads(self.calls[0]["Policy"])
        return parsed


@pytest.fixture
def minter(role_arn: str) -> StsCredentialMinter:
    return StsCredentialMinter(role_arn, region=REGION)


async def test_mint_sends_the_packed_session_policy_name_and_duration(
    minter: StsCredentialMinter,
) -> None:
    captured = Captured(minter)
    port: CredentialMinter = minter
    before = datetime.now(UTC)
    minted = await port.mint(SCOPE, session_name=SESSION, duration_seconds=1800)
    call = captured.calls[0]
    assert call["RoleArn"] == minter.role_arn
    assert call["RoleSessionName"] == SESSION
    assert call["DurationSeconds"] == 1800
    assert call["Policy"] == packed_policy(SCOPE)
    assert minted.scope == SCOPE
    assert minted.expiration.tzinfo is not None
    # moto sets Expiration to now + DurationSeconds.
    delta = minted.expiration - before
    assert timedelta(seconds=1790) <= delta <= timedelta(seconds=1810)
    assert minted.access_key_id and minted.secret_access_key and minted.session_token


async def test_minted_credentials_open_an_s3_handle(minter: StsCredentialMinter) -> None:
    s3 = boto3.client("s3", region_name=REGION)
    s3.create_bucket(Bucket="trace-data")
    minted = await minter.mint(SCOPE, session_name=SESSION, duration_seconds=900)
    task_s3 = boto3.client(
        "s3",
        region_name=REGION,
        aws_access_key_id=minted.access_key_id,
        aws_secret_access_key=minted.secret_access_key,
        aws_session_token=minted.session_token,
    )
    key = "tenants/t1/datasets/revenue/v12/part-0.parquet"
    task_s3.put_object(Bucket="trace-data", Key=key, Body=b"rows")
    assert s3.get_object(Bucket="trace-data", Key=key)["Body"].read() == b"rows"


# --- the captured policy, decided by the evaluator ----------------------------

ALLOWED = [
    ("s3:GetObject", "trace-data", "tenants/t1/datasets/orders/v3/part-0.parquet"),
    ("s3:GetObject", "trace-data", "tenants/t1/datasets/orders/v3/a/b/c"),
    ("s3:PutObject", "trace-data", "tenants/t1/datasets/revenue/v12/part-0.parquet"),
    ("s3:AbortMultipartUpload", "trace-data", "tenants/t1/datasets/revenue/v12/x"),
    ("s3:GetObject", "trace-scratch", "tenants/t1/tasks/abc/1/tmp"),
    ("s3:PutObject", "trace-scratch", "tenants/t1/tasks/abc/1/tmp"),
]
DENIED = [
    # neighbouring prefixes: the same text without the directory slash
    ("s3:GetObject", "trace-data", "tenants/t1/datasets/orders/v30/part-0.parquet"),
    ("s3:GetObject", "trace-data", "tenants/t1/datasets/orders/v3-old/part-0.parquet"),
    ("s3:GetObject", "trace-data", "tenants/t1/datasets/orders/v3"),
    ("s3:PutObject", "trace-data", "tenants/t1/datasets/revenue/v120/part-0.parquet"),
    ("s3:PutObject", "trace-scratch", "tenants/t1/tasks/abc/10/tmp"),
    # the prefix itself is not an object under it
    ("s3:PutObject", "trace-data", "tenants/t1/datasets/revenue/v12/"[:-1]),
    # parents and siblings
    ("s3:GetObject", "trace-data", "tenants/t1/datasets/customers/v1/part-0.parquet"),
    ("s3:GetObject", "trace-data", "tenants/t1/secrets.json"),
    # other tenants
    ("s3:GetObject", "trace-data", "tenants/t10/datasets/orders/v3/part-0.parquet"),
    ("s3:GetObject", "trace-data", "tenants/t2/datasets/orders/v3/part-0.parquet"),
    ("s3:PutObject", "trace-data", "tenants/t2/datasets/revenue/v12/part-0.parquet"),
    # other buckets, including look-alike names
    ("s3:GetObject", "trace-data-prod", "tenants/t1/datasets/orders/v3/part-0.parquet"),
    ("s3:GetObject", "trace-dat", "tenants/t1/datasets/orders/v3/part-0.parquet"),
    ("s3:PutObject", "other-bucket", "tenants/t1/datasets/revenue/v12/part-0.parquet"),
    # write does not imply read; read does not imply write
    ("s3:GetObject", "trace-data", "tenants/t1/datasets/revenue/v12/part-0.parquet"),
    ("s3:PutObject", "trace-data", "tenants/t1/datasets/orders/v3/part-0.parquet"),
    # actions never granted
    ("s3:DeleteObject", "trace-data", "tenants/t1/datasets/revenue/v12/part-0.parquet"),
    ("s3:DeleteObject", "trace-scratch", "tenants/t1/tasks/abc/1/tmp"),
    ("s3:PutObjectAcl", "trace-data", "tenants/t1/datasets/revenue/v12/part-0.parquet"),
    ("s3:GetObjectAcl", "trace-data", "tenants/t1/datasets/orders/v3/part-0.parquet"),
]


async def test_captured_policy_grants_exactly_the_scope(minter: StsCredentialMinter) -> None:
    captured = Captured(minter)
    await minter.mint(SCOPE, session_name=SESSION, duration_seconds=900)
    evaluator = PolicyEvaluator(captured.policy)
    for action, bucket, key in ALLOWED:
        assert evaluator.allows(action, object_arn(bucket, key)), (action, bucket, key)
    for action, bucket, key in DENIED:
        assert not evaluator.allows(action, object_arn(bucket, key)), (action, bucket, key)


@pytest.mark.parametrize(
    "key",
    [
        "tenants/t1/datasets/orders/../../t2/datasets/orders/v3/x",
        "tenants/t2/../t1/datasets/orders/v3/x",
        "../tenants/t1/datasets/orders/v3/x",
        "tenants/t1//datasets/orders/v3/x",
        "tenants/t1/datasets/orders/./v3/x",
    ],
)
async def test_dot_dot_keys_outside_the_prefix_are_denied(
    minter: StsCredentialMinter, key: str
) -> None:
    captured = Captured(minter)
    await minter.mint(SCOPE, session_name=SESSION, duration_seconds=900)
    evaluator = PolicyEvaluator(captured.policy)
    assert not evaluator.allows("s3:GetObject", object_arn("trace-data", key))
    assert not evaluator.allows("s3:PutObject", object_arn("trace-data", key))
    assert not scope_allows(SCOPE, "read", f"s3://trace-data/{key}")


async def test_dot_dot_below_the_prefix_is_refused_by_the_store_check(
    minter: StsCredentialMinter,
) -> None:
    """IAM matches ARNs as text and S3 keys are literal, so the policy allows
    a key that starts inside the prefix whatever follows (``v3/../../t2``):
    on S3 that is an object of that literal name inside the prefix. A client
    that normalized the path would reach another object, which is why every
    store refuses such keys before sending (:func:`scope_allows`)."""
    captured = Captured(minter)
    await minter.mint(SCOPE, session_name=SESSION, duration_seconds=900)
    key = "tenants/t1/datasets/orders/v3/../../../../t2/secret"
    assert PolicyEvaluator(captured.policy).allows("s3:GetObject", object_arn("trace-data", key))
    assert not scope_allows(SCOPE, "read", f"s3://trace-data/{key}")
    assert scope_allows(SCOPE, "read", "s3://trace-data/tenants/t1/datasets/orders/v3/ok")


async def test_captured_policy_lists_only_under_the_prefixes(minter: StsCredentialMinter) -> None:
    captured = Captured(minter)
    await minter.mint(SCOPE, session_name=SESSION, duration_seconds=900)
    evaluator = PolicyEvaluator(captured.policy)
    data = bucket_arn("trace-data")
    assert evaluator.allows("s3:ListBucket", data, s3_prefix="tenants/t1/datasets/orders/v3/")
    assert evaluator.allows("s3:ListBucket", data, s3_prefix="tenants/t1/datasets/revenue/v12/p")
    for prefix in (None, "", "tenants/", "tenants/t1/", "tenants/t1/datasets/orders/v3"):
        assert not evaluator.allows("s3:ListBucket", data, s3_prefix=prefix), prefix
    assert not evaluator.allows(
        "s3:ListBucket", bucket_arn("other"), s3_prefix="tenants/t1/datasets/orders/v3/"
    )


async def test_tenants_never_reach_each_other(minter: StsCredentialMinter) -> None:
    """Tenant A's minted policy never matches a key of tenant B's, and vice versa."""
    captured = Captured(minter)
    tenants = ["t1", "t10", "t1-other", "t2"]
    for tenant in tenants:
        scope = Scope.from_capability(
            [f"s3://trace-data/tenants/{tenant}/in/"],
            f"s3://trace-data/tenants/{tenant}/out/",
            f"s3://trace-data/tenants/{tenant}/scratch/",
        )
        await minter.mint(scope, session_name=f"task-{tenant}-1", duration_seconds=900)
    policies = {
        t: PolicyEvaluator(json.loads(c["Policy"]))
        for t, c in zip(tenants, captured.calls, strict=True)
    }
    for owner, evaluator in policies.items():
        for other in tenants:
            for sub in ("in", "out", "scratch"):
                key = f"tenants/{other}/{sub}/part-0"
                allowed = evaluator.allows(
                    "s3:GetObject", object_arn("trace-data", key)
                ) or evaluator.allows("s3:PutObject", object_arn("trace-data", key))
                assert allowed == (owner == other), (owner, key)


# --- refused before any request --------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"session_name": SESSION, "duration_seconds": 899}, "duration_seconds"),
        ({"session_name": SESSION, "duration_seconds": 43201}, "duration_seconds"),
        ({"session_name": SESSION, "duration_seconds": True}, "duration_seconds"),
        ({"session_name": "x", "duration_seconds": 900}, "session_name"),
        ({"session_name": "task/1", "duration_seconds": 900}, "session_name"),
        ({"session_name": "t" * 65, "duration_seconds": 900}, "session_name"),
    ],
)
async def test_invalid_arguments_are_refused_before_any_request(
    minter: StsCredentialMinter, kwargs: dict[str, Any], field: str
) -> None:
    captured = Captured(minter)
    with pytest.raises(InvalidInput) as info:
        await minter.mint(SCOPE, **kwargs)
    assert info.value.field == field
    assert captured.calls == []


async def test_oversized_policy_is_refused_before_any_request(
    minter: StsCredentialMinter,
) -> None:
    captured = Captured(minter)
    wide = Scope(read=tuple(S3Prefix.parse(f"s3://trace-data/{'p' * 40}{i}/") for i in range(40)))
    with pytest.raises(PolicyTooLarge):
        await minter.mint(wide, session_name=SESSION, duration_seconds=900)
    assert captured.calls == []


async def test_not_a_scope_is_refused(minter: StsCredentialMinter) -> None:
    with pytest.raises(InvalidInput) as info:
        await minter.mint(SCOPE.as_dict(), session_name=SESSION, duration_seconds=900)  # type: ignore[arg-type]
    assert info.value.field == "scope"


def test_bad_configuration_names_the_setting(aws_env: None) -> None:
    with pytest.raises(ConfigurationError, match="role_arn"):
        StsCredentialMinter("trace-task-role", region=REGION)
    with pytest.raises(ConfigurationError, match="region"):
        StsCredentialMinter("arn:aws:iam::123456789012:role/r", region="")


# --- AWS failures -----------------------------------------------------------------


def _stubbed(aws_env: None) -> tuple[StsCredentialMinter, Stubber]:
    client = boto3.client("sts", region_name=REGION, config=Config(retries={"max_attempts": 1}))
    minter = StsCredentialMinter("arn:aws:iam::123456789012:role/r", region=REGION, client=client)
    return minter, Stubber(client)


@pytest.mark.parametrize(
    ("code", "status", "expected"),
    [
        # Stubber: moto never throttles, never sees expired caller credentials,
        # and does not check that the role exists or trusts the caller.
        ("Throttling", 400, AwsUnavailable),
        ("ServiceUnavailable", 503, AwsUnavailable),
        ("ExpiredToken", 400, AwsRequestFailed),
        ("AccessDenied", 403, AwsRequestFailed),
        ("RegionDisabledException", 403, AwsRequestFailed),
    ],
)
async def test_aws_errors_become_trace_errors_without_secrets(
    aws_env: None,
    caplog: pytest.LogCaptureFixture,
    code: str,
    status: int,
    expected: type[Exception],
) -> None:
    minter, stubber = _stubbed(aws_env)
    secret_echo = "the-session-token-value-AQoDYXdzEJr"
    stubber.add_client_error(
        "assume_role",
        service_error_code=code,
        service_message=f"echoes {secret_echo}",
        http_status_code=status,
    )
    caplog.set_level(logging.DEBUG)
    with stubber, pytest.raises(expected) as info:
        await minter.mint(SCOPE, session_name=SESSION, duration_seconds=900)
    message = str(info.value)
    assert "sts:AssumeRole" in message and code in message
    assert secret_echo not in message
    assert info.value.__cause__ is None and info.value.__suppress_context__


async def test_unreachable_endpoint_is_transient(aws_env: None) -> None:
    # Port 9 (discard) on loopback: nothing listens, the connection is refused.
    client = boto3.client(
        "sts",
        region_name=REGION,
        endpoint_url="http://127.0.0.1:9",
        config=Config(retries={"max_attempts": 1}, connect_timeout=1),
    )
    minter = StsCredentialMinter("arn:aws:iam::123456789012:role/r", region=REGION, client=client)
    with pytest.raises(AwsUnavailable, match="sts:AssumeRole"):
        await minter.mint(SCOPE, session_name=SESSION, duration_seconds=900)


async def test_secrets_never_reach_logs_or_repr(
    minter: StsCredentialMinter, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="trace_aws")
    minted = await minter.mint(SCOPE, session_name=SESSION, duration_seconds=900)
    text = caplog.text + repr(minted) + repr(minter)
    assert minted.access_key_id in caplog.text  # the log line is there ...
    assert minted.secret_access_key not in text  # ... without the secrets
    assert minted.session_token not in text


# --- real AWS ---------------------------------------------------------------------

INTEGRATION = os.environ.get("TRACE_AWS_INTEGRATION") == "1"


@pytest.mark.skipif(
    not INTEGRATION,
    reason="real-AWS test: set TRACE_AWS_INTEGRATION=1 with credentials, "
    "TRACE_AWS_ROLE_ARN and TRACE_AWS_BUCKET to run it",
)
async def test_real_aws_minted_credentials_stay_inside_their_scope() -> None:
    """dispatcher.md: minted credentials cannot read or write outside their scope."""
    role_arn = os.environ["TRACE_AWS_ROLE_ARN"]
    bucket = os.environ["TRACE_AWS_BUCKET"]
    region = os.environ.get("AWS_REGION", os.environ.get("AWS_DEFAULT_REGION", REGION))
    run = uuid.uuid4().hex
    base = f"trace-it/{run}"
    scope = Scope.from_capability(
        [f"s3://{bucket}/{base}/t1/in/"],
        f"s3://{bucket}/{base}/t1/out/",
        f"s3://{bucket}/{base}/t1/s/",
    )
    admin = boto3.client("s3", region_name=region)
    admin.put_object(Bucket=bucket, Key=f"{base}/t1/in/x", Body=b"in")
    admin.put_object(Bucket=bucket, Key=f"{base}/t2/in/x", Body=b"other tenant")
    minted = await StsCredentialMinter(role_arn, region=region).mint(
        scope, session_name=f"trace-it-{run[:20]}", duration_seconds=900
    )
    task = boto3.client(
        "s3",
        region_name=region,
        aws_access_key_id=minted.access_key_id,
        aws_secret_access_key=minted.secret_access_key,
        aws_session_token=minted.session_token,
    )
    from botocore.exceptions import ClientError

    try:
        assert task.get_object(Bucket=bucket, Key=f"{base}/t1/in/x")["Body"].read() == b"in"
        task.put_object(Bucket=bucket, Key=f"{base}/t1/out/y", Body=b"out")
        for call in (
            lambda: task.get_object(Bucket=bucket, Key=f"{base}/t2/in/x"),
            lambda: task.get_object(Bucket=bucket, Key=f"{base}/t1/in0/x"),
            lambda: task.put_object(Bucket=bucket, Key=f"{base}/t1/in/z", Body=b"no"),
            lambda: task.put_object(Bucket=bucket, Key=f"{base}/t2/out/y", Body=b"no"),
            lambda: task.delete_object(Bucket=bucket, Key=f"{base}/t1/out/y"),
            lambda: task.list_objects_v2(Bucket=bucket, Prefix=f"{base}/"),
        ):
            with pytest.raises(ClientError) as info:
                call()
            assert info.value.response["Error"]["Code"] == "AccessDenied"
    finally:
        for key in (f"{base}/t1/in/x", f"{base}/t2/in/x", f"{base}/t1/out/y"):
            admin.delete_object(Bucket=bucket, Key=key)
