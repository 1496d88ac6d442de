"""Session policies: golden files, the evaluator as oracle (hypothesis), size and duration
limits, and the local credential minter that enforces the same policy in the lite profile.

moto does not enforce session policies, so correctness is pinned here: the
exact policy text (golden files) and its meaning (the evaluator, checked
against a plain ``startswith`` model of S3 prefixes).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_core.clock import ManualClock
from trace_core.errors import ConfigurationError, InvalidInput
from trace_core.security.minting import (
    CredentialMinter,
    LocalCredentialMinter,
    MintedCredentials,
    validate_session_name,
)
from trace_core.security.policy import (
    MAX_PACKED_POLICY_CHARS,
    PolicyEvaluator,
    PolicyTooLarge,
    UnsupportedPolicy,
    bucket_arn,
    dump_policy,
    object_arn,
    packed_policy,
    session_policy,
    validate_duration_seconds,
)
from trace_core.security.scopes import S3Prefix, Scope

GOLDEN = Path(__file__).parent / "golden"
OBJECT_ACTIONS = ("s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload")

REALISTIC = Scope.from_capability(
    [
        "s3://trace-data-prod/tenants/t1/datasets/orders/v3/",
        "s3://trace-data-prod/tenants/t1/datasets/customers/v7",
        "s3://trace-shared-ref/calendars/v2/",
    ],
    "s3://trace-data-prod/tenants/t1/datasets/daily_revenue/v12/",
    "s3://trace-scratch/tenants/t1/tasks/0192c7e2-task/attempt-1/",
)
READ_ONLY = Scope(read=(S3Prefix.parse("s3://trace-data-prod/tenants/t1/"),))


# --- golden files ------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "scope"),
    [("session_policy_realistic", REALISTIC), ("session_policy_read_only", READ_ONLY)],
)
def test_policy_matches_golden_file(name: str, scope: Scope) -> None:
    pretty = json.dumps(session_policy(scope), indent=2) + "\n"
    path = GOLDEN / f"{name}.json"
    if os.environ.get("TRACE_UPDATE_GOLDEN") == "1":
        path.write_text(pretty)
    assert pretty == path.read_text()
    # The text sent to STS is the golden policy, compacted.
    assert packed_policy(scope) == dump_policy(json.loads(path.read_text()))


def test_policy_is_deterministic_whatever_the_input_order() -> None:
    reordered = Scope(read=tuple(reversed(REALISTIC.read)), write=tuple(reversed(REALISTIC.write)))
    assert packed_policy(reordered) == packed_policy(REALISTIC)


def test_packed_policy_is_compact_ascii() -> None:
    scope = Scope(read=(S3Prefix.parse("s3://trace-data/données/"),))
    text = packed_policy(scope)
    assert text.isascii() and " " not in text and "\\u00e9" in text
    assert PolicyEvaluator(json.loads(text)).allows(
        "s3:GetObject", object_arn("trace-data", "données/x")
    )


# --- evaluator semantics on the realistic scope -------------------------------


def test_realistic_scope_grants_exactly_what_the_task_needs() -> None:
    ev = PolicyEvaluator(session_policy(REALISTIC))
    orders = "tenants/t1/datasets/orders/v3/part-0.parquet"
    output = "tenants/t1/datasets/daily_revenue/v12/part-0.parquet"
    scratch = "tenants/t1/tasks/0192c7e2-task/attempt-1/tmp/x"
    assert ev.allows("s3:GetObject", object_arn("trace-data-prod", orders))
    assert not ev.allows("s3:PutObject", object_arn("trace-data-prod", orders))
    assert ev.allows("s3:PutObject", object_arn("trace-data-prod", output))
    assert ev.allows("s3:AbortMultipartUpload", object_arn("trace-data-prod", output))
    # Write does not imply read: the output is not readable, scratch is.
    assert not ev.allows("s3:GetObject", object_arn("trace-data-prod", output))
    assert ev.allows("s3:GetObject", object_arn("trace-scratch", scratch))
    assert ev.allows("s3:PutObject", object_arn("trace-scratch", scratch))
    # Nothing beyond the granted actions.
    for action in ("s3:DeleteObject", "s3:*", "s3:GetObjectAcl", "s3:PutObjectAcl", "iam:PassRole"):
        assert not ev.allows(action, object_arn("trace-data-prod", output))
    # Wrong bucket, same key.
    assert not ev.allows("s3:GetObject", object_arn("trace-data-dev", orders))
    assert not ev.allows("s3:GetObject", object_arn("trace-scratch", orders))
    # The directory itself as a prefix sibling: v3 must not grant v30 or v3-old.
    assert not ev.allows(
        "s3:GetObject", object_arn("trace-data-prod", orders.replace("v3/", "v30/"))
    )
    assert not ev.allows(
        "s3:GetObject", object_arn("trace-data-prod", "tenants/t1/datasets/orders/v3")
    )


def test_list_bucket_requires_an_allowed_prefix() -> None:
    ev = PolicyEvaluator(session_policy(REALISTIC))
    arn = bucket_arn("trace-data-prod")
    assert ev.allows("s3:ListBucket", arn, s3_prefix="tenants/t1/datasets/orders/v3/")
    assert ev.allows("s3:ListBucket", arn, s3_prefix="tenants/t1/datasets/orders/v3/part-")
    assert ev.allows("s3:ListBucket", arn, s3_prefix="tenants/t1/datasets/daily_revenue/v12/")
    assert not ev.allows("s3:ListBucket", arn)  # whole bucket
    assert not ev.allows("s3:ListBucket", arn, s3_prefix="")
    assert not ev.allows("s3:ListBucket", arn, s3_prefix="tenants/t1/datasets/orders/v3")
    assert not ev.allows("s3:ListBucket", arn, s3_prefix="tenants/t1/")
    assert not ev.allows("s3:ListBucket", bucket_arn("trace-data-dev"), s3_prefix="tenants/t1/")
    # A prefix granted on one bucket is not listable on another.
    assert not ev.allows(
        "s3:ListBucket", bucket_arn("trace-scratch"), s3_prefix="tenants/t1/datasets/orders/v3/"
    )
    # ListBucket is a bucket action: an object ARN never matches it.
    assert not ev.allows(
        "s3:ListBucket",
        object_arn("trace-data-prod", "tenants/t1/datasets/orders/v3/x"),
        s3_prefix="tenants/t1/datasets/orders/v3/",
    )


def test_t1_never_matches_t10_or_t1_other() -> None:
    scope = Scope(
        read=(S3Prefix.parse("s3://trace-data/t1"),), write=(S3Prefix.parse("s3://trace-data/t1"),)
    )
    ev = PolicyEvaluator(session_policy(scope))
    for key in ("t10/x", "t1-other/x", "t1", "t1.x", "t1x/y", "t/1/x", "T1/x"):
        for action in OBJECT_ACTIONS:
            assert not ev.allows(action, object_arn("trace-data", key)), (action, key)
        assert not ev.allows("s3:ListBucket", bucket_arn("trace-data"), s3_prefix=key)
    assert ev.allows("s3:GetObject", object_arn("trace-data", "t1/x"))


# --- the evaluator itself -----------------------------------------------------


def _policy(*statements: dict[str, Any]) -> dict[str, Any]:
    return {"Version": "2012-10-17", "Statement": list(statements)}


def test_evaluator_globs_and_deny() -> None:
    ev = PolicyEvaluator(
        _policy(
            {"Effect": "Allow", "Action": "s3:Get*", "Resource": "arn:aws:s3:::b/a?c/*"},
            {"Effect": "Deny", "Action": ["s3:GetObject"], "Resource": ["arn:aws:s3:::b/abc/x*"]},
        )
    )
    assert ev.allows("s3:GetObject", "arn:aws:s3:::b/abc/deep/er/key")  # '*' crosses '/'
    assert ev.allows("S3:getobject", "arn:aws:s3:::b/a/c/k")  # actions are case-insensitive
    assert not ev.allows("s3:GetObject", "arn:aws:s3:::b/ac/k")  # '?' is exactly one char
    assert not ev.allows("s3:GetObject", "arn:aws:s3:::B/abc/k")  # resources are case-sensitive
    assert not ev.allows("s3:GetObject", "arn:aws:s3:::b/abc/xyz")  # explicit deny wins
    assert not ev.allows("s3:PutObject", "arn:aws:s3:::b/abc/k")  # deny by default


def test_evaluator_conditions_and_single_statement_form() -> None:
    ev = PolicyEvaluator(
        {
            "Version": "2012-10-17",
            "Statement": {
                "Effect": "Allow",
                "Action": "s3:ListBucket",
                "Resource": "arn:aws:s3:::b",
                "Condition": {"StringLike": {"s3:prefix": ["a/*", "b/?/*"]}},
            },
        }
    )
    assert ev.allows("s3:ListBucket", "arn:aws:s3:::b", s3_prefix="a/")
    assert ev.allows("s3:ListBucket", "arn:aws:s3:::b", s3_prefix="b/1/x")
    assert not ev.allows("s3:ListBucket", "arn:aws:s3:::b", s3_prefix="b/12/x")
    assert not ev.allows("s3:ListBucket", "arn:aws:s3:::b")


@pytest.mark.parametrize(
    "policy",
    [
        _policy({"Effect": "Allow", "NotAction": "s3:*", "Resource": "*"}),
        _policy({"Effect": "Allow", "Action": "s3:*", "NotResource": "*"}),
        _policy({"Effect": "Allow", "Action": "s3:*", "Resource": "*", "Principal": "*"}),
        _policy({"Effect": "Maybe", "Action": "s3:*", "Resource": "*"}),
        _policy({"Effect": "Allow", "Action": [], "Resource": "*"}),
        _policy(
            {"Effect": "Allow", "Action": "s3:*", "Resource": "arn:aws:s3:::b/${aws:userid}/*"}
        ),
        _policy(
            {
                "Effect": "Allow",
                "Action": "s3:*",
                "Resource": "*",
                "Condition": {"StringEquals": {"s3:prefix": "a/"}},
            }
        ),
        _policy(
            {
                "Effect": "Allow",
                "Action": "s3:*",
                "Resource": "*",
                "Condition": {"StringLike": {"aws:SourceIp": "1.2.3.4"}},
            }
        ),
        {"Version": "2008-10-17", "Statement": []},
        {"Version": "2012-10-17", "Statement": "x"},
    ],
)
def test_evaluator_refuses_what_it_does_not_implement(policy: dict[str, Any]) -> None:
    with pytest.raises(UnsupportedPolicy):
        PolicyEvaluator(policy)


# --- hypothesis: the evaluator against a startswith model of S3 ---------------

# A tiny alphabet makes collisions (t1 vs t10, shared prefixes) frequent.
SEGMENT = st.text(alphabet="t10-.x_", min_size=1, max_size=4).filter(
    lambda s: ".." not in s and s != "."
)
PATH = st.lists(SEGMENT, min_size=1, max_size=3).map(lambda parts: "/".join(parts) + "/")
BUCKET = st.sampled_from(["trace-data", "trace-data-2", "trace-scratch"])
PREFIX = st.builds(lambda b, p: S3Prefix.parse(f"s3://{b}/{p}"), BUCKET, PATH)
# Keys are raw S3 text (S3 matches them literally), including IAM wildcard characters.
RAW_KEY = st.text(alphabet="t10-./*?x", max_size=12)


@st.composite
def keys_near(draw: st.DrawFn, prefixes: list[S3Prefix]) -> tuple[str, str]:
    """A (bucket, key) that is under, beside or unrelated to one of ``prefixes``."""
    base = draw(st.sampled_from(prefixes))
    bucket = draw(st.one_of(st.just(base.bucket), BUCKET))
    stem = draw(st.sampled_from([base.prefix, base.prefix[:-1], base.prefix[:-2], ""]))
    return bucket, stem + draw(RAW_KEY)


def _under(prefixes: tuple[S3Prefix, ...], bucket: str, key: str) -> bool:
    return any(p.bucket == bucket and key.startswith(p.prefix) for p in prefixes)


@settings(max_examples=300, deadline=None)
@given(
    tenant_a=SEGMENT,
    tenant_b=SEGMENT,
    rest_a=st.lists(PATH, min_size=3, max_size=3),
    rest_b=PATH,
    suffix=RAW_KEY,
    bucket=BUCKET,
)
def test_tenant_a_never_reaches_tenant_b(
    tenant_a: str, tenant_b: str, rest_a: list[str], rest_b: str, suffix: str, bucket: str
) -> None:
    """(a) A's policy allows nothing under B's tenant root, whatever the two names share."""
    if tenant_a == tenant_b:
        return
    a = [f"s3://{bucket}/{tenant_a}/{rest}" for rest in rest_a]
    ev = PolicyEvaluator(session_policy(Scope.from_capability(a[:1], a[1], a[2])))
    b_key = f"{tenant_b}/{rest_b}{suffix}"
    for action in OBJECT_ACTIONS:
        assert not ev.allows(action, object_arn(bucket, b_key))
    assert not ev.allows("s3:ListBucket", bucket_arn(bucket), s3_prefix=f"{tenant_b}/{rest_b}")
    assert not ev.allows("s3:ListBucket", bucket_arn(bucket), s3_prefix=f"{tenant_b}/")


@settings(max_examples=300, deadline=None)
@given(a=PREFIX, b=PREFIX, suffix=RAW_KEY)
def test_prefix_a_reaches_b_only_if_b_is_inside_a(a: S3Prefix, b: S3Prefix, suffix: str) -> None:
    """(a) For any two prefixes: a key under B is allowed by A only when it is also under A."""
    ev = PolicyEvaluator(session_policy(Scope(read=(a,), write=(a,))))
    key = b.prefix + suffix
    inside = b.bucket == a.bucket and b.prefix.startswith(a.prefix)
    for action in OBJECT_ACTIONS:
        allowed = ev.allows(action, object_arn(b.bucket, key))
        assert allowed == (a.bucket == b.bucket and key.startswith(a.prefix))
        if inside:
            assert allowed  # everything under B is reachable when B is inside A


@settings(max_examples=200, deadline=None)
@given(rest=st.lists(SEGMENT, max_size=3), sibling=st.sampled_from(["t10", "t1-other", "t1x"]))
def test_t1_never_matches_a_sibling_directory(rest: list[str], sibling: str) -> None:
    """(b) ``t1/`` grants nothing under ``t10/`` or ``t1-other/``, at any depth."""
    t1 = S3Prefix.parse("s3://trace-data/t1/")
    ev = PolicyEvaluator(session_policy(Scope(read=(t1,), write=(t1,))))
    key = "/".join([sibling, *rest])
    for action in OBJECT_ACTIONS:
        assert not ev.allows(action, object_arn("trace-data", key))
    assert not ev.allows("s3:ListBucket", bucket_arn("trace-data"), s3_prefix=key)


@settings(max_examples=400, deadline=None)
@given(
    data=st.data(),
    reads=st.lists(PREFIX, min_size=1, max_size=4),
    writes=st.lists(PREFIX, max_size=3),
)
def test_read_and_write_are_exactly_the_keys_under_their_prefixes(
    data: st.DataObject, reads: list[S3Prefix], writes: list[S3Prefix]
) -> None:
    """(c) Every key under a read prefix is readable and nothing else is; same for writes."""
    scope = Scope(read=tuple(reads), write=tuple(writes))
    ev = PolicyEvaluator(session_policy(scope))
    for _ in range(5):
        bucket, key = data.draw(keys_near(reads + writes))
        arn = object_arn(bucket, key)
        assert ev.allows("s3:GetObject", arn) == _under(tuple(reads), bucket, key)
        assert ev.allows("s3:PutObject", arn) == _under(tuple(writes), bucket, key)
        assert ev.allows("s3:AbortMultipartUpload", arn) == _under(tuple(writes), bucket, key)
        assert not ev.allows("s3:DeleteObject", arn)


@settings(max_examples=400, deadline=None)
@given(
    data=st.data(),
    reads=st.lists(PREFIX, min_size=1, max_size=4),
    writes=st.lists(PREFIX, max_size=3),
)
def test_list_bucket_only_with_an_allowed_prefix(
    data: st.DataObject, reads: list[S3Prefix], writes: list[S3Prefix]
) -> None:
    """(d) ListBucket is allowed iff the request's s3:prefix lies under a granted prefix."""
    granted = tuple(reads + writes)
    ev = PolicyEvaluator(session_policy(Scope(read=tuple(reads), write=tuple(writes))))
    for _ in range(5):
        bucket, list_prefix = data.draw(keys_near(reads + writes))
        arn = bucket_arn(bucket)
        assert ev.allows("s3:ListBucket", arn, s3_prefix=list_prefix) == _under(
            granted, bucket, list_prefix
        )
        assert not ev.allows("s3:ListBucket", arn)
        # Never on an object ARN, whatever the prefix.
        assert not ev.allows(
            "s3:ListBucket", object_arn(bucket, list_prefix), s3_prefix=list_prefix
        )


@settings(max_examples=200, deadline=None)
@given(reads=st.lists(PREFIX, min_size=1, max_size=6), writes=st.lists(PREFIX, max_size=3))
def test_policy_text_round_trips_and_stays_deterministic(
    reads: list[S3Prefix], writes: list[S3Prefix]
) -> None:
    scope = Scope(read=tuple(reads), write=tuple(writes))
    text = packed_policy(scope)
    assert json.loads(text) == session_policy(scope)
    assert packed_policy(Scope(read=tuple(reversed(reads)), write=tuple(writes))) == text


# --- limits -------------------------------------------------------------------


def _read_scope(count: int, bucket: str = "trace-data-prod-0001", length: int = 40) -> Scope:
    # `length` counts the trailing '/', as the cost formula in packed_policy does.
    prefixes = [f"s3://{bucket}/{i:04d}" + "p" * (length - 5) + "/" for i in range(count)]
    return Scope(read=tuple(S3Prefix.parse(p) for p in prefixes))


def test_packed_size_limit_and_how_many_prefixes_fit() -> None:
    # One 20-character bucket, 40-character prefixes: 14 fit, the 15th does not.
    assert len("trace-data-prod-0001") == 20
    fits = packed_policy(_read_scope(14))
    assert len(fits) <= MAX_PACKED_POLICY_CHARS
    for count in (15, 16):
        with pytest.raises(PolicyTooLarge) as caught:
            packed_policy(_read_scope(count))
        error = caught.value
        assert isinstance(error, InvalidInput) and error.field == "scope"
        assert error.length > MAX_PACKED_POLICY_CHARS and error.fit == 14
        message = str(error)
        assert "2048" in message and f"{count} prefixes on 1 bucket(s)" in message
        assert "about 14 fit" in message and "rule: policy-size" in message


def test_packed_costs_in_the_docstring_hold() -> None:
    per_prefix = 20 + 2 * 40 + 22
    one = len(packed_policy(_read_scope(1)))
    assert len(packed_policy(_read_scope(2))) - one == per_prefix
    assert one - per_prefix == 214 + 20
    second_bucket = Scope(read=_read_scope(1).read + _read_scope(1, "trace-data-prod-0002").read)
    assert len(packed_policy(second_bucket)) - one == per_prefix + 118 + 20
    scratch = Scope(read=_read_scope(1).read, write=_read_scope(1).read)
    assert len(packed_policy(scratch)) - one == (20 + 40 + 18) + 84


@pytest.mark.parametrize("seconds", [900, 3600, 43200])
def test_duration_in_range(seconds: int) -> None:
    assert validate_duration_seconds(seconds) == seconds


@pytest.mark.parametrize("seconds", [0, 899, 43201, -1, True, 900.0, "900", None])
def test_duration_out_of_range_or_not_an_int(seconds: object) -> None:
    with pytest.raises(InvalidInput) as caught:
        validate_duration_seconds(seconds)
    assert caught.value.field == "duration_seconds"


# --- the local credential minter ----------------------------------------------


def _scope(tenant: str) -> Scope:
    return Scope.from_capability(
        [f"s3://trace-data/{tenant}/in/"],
        f"s3://trace-data/{tenant}/out/",
        f"s3://trace-scratch/{tenant}/s/",
    )


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def minter(clock: ManualClock) -> LocalCredentialMinter:
    return LocalCredentialMinter(b"k" * 32, clock=clock)


async def _mint(
    minter: CredentialMinter, tenant: str = "t1", duration: int = 900
) -> MintedCredentials:
    return await minter.mint(
        _scope(tenant), session_name=f"task-{tenant}", duration_seconds=duration
    )


@pytest.mark.anyio
async def test_local_credentials_allow_exactly_the_scope(minter: LocalCredentialMinter) -> None:
    creds = await _mint(minter)
    assert creds.scope == _scope("t1")
    assert minter.check(creds, "read", "s3://trace-data/t1/in/part-0")
    assert minter.check(creds, "read", "s3://trace-scratch/t1/s/tmp")
    assert minter.check(creds, "write", "s3://trace-data/t1/out/part-0")
    assert minter.check(creds, "write", "s3://trace-scratch/t1/s/tmp")
    assert minter.check(creds, "list", "s3://trace-data/t1/in/")
    assert minter.check(creds, "list", "s3://trace-data/t1/out/part-")
    assert not minter.check(creds, "read", "s3://trace-data/t1/out/part-0")  # write-only
    assert not minter.check(creds, "write", "s3://trace-data/t1/in/part-0")  # read-only
    assert not minter.check(creds, "list", "s3://trace-data/")
    assert not minter.check(creds, "list", "s3://trace-data/t1/in")
    assert not minter.check(creds, "read", "s3://trace-other/t1/in/part-0")
    # Keys the canonical rules refuse are denied even if they "start with" the prefix.
    assert not minter.check(creds, "read", "s3://trace-data/t1/in/../../t2/in/x")
    assert not minter.check(creds, "read", "s3://trace-data/t1/in/%2e%2e/x")
    assert not minter.check(creds, "write", "s3://trace-data/t1/out//x")
    assert not minter.check(creds, "write", "s3://trace-data/t1/out/a\\..\\x")
    assert not minter.check(creds, "read", "trace-data/t1/in/x")
    assert not minter.check(creds, "list", "s3://trace-data/t1/in/..")


@pytest.mark.anyio
@pytest.mark.parametrize("other", ["t2", "t10", "t1-other"])
async def test_token_for_a_fails_for_b(minter: LocalCredentialMinter, other: str) -> None:
    creds = await _mint(minter, "t1")
    for action, uri in [
        ("read", f"s3://trace-data/{other}/in/x"),
        ("read", f"s3://trace-scratch/{other}/s/x"),
        ("write", f"s3://trace-data/{other}/out/x"),
        ("list", f"s3://trace-data/{other}/in/"),
    ]:
        assert not minter.check(creds, action, uri)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_expired_credentials_fail(minter: LocalCredentialMinter, clock: ManualClock) -> None:
    creds = await _mint(minter, duration=900)
    assert (creds.expiration - clock.now()).total_seconds() == 900
    clock.advance(899.5)
    assert minter.check(creds, "read", "s3://trace-data/t1/in/x")
    clock.advance(0.5)
    assert not minter.check(creds, "read", "s3://trace-data/t1/in/x")
    assert not minter.check(creds, "write", "s3://trace-data/t1/out/x")


def _resign_payload(creds: MintedCredentials, edit: dict[str, Any]) -> MintedCredentials:
    """Rewrite the token payload but keep the old MAC (what an attacker can do)."""
    import base64

    version, body, mac = creds.session_token.split(".")
    payload = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    payload.update(edit)
    new_body = base64.urlsafe_b64encode(json.dumps(payload).encode()).rstrip(b"=").decode()
    return dataclasses.replace(creds, session_token=f"{version}.{new_body}.{mac}")


@pytest.mark.anyio
async def test_tampered_credentials_fail(minter: LocalCredentialMinter, clock: ManualClock) -> None:
    creds = await _mint(minter, "t1")
    other = await _mint(minter, "t2")
    target = "s3://trace-data/t2/in/x"
    assert minter.check(other, "read", target)
    wider = {"scope": {"read": ["s3://trace-data/t2/"], "write": []}}
    forged = [
        _resign_payload(creds, wider),
        _resign_payload(creds, {"exp": 2**40}),
        dataclasses.replace(creds, session_token=creds.session_token[:-2] + "AA"),
        dataclasses.replace(creds, session_token=creds.session_token + "."),
        dataclasses.replace(creds, session_token="tl2" + creds.session_token[3:]),
        dataclasses.replace(creds, session_token="garbage"),
        dataclasses.replace(creds, session_token="tl1.\udc80.x"),
        # Mixing parts of two genuine credentials.
        dataclasses.replace(creds, session_token=other.session_token),
        dataclasses.replace(other, secret_access_key=creds.secret_access_key),
        dataclasses.replace(other, access_key_id=creds.access_key_id),
        dataclasses.replace(other, secret_access_key="\ud800"),
        # The dataclass's scope is not what is enforced; a mismatch is refused.
        dataclasses.replace(other, scope=_scope("t1")),
    ]
    for bad in forged:
        assert not minter.check(bad, "read", target), bad
        assert not minter.check(bad, "read", "s3://trace-data/t1/in/x"), bad
    # Another minter's key does not verify.
    stranger = LocalCredentialMinter(b"s" * 32, clock=clock)
    assert not stranger.check(other, "read", target)
    assert not minter.check("not credentials", "read", target)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_repr_and_logs_hide_secrets(
    minter: LocalCredentialMinter, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="trace_core.security"):
        creds = await _mint(minter)
    shown = repr(creds) + str(creds) + repr(minter) + caplog.text
    assert creds.secret_access_key not in shown
    assert creds.session_token not in shown
    assert creds.session_token.split(".")[1] not in shown
    assert "<redacted>" in repr(creds) and creds.access_key_id in repr(creds)
    assert creds.access_key_id in caplog.text  # the audit line names the key id only
    assert "k" * 32 not in repr(minter)


@pytest.mark.anyio
async def test_mint_validates_before_issuing(minter: LocalCredentialMinter) -> None:
    with pytest.raises(InvalidInput, match="duration_seconds"):
        await _mint(minter, duration=43201)
    with pytest.raises(InvalidInput, match="duration_seconds"):
        await _mint(minter, duration=899)
    with pytest.raises(InvalidInput, match="session_name"):
        await minter.mint(_scope("t1"), session_name="has space", duration_seconds=900)
    with pytest.raises(PolicyTooLarge):
        await minter.mint(_read_scope(15), session_name="task-1", duration_seconds=900)


def test_check_refuses_an_unknown_action(minter: LocalCredentialMinter) -> None:
    creds = MintedCredentials("a", "b", "c", ManualClock().now(), _scope("t1"))
    with pytest.raises(InvalidInput, match="action"):
        minter.check(creds, "delete", "s3://trace-data/t1/in/x")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["ab", "task-1_attempt.2@x=y,z+w", "a" * 64])
def test_session_names_sts_accepts(name: str) -> None:
    assert validate_session_name(name) == name


@pytest.mark.parametrize("name", ["a", "a" * 65, "task 1", "task/1", "tâche", "", None])
def test_session_names_sts_refuses(name: object) -> None:
    with pytest.raises(InvalidInput, match="session_name"):
        validate_session_name(name)


def test_minter_key_must_be_long_enough() -> None:
    with pytest.raises(ConfigurationError, match="32 bytes"):
        LocalCredentialMinter(b"short")


@pytest.mark.anyio
async def test_default_key_is_random_per_minter(clock: ManualClock) -> None:
    first, second = LocalCredentialMinter(clock=clock), LocalCredentialMinter(clock=clock)
    creds = await _mint(first)
    assert first.check(creds, "read", "s3://trace-data/t1/in/x")
    assert not second.check(creds, "read", "s3://trace-data/t1/in/x")


# --- restoring wire credentials: MAC first, then a strict parse (issue 14, section 4) ---


def _wire(creds: MintedCredentials, **edit: object) -> dict[str, object]:
    values: dict[str, object] = {
        "access_key_id": creds.access_key_id,
        "secret_access_key": creds.secret_access_key,
        "session_token": creds.session_token,
        "expiration": creds.expiration.isoformat(),
    }
    values.update(edit)
    return values


def _body(doc: object) -> str:
    import base64

    text = doc if isinstance(doc, str) else json.dumps(doc)
    return base64.urlsafe_b64encode(text.encode()).rstrip(b"=").decode()


_NESTED = "[" * 100_000 + "]" * 100_000


@pytest.mark.anyio
async def test_restore_round_trips_genuine_credentials(minter: LocalCredentialMinter) -> None:
    creds = await _mint(minter)
    restored = minter.restore(_wire(creds))  # type: ignore[arg-type]
    assert restored.scope == creds.scope and restored.expiration == creds.expiration
    assert minter.check(restored, "read", "s3://trace-data/t1/in/x")


@pytest.mark.anyio
@pytest.mark.parametrize(
    "payload",
    [
        '{"exp": 1e400, "akid": "A", "scope": "S"}',
        _NESTED,
        '{"exp": 99999999999999999999999, "akid": "A", "scope": "S"}',
        '{"exp": -99999999999999999999999, "akid": "A", "scope": "S"}',
        '{"exp": 1.5, "akid": "A", "scope": "S"}',
        '{"exp": true, "akid": "A", "scope": "S"}',
        '{"exp": 1, "akid": 7, "scope": "S"}',
        '{"exp": 1, "akid": "A", "scope": ' + _NESTED + "}",
        "[]",
        "not json",
    ],
    ids=[
        "exp-1e400",
        "nested",
        "exp-huge",
        "exp-huge-negative",
        "exp-float",
        "exp-bool",
        "akid-int",
        "nested-scope",
        "list",
        "text",
    ],
)
async def test_restore_refuses_crafted_bodies_forged_or_authentic(
    minter: LocalCredentialMinter, payload: str
) -> None:
    """A forged body is refused by its MAC before it is parsed; even an
    authentic (correctly signed) body of the wrong shape is InvalidInput."""
    creds = await _mint(minter)
    version, _, mac = creds.session_token.split(".")
    # A genuine scope, so that only the crafted value can be what is refused.
    body = _body(payload.replace('"S"', json.dumps(creds.scope.as_dict())))
    for token in (f"{version}.{body}.{mac}", f"{version}.{body}.{minter._token_mac(body)}"):
        with pytest.raises(InvalidInput) as info:
            minter.restore(_wire(creds, session_token=token))  # type: ignore[arg-type]
        assert info.value.field.startswith("credentials")
        assert creds.secret_access_key not in str(info.value)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({}, "credentials.access_key_id"),
        ({"access_key_id": 1}, "credentials.access_key_id"),
        ({"secret_access_key": None}, "credentials.secret_access_key"),
        ({"session_token": ["x"]}, "credentials.session_token"),
        ({"session_token": "tl1.\udc80.x"}, "credentials.session_token"),
        ({"secret_access_key": "\ud800"}, "credentials"),
    ],
)
async def test_restore_names_the_malformed_field(
    minter: LocalCredentialMinter, values: dict[str, object], field: str
) -> None:
    creds = await _mint(minter)
    wire = {} if not values else _wire(creds, **values)
    with pytest.raises(InvalidInput) as info:
        minter.restore(wire)  # type: ignore[arg-type]
    assert info.value.field == field
    with pytest.raises(InvalidInput):
        minter.restore("not a mapping")  # type: ignore[arg-type]


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=12,
)
_SCOPES = st.just({"read": ["s3://trace-data/t1/in/"], "write": []}) | _JSON
_EXPIRIES = (
    st.integers()
    | st.floats()
    | st.sampled_from([10**400, -(10**400), 2**63, 253402300800, float("inf")])
    | _JSON
)
_PAYLOADS = st.one_of(
    _JSON,
    st.fixed_dictionaries(
        {"akid": _JSON | st.text(), "exp": _EXPIRIES, "scope": _SCOPES},
        optional={"v": _JSON, "sn": _JSON, "iat": _JSON},
    ),
)
_VALUES = st.one_of(
    st.none(), st.integers(), st.text(), st.binary(), st.lists(st.text(), max_size=2)
)


@settings(max_examples=300, deadline=None)
@given(
    payload=_PAYLOADS,
    signed=st.booleans(),
    raw_token=st.none() | st.text(),
    akid=_VALUES,
    secret=_VALUES,
)
def test_restore_raises_nothing_but_invalid_input(
    payload: object, signed: bool, raw_token: str | None, akid: object, secret: object
) -> None:
    """Whatever the wire values (forged bodies, authentic bodies of any shape,
    arbitrary strings and types), restore answers credentials or InvalidInput."""
    minter = LocalCredentialMinter(b"k" * 32, clock=ManualClock())
    body = _body(payload)
    token = raw_token
    if token is None:
        mac = minter._token_mac(body) if signed else _body("not the mac")
        token = f"tl1.{body}.{mac}"
    values = {"access_key_id": akid, "secret_access_key": secret, "session_token": token}
    try:
        restored = minter.restore(values)  # type: ignore[arg-type]
    except InvalidInput:
        return
    # Accepted: only with this minter's MAC and the secret of its access key.
    assert signed and raw_token is None
    assert restored.secret_access_key == minter._secret_for(restored.access_key_id)
