"""docs/aws.md "Deploying for real" matches the code: every setting, every AWS call.

The IAM sketches there must name each action the code uses, and the settings
table each setting: a new boto3 call or setting without its line in the
deploy docs fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import boto3
import pytest

from trace_aws.settings import SETTINGS

ROOT = Path(__file__).resolve().parent.parent


def _section(title: str) -> str:
    text = (ROOT / "docs" / "aws.md").read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _operations_called() -> dict[str, set[str]]:
    """API operation -> the ``trace_aws`` modules calling it (boto3 method names
    mapped through each client's own model; a paginator by its method)."""
    region = "us-east-1"
    clients = (
        boto3.client("kms", region_name=region),
        boto3.client("lambda", region_name=region),
        boto3.client("s3", region_name=region),
        boto3.client("sqs", region_name=region),
        boto3.client("sts", region_name=region),
    )
    methods: dict[str, str] = {}
    for client in clients:
        methods.update(client.meta.method_to_api_mapping)
    called: dict[str, set[str]] = {}
    for source in sorted((ROOT / "trace_aws").glob("*.py")):
        if source.name.startswith("rehearsal"):
            continue  # the local rehearsal creates its resources on moto, never on AWS
        text = source.read_text()
        # A boto3 client is always held as ``client``/``_client`` here, and its
        # methods are called or handed to a wrapper (``call_sqs(..., client.x)``).
        names = re.findall(r"client\.(\w+)\b", text)
        names += re.findall(r'get_paginator\("(\w+)"\)', text)
        for name in names:
            if name in methods:
                called.setdefault(methods[name], set()).add(source.name)
    return called


def test_every_aws_call_of_the_code_is_named_in_the_deploy_docs() -> None:
    deploy = _section("Deploying for real")
    called = _operations_called()
    # The scan finds the calls it must (it would otherwise prove nothing).
    assert {"Sign", "AssumeRole", "SendMessageBatch", "Invoke", "PutObject"} <= set(called)
    missing = {op: sorted(m) for op, m in called.items() if f"`{op}`" not in deploy}
    assert not missing, f"AWS calls missing from docs/aws.md 'Deploying for real': {missing}"


@pytest.mark.parametrize("name", SETTINGS)
def test_every_setting_has_a_row_in_the_settings_table(name: str) -> None:
    assert f"\n| `{name}` | " in _section("Deploying for real")


def test_the_moto_gaps_are_gathered_in_one_section() -> None:
    gaps = _section("What moto could not show")
    for gap in ("session policies", "KMS key states", "without Docker", "IAM enforcement"):
        assert gap in gaps
