"""The AWS profile's settings: one typed object read from the environment and/or a file.

Every setting has one name, used both as an environment variable and as a
line ``NAME=value`` of a settings file (``#`` starts a comment line, blank
lines are ignored, a value may be quoted with ``"`` or ``'``). The
environment wins over the file, so one file can serve a fleet while a
process overrides a value. A missing or wrong setting is a
:class:`~trace_core.errors.ConfigurationError` naming the setting, and the
file and line when it came from a file; the internal token is never quoted.

========================== ======================================================
``TRACE_AWS_REGION``       AWS region (required)
``TRACE_AWS_ENDPOINT_URL`` endpoint override for every client (moto, LocalStack)
``TRACE_AWS_QUEUE_URLS``   ``name=url,...``: the runtimes' wake-up queues
``TRACE_AWS_WORKER_QUEUE`` the queue URL ``trace-aws worker`` polls
``TRACE_AWS_BUFFER_QUEUES`` ``dataset-uuid=url,...``: buffered datasets' SQS queues
``TRACE_AWS_LAMBDA_RUNTIMES`` ``runtime=function,...``: Lambda runtimes (name or ARN)
``TRACE_AWS_LAMBDA_QUALIFIER`` alias or version invoked on every Lambda runtime
``TRACE_AWS_SIGNING_KEY``  KMS key (id, ARN or alias) that signs capability tokens
``TRACE_AWS_DATA_KEY``     KMS key for envelope encryption of stored credentials
``TRACE_AWS_ROLE_ARN``     the task role STS assumes for minted credentials
``TRACE_AWS_BUCKET``       the data bucket; the storage root is ``s3://<bucket>/``
``TRACE_DATABASE_URL``     the state database (``postgresql+psycopg://...``)
``TRACE_INTERNAL_TOKEN``   the internal API token (a file holding it must be 0600)
``TRACE_BIND``             ``host:port`` ``trace-aws serve`` listens on
``TRACE_API_URL``          the control-plane URL ``trace-aws worker`` talks to
========================== ======================================================
"""

from __future__ import annotations

import re
import stat
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

from trace_core.errors import ConfigurationError

__all__ = [
    "SERVE_REQUIRED",
    "SETTINGS",
    "WORKER_REQUIRED",
    "AwsSettings",
    "load_settings",
]

REGION: Final = "TRACE_AWS_REGION"
ENDPOINT_URL: Final = "TRACE_AWS_ENDPOINT_URL"
QUEUE_URLS: Final = "TRACE_AWS_QUEUE_URLS"
WORKER_QUEUE: Final = "TRACE_AWS_WORKER_QUEUE"
BUFFER_QUEUES: Final = "TRACE_AWS_BUFFER_QUEUES"
LAMBDA_RUNTIMES: Final = "TRACE_AWS_LAMBDA_RUNTIMES"
LAMBDA_QUALIFIER: Final = "TRACE_AWS_LAMBDA_QUALIFIER"
SIGNING_KEY: Final = "TRACE_AWS_SIGNING_KEY"
DATA_KEY: Final = "TRACE_AWS_DATA_KEY"
ROLE_ARN: Final = "TRACE_AWS_ROLE_ARN"
BUCKET: Final = "TRACE_AWS_BUCKET"
DATABASE_URL: Final = "TRACE_DATABASE_URL"
INTERNAL_TOKEN: Final = "TRACE_INTERNAL_TOKEN"
BIND: Final = "TRACE_BIND"
API_URL: Final = "TRACE_API_URL"

SETTINGS: Final = (
    REGION,
    ENDPOINT_URL,
    QUEUE_URLS,
    WORKER_QUEUE,
    BUFFER_QUEUES,
    LAMBDA_RUNTIMES,
    LAMBDA_QUALIFIER,
    SIGNING_KEY,
    DATA_KEY,
    ROLE_ARN,
    BUCKET,
    DATABASE_URL,
    INTERNAL_TOKEN,
    BIND,
    API_URL,
)
SERVE_REQUIRED: Final = (REGION, SIGNING_KEY, ROLE_ARN, BUCKET, DATABASE_URL, INTERNAL_TOKEN)
"""What ``trace-aws serve`` cannot start without."""
WORKER_REQUIRED: Final = (REGION, WORKER_QUEUE, INTERNAL_TOKEN, API_URL)
"""What ``trace-aws worker`` cannot start without."""

_MAX_FILE = 64 * 1024
_REGION = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_ROLE_ARN = re.compile(r"^arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]{1,512}$")
_KMS_KEY = re.compile(
    r"^(arn:aws[a-z-]*:kms:[\w-]+:\d{12}:(key|alias)/\S+|alias/\S+|[\w-]{1,256})$"
)
_QUEUE_NAME = re.compile(r"^[\w-]{1,80}$")
_RUNTIME_NAME = re.compile(r"^[A-Za-z][\w-]{0,63}$")
# A function name, a partial ARN or a full ARN, optionally ending in
# ``{operator}`` templates (trace_core.dispatcher.runtimes.Runtime.target_for).
_FUNCTION = re.compile(r"^[\w:{}.-]{1,170}$")
_QUALIFIER = re.compile(r"^(\$LATEST|[\w-]{1,128})$")


@dataclass(frozen=True)
class AwsSettings:
    """The checked settings (see the module docstring for their names)."""

    region: str
    endpoint_url: str | None = None
    queue_urls: Mapping[str, str] = field(default_factory=dict)
    worker_queue_url: str | None = None
    buffer_queue_urls: Mapping[uuid.UUID, str] = field(default_factory=dict)
    lambda_runtimes: Mapping[str, str] = field(default_factory=dict)
    """Runtime name -> function name or ARN (``{operator}`` is replaced per job)."""
    lambda_qualifier: str | None = None
    signing_key_id: str | None = None
    data_key_id: str | None = None
    role_arn: str | None = None
    bucket: str | None = None
    database_url: str | None = None
    internal_token: str | None = field(default=None, repr=False)
    host: str = "127.0.0.1"
    port: int = 8000
    api_url: str | None = None


@dataclass(frozen=True)
class _Value:
    text: str
    source: str
    """Where it came from: the variable, or ``file:line``, for error messages."""


def _fail(name: str, value: _Value | None, reason: str) -> ConfigurationError:
    where = f" ({value.source})" if value is not None else ""
    return ConfigurationError(f"{name}{where}: {reason}")


def _read_file(path: Path) -> dict[str, _Value]:
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise ConfigurationError(f"settings file {path}: {exc.strerror}") from None
    if not stat.S_ISREG(mode):
        raise ConfigurationError(f"settings file {path}: not a regular file")
    raw = path.read_bytes()[: _MAX_FILE + 1]
    if len(raw) > _MAX_FILE:
        raise ConfigurationError(f"settings file {path}: larger than {_MAX_FILE} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigurationError(f"settings file {path}: not UTF-8") from None
    values: dict[str, _Value] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        where = f"{path}:{number}"
        name, sep, value = stripped.partition("=")
        name = name.strip()
        if not sep:
            raise ConfigurationError(f"{where}: expected NAME=value")
        if name not in SETTINGS:
            raise ConfigurationError(f"{where}: unknown setting {name!r}")
        if name in values:
            raise ConfigurationError(
                f"{where}: {name} is set twice (first at {values[name].source})"
            )
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        values[name] = _Value(value, where)
    # The token may live in the file only if no other user can read it.
    if INTERNAL_TOKEN in values and mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigurationError(
            f"settings file {path}: holds {INTERNAL_TOKEN} but is readable or writable by "
            f"others (mode {stat.S_IMODE(mode):o}); chmod 600 it"
        )
    return values


def _url(name: str, value: _Value, schemes: Iterable[str] = ("http", "https")) -> str:
    parts = urlsplit(value.text)
    if parts.scheme not in schemes or not parts.hostname:
        raise _fail(name, value, f"not a URL ({'/'.join(schemes)}://host...)")
    return value.text


def _check_region(name: str, value: _Value) -> str:
    if not _REGION.match(value.text):
        raise _fail(name, value, f"{value.text!r} is not an AWS region (like us-east-1)")
    return value.text


def _check_queue_urls(name: str, value: _Value) -> dict[str, str]:
    urls: dict[str, str] = {}
    for item in value.text.split(","):
        queue, sep, url = item.strip().partition("=")
        if not sep or not _QUEUE_NAME.match(queue.strip()):
            raise _fail(name, value, f"{item.strip()!r} is not name=url")
        urls[queue.strip()] = _url(name, _Value(url.strip(), value.source))
    return urls


def _pairs(name: str, value: _Value, expected: str) -> list[tuple[str, str]]:
    pairs: list[tuple[str, str]] = []
    for item in value.text.split(","):
        key, sep, target = (part.strip() for part in item.strip().partition("="))
        if not sep or not key or not target:
            raise _fail(name, value, f"{item.strip()!r} is not {expected}")
        if key in dict(pairs):
            raise _fail(name, value, f"{key!r} is listed twice")
        pairs.append((key, target))
    return pairs


def _check_buffer_queues(name: str, value: _Value) -> dict[uuid.UUID, str]:
    urls: dict[uuid.UUID, str] = {}
    for dataset, url in _pairs(name, value, "dataset-uuid=url"):
        try:
            key = uuid.UUID(dataset)
        except ValueError:
            raise _fail(name, value, f"{dataset!r} is not a dataset UUID") from None
        if key in urls:
            raise _fail(name, value, f"dataset {key} is listed twice")
        urls[key] = _url(name, _Value(url, value.source))
    return urls


def _check_lambda_runtimes(name: str, value: _Value) -> dict[str, str]:
    runtimes: dict[str, str] = {}
    for runtime, function in _pairs(name, value, "runtime=function"):
        if not _RUNTIME_NAME.match(runtime):
            raise _fail(name, value, f"{runtime!r} is not a runtime name")
        if not _FUNCTION.match(function):
            raise _fail(name, value, f"{function!r} is not a Lambda function name or ARN")
        runtimes[runtime] = function
    return runtimes


def _check_qualifier(name: str, value: _Value) -> str:
    if not _QUALIFIER.match(value.text):
        raise _fail(name, value, f"{value.text!r} is not a Lambda alias or version")
    return value.text


def _check_kms_key(name: str, value: _Value) -> str:
    if not _KMS_KEY.match(value.text):
        raise _fail(name, value, "not a KMS key id, key ARN or alias")
    return value.text


def _check_role(name: str, value: _Value) -> str:
    if not _ROLE_ARN.match(value.text):
        raise _fail(name, value, "not an IAM role ARN (arn:aws:iam::<account>:role/<name>)")
    return value.text


def _check_bucket(name: str, value: _Value) -> str:
    if not _BUCKET.match(value.text) or ".." in value.text:
        raise _fail(name, value, f"{value.text!r} is not an S3 bucket name")
    return value.text


def _check_database(name: str, value: _Value) -> str:
    scheme = urlsplit(value.text).scheme
    if not scheme.startswith("postgresql"):
        # Never echo the URL: it may carry a password.
        raise _fail(name, value, "the AWS profile runs on Postgres (postgresql+psycopg://...)")
    return value.text


def _check_token(name: str, value: _Value) -> str:
    from trace_core.api import check_internal_token

    try:
        check_internal_token(value.text)
    except ConfigurationError as exc:
        raise _fail(name, value, str(exc)) from None
    return value.text


def _check_bind(name: str, value: _Value) -> tuple[str, int]:
    host, sep, port = value.text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise _fail(name, value, f"{value.text!r} is not host:port")
    return host.strip("[]"), int(port)


_CHECKS: Final[dict[str, Callable[[str, _Value], object]]] = {
    REGION: _check_region,
    ENDPOINT_URL: _url,
    QUEUE_URLS: _check_queue_urls,
    WORKER_QUEUE: _url,
    BUFFER_QUEUES: _check_buffer_queues,
    LAMBDA_RUNTIMES: _check_lambda_runtimes,
    LAMBDA_QUALIFIER: _check_qualifier,
    SIGNING_KEY: _check_kms_key,
    DATA_KEY: _check_kms_key,
    ROLE_ARN: _check_role,
    BUCKET: _check_bucket,
    DATABASE_URL: _check_database,
    INTERNAL_TOKEN: _check_token,
    BIND: _check_bind,
    API_URL: _url,
}


def load_settings(
    environ: Mapping[str, str],
    file: str | Path | None = None,
    *,
    required: Iterable[str] = (REGION,),
) -> AwsSettings:
    """Read, check and type the settings from ``environ`` over ``file``.

    ``required`` names the settings the command cannot run without
    (:data:`SERVE_REQUIRED`, :data:`WORKER_REQUIRED`). Raises
    :class:`ConfigurationError` naming the first missing or wrong setting.
    """
    values = _read_file(Path(file)) if file is not None else {}
    for name in SETTINGS:
        text = environ.get(name)
        if text is not None and text.strip():
            values[name] = _Value(text.strip(), f"environment {name}")
    for name in required:
        value = values.get(name)
        if value is None or not value.text:
            origin = f" or in {file}" if file is not None else ""
            raise ConfigurationError(f"{name}: missing (set it in the environment{origin})")
    checked: dict[str, object] = {}
    for name, value in values.items():
        if not value.text:
            continue  # an empty line in a file: not set
        checked[name] = _CHECKS[name](name, value)
    bind = checked.get(BIND)
    host, port = bind if isinstance(bind, tuple) else ("127.0.0.1", 8000)
    queues = checked.get(QUEUE_URLS)
    buffers = checked.get(BUFFER_QUEUES)
    lambdas = checked.get(LAMBDA_RUNTIMES)
    return AwsSettings(
        region=str(checked[REGION]) if REGION in checked else "",
        endpoint_url=_opt(checked, ENDPOINT_URL),
        queue_urls=dict(queues) if isinstance(queues, dict) else {},
        worker_queue_url=_opt(checked, WORKER_QUEUE),
        buffer_queue_urls=dict(buffers) if isinstance(buffers, dict) else {},
        lambda_runtimes=dict(lambdas) if isinstance(lambdas, dict) else {},
        lambda_qualifier=_opt(checked, LAMBDA_QUALIFIER),
        signing_key_id=_opt(checked, SIGNING_KEY),
        data_key_id=_opt(checked, DATA_KEY),
        role_arn=_opt(checked, ROLE_ARN),
        bucket=_opt(checked, BUCKET),
        database_url=_opt(checked, DATABASE_URL),
        internal_token=_opt(checked, INTERNAL_TOKEN),
        host=str(host),
        port=int(port),
        api_url=_opt(checked, API_URL),
    )


def _opt(checked: Mapping[str, object], name: str) -> str | None:
    value = checked.get(name)
    return None if value is None else str(value)
