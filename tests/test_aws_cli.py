"""``trace-aws``: its settings; ``serve`` and ``worker`` as processes on moto and Postgres."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trace_aws.settings import SERVE_REQUIRED, WORKER_REQUIRED, AwsSettings, load_settings
from trace_core.errors import ConfigurationError

TOKEN = "internal-token-for-tests-0123456789"
SERVE_ENV = {
    "TRACE_AWS_REGION": "us-east-1",
    "TRACE_AWS_SIGNING_KEY": "alias/trace-signing",
    "TRACE_AWS_ROLE_ARN": "arn:aws:iam::123456789012:role/trace-task",
    "TRACE_DATABASE_URL": "postgresql+psycopg://trace:secret-pw@localhost/trace",
    "TRACE_INTERNAL_TOKEN": TOKEN,
}


def write(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    os.chmod(path, mode)
    return path


def test_serve_settings_from_the_environment_are_typed() -> None:
    env = {
        **SERVE_ENV,
        "TRACE_AWS_ENDPOINT_URL": "http://127.0.0.1:5000",
        "TRACE_AWS_QUEUE_URLS": "trace-ecs-platform=http://q/1, trace-ecs-udf=http://q/2",
        "TRACE_BIND": "0.0.0.0:8081",
        "TRACE_AWS_BUCKET": "trace-data",
    }
    settings = load_settings(env, required=SERVE_REQUIRED)
    assert settings.region == "us-east-1"
    assert settings.endpoint_url == "http://127.0.0.1:5000"
    assert settings.queue_urls == {
        "trace-ecs-platform": "http://q/1",
        "trace-ecs-udf": "http://q/2",
    }
    assert (settings.host, settings.port) == ("0.0.0.0", 8081)
    assert settings.bucket == "trace-data"
    assert settings.internal_token == TOKEN
    assert TOKEN not in repr(settings)


@pytest.mark.parametrize("missing", SERVE_REQUIRED)
def test_a_missing_setting_is_named(missing: str) -> None:
    env = {k: v for k, v in SERVE_ENV.items() if k != missing}
    with pytest.raises(ConfigurationError, match=f"^{missing}: missing"):
        load_settings(env, required=SERVE_REQUIRED)


def test_the_worker_needs_its_queue_and_the_api() -> None:
    with pytest.raises(ConfigurationError, match="TRACE_AWS_WORKER_QUEUE: missing"):
        load_settings({"TRACE_AWS_REGION": "us-east-1"}, required=WORKER_REQUIRED)


@pytest.mark.parametrize(
    ("name", "value", "reason"),
    [
        ("TRACE_AWS_REGION", "Europe", "not an AWS region"),
        ("TRACE_AWS_ENDPOINT_URL", "localhost:5000", "not a URL"),
        ("TRACE_AWS_QUEUE_URLS", "trace-ecs-platform", "is not name=url"),
        ("TRACE_AWS_ROLE_ARN", "trace-task", "not an IAM role ARN"),
        ("TRACE_AWS_SIGNING_KEY", "key with spaces", "not a KMS key"),
        ("TRACE_AWS_BUCKET", "Not_A_Bucket", "not an S3 bucket name"),
        ("TRACE_DATABASE_URL", "sqlite:///x.db", "runs on Postgres"),
        ("TRACE_INTERNAL_TOKEN", "short", ""),
        ("TRACE_BIND", "8000", "not host:port"),
    ],
)
def test_a_wrong_setting_is_named_with_the_reason(name: str, value: str, reason: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        load_settings({**SERVE_ENV, name: value}, required=SERVE_REQUIRED)
    message = str(caught.value)
    assert message.startswith(f"{name} (environment {name}): ")
    assert reason in message


def test_a_database_url_is_never_echoed() -> None:
    url = "mysql://trace:secret-pw@db/trace"
    with pytest.raises(ConfigurationError) as caught:
        load_settings({**SERVE_ENV, "TRACE_DATABASE_URL": url}, required=SERVE_REQUIRED)
    assert "secret-pw" not in str(caught.value)


def test_settings_from_a_file_and_the_environment_wins(tmp_path: Path) -> None:
    file = write(
        tmp_path / "trace.env",
        "# the fleet's settings\n\n"
        + "".join(f"{k}={v}\n" for k, v in SERVE_ENV.items())
        + 'TRACE_AWS_BUCKET="trace-data"\n',
    )
    settings = load_settings({"TRACE_AWS_REGION": "eu-west-1"}, file, required=SERVE_REQUIRED)
    assert settings.region == "eu-west-1"
    assert settings.bucket == "trace-data"
    assert settings.role_arn == SERVE_ENV["TRACE_AWS_ROLE_ARN"]


def test_a_wrong_setting_in_a_file_names_the_file_and_line(tmp_path: Path) -> None:
    file = write(tmp_path / "trace.env", "# comment\nTRACE_AWS_REGION=us-east-1\nTRACE_BIND=nope\n")
    with pytest.raises(ConfigurationError, match=f"^TRACE_BIND \\({file}:3\\): 'nope' is not"):
        load_settings({}, file)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("TRACE_AWS_REGION\n", ":1: expected NAME=value"),
        ("TRACE_REGION=us-east-1\n", ":1: unknown setting 'TRACE_REGION'"),
        (
            "TRACE_AWS_REGION=us-east-1\nTRACE_AWS_REGION=eu-west-1\n",
            ":2: TRACE_AWS_REGION is set twice",
        ),
    ],
    ids=["no-equals", "unknown", "twice"],
)
def test_a_malformed_file_names_the_line(tmp_path: Path, text: str, reason: str) -> None:
    file = write(tmp_path / "trace.env", text)
    with pytest.raises(ConfigurationError, match=f"^{file}{reason}"):
        load_settings({}, file)


def test_a_token_in_a_file_others_can_read_is_refused(tmp_path: Path) -> None:
    file = write(tmp_path / "trace.env", f"TRACE_INTERNAL_TOKEN={TOKEN}\n", mode=0o644)
    with pytest.raises(ConfigurationError, match="chmod 600") as caught:
        load_settings({"TRACE_AWS_REGION": "us-east-1"}, file)
    assert TOKEN not in str(caught.value)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"settings file .*absent\.env: No such file"):
        load_settings({}, tmp_path / "absent.env")


def test_the_defaults() -> None:
    settings = load_settings({"TRACE_AWS_REGION": "us-east-1"})
    assert settings == AwsSettings(region="us-east-1")
    assert (settings.host, settings.port) == ("127.0.0.1", 8000)
