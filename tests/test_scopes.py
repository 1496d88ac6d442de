"""Scope canonicalization: every accepted form and its canonical result, every rule's rejection."""

from __future__ import annotations

import pytest

from trace_core.errors import ConfigurationError, InvalidInput
from trace_core.security.scopes import InvalidScope, S3Prefix, Scope, parse_object_uri

# (input, canonical form)
ACCEPTED = [
    ("s3://trace-data/t1/orders", "s3://trace-data/t1/orders/"),
    ("s3://trace-data/t1/orders/", "s3://trace-data/t1/orders/"),
    ("s3://trace-data/t1", "s3://trace-data/t1/"),
    ("s3://abc/x", "s3://abc/x/"),
    ("s3://" + "a" * 63 + "/x/", "s3://" + "a" * 63 + "/x/"),
    ("s3://my.bucket-1/a/b/c", "s3://my.bucket-1/a/b/c/"),
    (
        "s3://trace-data/t1/ds=orders/date=2026-01-01/",
        "s3://trace-data/t1/ds=orders/date=2026-01-01/",
    ),
    ("s3://trace-data/t1/v1.2/.x/", "s3://trace-data/t1/v1.2/.x/"),
    ("s3://trace-data/t1/with space/", "s3://trace-data/t1/with space/"),
    ("s3://trace-data/t1/$folder/", "s3://trace-data/t1/$folder/"),
    ("s3://trace-data/données/", "s3://trace-data/données/"),
    ("s3://1.2.3/x", "s3://1.2.3/x/"),  # three numeric labels are not an IPv4 address
    ("s3://trace-data/" + "a" * 1023, "s3://trace-data/" + "a" * 1023 + "/"),  # 1024 bytes
]

# (input, rule, substring of the message)
REJECTED = [
    # scheme
    ("https://trace-data/t1/", "scheme", "scheme must be 's3'"),
    ("s3a://trace-data/t1/", "scheme", "'s3a'"),
    ("S3://trace-data/t1/", "scheme", "'S3'"),
    ("trace-data/t1/", "scheme", "(none)"),
    ("s3:/trace-data/t1/", "scheme", "scheme"),
    ("", "scheme", "scheme"),
    # bucket
    ("s3:///t1/", "empty-bucket", "bucket must be non-empty"),
    ("s3://", "empty-bucket", "bucket must be non-empty"),
    ("s3://Trace-Data/t1/", "bucket-name", "lowercase"),
    ("s3://ab/t1/", "bucket-name", "3-63"),
    ("s3://" + "a" * 64 + "/t1/", "bucket-name", "3-63"),
    ("s3://-trace/t1/", "bucket-name", "starting and ending"),
    ("s3://trace./t1/", "bucket-name", "starting and ending"),
    ("s3://trace_data/t1/", "bucket-name", "lowercase"),
    ("s3://trace..data/t1/", "bucket-name", "'..'"),
    ("s3://user@trace-data/t1/", "bucket-name", "lowercase"),
    ("s3://trace-data:443/t1/", "bucket-name", "lowercase"),
    ("s3://192.168.10.1/t1/", "bucket-ip", "IP address"),
    ("s3://10.0.0.1/t1/", "bucket-ip", "IP address"),
    ("s3://xn--trace/t1/", "bucket-reserved", "reserved"),
    ("s3://trace-s3alias/t1/", "bucket-reserved", "reserved"),
    ("s3://trace--x-s3/t1/", "bucket-reserved", "reserved"),
    ("s3://trace-*/t1/", "wildcard", "wildcards"),
    # empty prefix: a whole bucket is never granted
    ("s3://trace-data", "empty-prefix", "prefix must be non-empty"),
    ("s3://trace-data/", "empty-prefix", "prefix must be non-empty"),
    # traversal
    ("s3://trace-data/t1/../t2/", "dot-dot", "'..'"),
    ("s3://trace-data/../t2/", "dot-dot", "'..'"),
    ("s3://trace-data/t1/..", "dot-dot", "'..'"),
    # The spec forbids '..' anywhere, not only as a whole segment.
    ("s3://trace-data/t1/a..b/", "dot-dot", "'..'"),
    ("s3://trace-data/t1/...x/", "dot-dot", "'..'"),
    ("s3://trace-data/t1/%2e%2e/t2/", "percent-encoding", "%2e%2e"),
    ("s3://trace-data/t1/%2E%2E/t2/", "percent-encoding", "'%'"),
    ("s3://trace-data/t1%2ft2/", "percent-encoding", "'%'"),
    ("s3://trace-data/t1/%252e%252e/", "percent-encoding", "'%'"),
    ("s3://trace-data/t1\\..\\t2/", "backslash", "must not contain '\\'"),
    ("s3://trace-data/t1\\t2/", "backslash", "must not contain '\\'"),
    ("s3://trace-data/t1/./t2/", "dot-segment", "'.' segment"),
    ("s3://trace-data/./", "dot-segment", "'.' segment"),
    ("s3://trace-data/t1/\uff0e\uff0e/t2/", "unicode-normalization", "NFKC"),
    ("s3://trace-data/t1/\u2024\u2024/", "unicode-normalization", "NFKC"),
    # empty segments
    ("s3://trace-data/t1//t2/", "empty-segment", "'a//b'"),
    ("s3://trace-data//t1/", "empty-segment", "'a//b'"),
    ("s3://trace-data/t1//", "empty-segment", "'a//b'"),
    ("s3://trace-data///", "empty-segment", "'a//b'"),
    # wildcard widening
    ("s3://trace-data/t1*", "wildcard", "wildcards '*' and '?'"),
    ("s3://trace-data/t1/*", "wildcard", "wildcards"),
    ("s3://trace-data/*/", "wildcard", "wildcards"),
    ("s3://trace-data/t?/", "wildcard", "wildcards"),
    ("s3://trace-data/t1/?x=1", "wildcard", "wildcards"),
    # control and invisible characters
    ("s3://trace-data/t1\x00/", "control-character", "control characters"),
    ("s3://trace-data/t1\n/", "control-character", "control characters"),
    ("s3://trace-data/t1\x7f/", "control-character", "control characters"),
    ("s3://trace-data/t1\u202e/", "control-character", "control characters"),
    ("s3://trace-data/t1\u200b/", "control-character", "control characters"),
    # IAM would substitute a policy variable
    ("s3://trace-data/${aws:username}/", "policy-variable", "IAM variable"),
    # S3's key length
    ("s3://trace-data/" + "a" * 1024, "too-long", "1024 bytes"),
    ("s3://trace-data/" + "é" * 512, "too-long", "1024 bytes"),
]


@pytest.mark.parametrize(("text", "canonical"), ACCEPTED)
def test_accepted_forms_normalize_to_one_canonical_prefix(text: str, canonical: str) -> None:
    parsed = S3Prefix.parse(text, field="inputs[0]")
    assert parsed.uri == canonical == str(parsed)
    assert parsed.prefix.endswith("/")
    # Canonicalization is idempotent and the canonical text parses strictly.
    assert S3Prefix.parse(parsed.uri) == parsed
    assert S3Prefix.parse_canonical(canonical) == parsed


@pytest.mark.parametrize(("text", "rule", "message"), REJECTED)
def test_rejected_forms_name_field_and_rule(text: str, rule: str, message: str) -> None:
    with pytest.raises(InvalidScope) as caught:
        S3Prefix.parse(text, field="output_prefix")
    error = caught.value
    assert error.field == "output_prefix"
    assert error.rule == rule
    assert str(error).startswith("output_prefix: ")
    assert f"rule: {rule}" in str(error)
    assert message in str(error)


def test_invalid_scope_is_a_trace_input_error() -> None:
    with pytest.raises(InvalidInput):
        S3Prefix.parse("s3://trace-data/../x")
    assert issubclass(InvalidScope, ConfigurationError)
    assert issubclass(InvalidScope, ValueError)


def test_non_string_is_rejected() -> None:
    with pytest.raises(InvalidScope, match=r"rule: type"):
        S3Prefix.parse(b"s3://trace-data/t1/")


def test_error_echo_is_bounded_and_inert() -> None:
    with pytest.raises(InvalidScope) as caught:
        S3Prefix.parse("s3://trace-data/" + "*" * 5000)
    assert len(str(caught.value)) < 300
    with pytest.raises(InvalidScope) as caught:
        S3Prefix.parse("s3://trace-data/a\nb/")
    assert "\n" not in str(caught.value)


def test_trailing_slash_makes_the_same_scope() -> None:
    assert S3Prefix.parse("s3://trace-data/t1/a") == S3Prefix.parse("s3://trace-data/t1/a/")
    assert S3Prefix.parse("s3://trace-data/t1") != S3Prefix.parse("s3://trace-data/t10")


def test_parse_canonical_refuses_the_unfinished_form() -> None:
    with pytest.raises(
        InvalidScope, match=r"written as 's3://trace-data/t1/' \(rule: not-canonical"
    ):
        S3Prefix.parse_canonical("s3://trace-data/t1", field="scope.read[0]")


def test_a_remembered_canonical_prefix_leaves_every_refusal_as_it_was() -> None:
    # parse_canonical remembers the prefixes it accepted: the canonical text
    # answers the same value, every other text is still parsed and refused
    # with its own field.
    first = S3Prefix.parse_canonical("s3://trace-data/remembered/")
    assert S3Prefix.parse_canonical("s3://trace-data/remembered/") == first
    with pytest.raises(InvalidScope, match=r"rule: not-canonical") as caught:
        S3Prefix.parse_canonical("s3://trace-data/remembered", field="output_prefixes[1]")
    assert caught.value.field == "output_prefixes[1]"
    for bad in ("s3://trace-data/remembered/../x/", "s3://trace-data//remembered/", 7, None):
        with pytest.raises(InvalidScope):
            S3Prefix.parse_canonical(bad, field="scratch_prefix")


def test_covers_respects_directories() -> None:
    t1 = S3Prefix.parse("s3://trace-data/t1/")
    assert t1.covers(S3Prefix.parse("s3://trace-data/t1/x/"))
    assert t1.covers(t1)
    assert not t1.covers(S3Prefix.parse("s3://trace-data/t10/"))
    assert not t1.covers(S3Prefix.parse("s3://trace-other/t1/"))


def test_from_capability_reads_inputs_and_scratch_writes_output_and_scratch() -> None:
    scope = Scope.from_capability(
        ["s3://trace-data/t1/orders/v3", "s3://trace-data/t1/customers/v7/"],
        "s3://trace-data/t1/report/v2",
        "s3://trace-scratch/t1/task-1/1",
    )
    assert scope.as_dict() == {
        "read": [
            "s3://trace-data/t1/customers/v7/",
            "s3://trace-data/t1/orders/v3/",
            "s3://trace-scratch/t1/task-1/1/",
        ],
        "write": ["s3://trace-data/t1/report/v2/", "s3://trace-scratch/t1/task-1/1/"],
    }
    assert scope.buckets() == ("trace-data", "trace-scratch")
    assert Scope.from_dict(scope.as_dict()) == scope


@pytest.mark.parametrize(
    ("inputs", "output", "scratch", "field"),
    [
        (
            ["s3://trace-data/t1/a/", "s3://trace-data/../b"],
            "s3://d-b/o",
            "s3://d-b/s",
            "inputs[1]",
        ),
        (["s3://trace-data/t1/a/"], "s3://trace-data/o*", "s3://d-b/s", "output_prefix"),
        (["s3://trace-data/t1/a/"], "s3://trace-data/o", "s3://trace-data", "scratch_prefix"),
    ],
)
def test_from_capability_errors_name_the_field(
    inputs: list[str], output: str, scratch: str, field: str
) -> None:
    with pytest.raises(InvalidScope) as caught:
        Scope.from_capability(inputs, output, scratch)
    assert caught.value.field == field


def test_from_capability_refuses_a_lone_string() -> None:
    with pytest.raises(InvalidScope, match=r"^inputs: .*rule: type"):
        Scope.from_capability("s3://trace-data/t1/a/", "s3://trace-data/o", "s3://trace-data/s")


def test_scope_is_canonical_sorted_deduplicated_and_minimal() -> None:
    p = S3Prefix.parse
    scope = Scope(
        read=(p("s3://trace-data/t1/b"), p("s3://trace-data/t1/"), p("s3://trace-data/t10/")),
        write=(p("s3://trace-data/t1/o"), p("s3://trace-data/t1/o/")),
    )
    # t1/b/ is inside t1/ (same grant); t10/ is not inside t1/.
    assert scope.as_dict() == {
        "read": ["s3://trace-data/t1/", "s3://trace-data/t10/"],
        "write": ["s3://trace-data/t1/o/"],
    }
    assert scope == Scope(read=tuple(reversed(scope.read)), write=scope.write)


def test_empty_scope_is_refused() -> None:
    with pytest.raises(InvalidScope, match=r"rule: empty-scope"):
        Scope()


def test_scope_requires_parsed_prefixes() -> None:
    with pytest.raises(InvalidScope, match=r"^read: .*rule: type"):
        Scope(read=("s3://trace-data/t1/",))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"read": ["s3://trace-data/t1"]}, "scope.read[0]"),
        ({"read": "s3://trace-data/t1/"}, "scope.read"),
        ({"read": [], "admin": True}, "scope"),
        (["s3://trace-data/t1/"], "scope"),
    ],
)
def test_from_dict_is_strict(data: object, field: str) -> None:
    with pytest.raises(InvalidScope) as caught:
        Scope.from_dict(data)
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("s3://trace-data/t1/a.parquet", ("trace-data", "t1/a.parquet")),
        ("s3://trace-data/t1/dir/", ("trace-data", "t1/dir/")),
        ("s3://trace-data/t1", ("trace-data", "t1")),
    ],
)
def test_object_uri_accepts_keys(text: str, expected: tuple[str, str]) -> None:
    assert parse_object_uri(text) == expected


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        ("s3://trace-data/t1/../t2/x", "dot-dot"),
        ("s3://trace-data/t1//x", "empty-segment"),
        ("s3://trace-data/t1/%2e%2e/x", "percent-encoding"),
        ("s3://trace-data/t1\\x", "backslash"),
        ("s3://trace-data/", "empty-key"),
        ("s3://Trace/x", "bucket-name"),
        ("file:///etc/passwd", "scheme"),
    ],
)
def test_object_uri_uses_the_prefix_rules(text: str, rule: str) -> None:
    with pytest.raises(InvalidScope) as caught:
        parse_object_uri(text)
    assert caught.value.rule == rule


def test_object_uri_may_allow_an_empty_list_prefix() -> None:
    assert parse_object_uri("s3://trace-data/", allow_empty=True) == ("trace-data", "")
