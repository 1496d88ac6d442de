"""AWS failures as Trace errors: transient ones are retried, the rest are answers.

Every adapter calls boto3 through :func:`translated`, so callers never catch
botocore types. The message names the operation, the AWS error code and the
HTTP status only: never the service's free-text message (a signature
mismatch echoes the canonical request), a credential or a token.

- throttling, 5xx, a connection or read timeout: :class:`AwsUnavailable`
  (retry with backoff; the outbox relay and the worker loop do);
- a queue (or other named resource) that does not exist:
  :class:`~trace_core.errors.NotFound`;
- anything else (access denied, a malformed request): :class:`AwsRejected`.

trace_core has no transient error class outside the database
(:class:`~trace_core.errors.DatabaseUnavailable`), hence
:class:`AwsUnavailable` here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from botocore.exceptions import BotoCoreError, ClientError, ConnectionError, HTTPClientError

from trace_core.errors import NotFound, TraceError

__all__ = ["AwsRejected", "AwsUnavailable", "translated"]

THROTTLING_CODES = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "SlowDown",
        "RequestLimitExceeded",
        "ServiceUnavailable",
        "InternalError",
        "InternalFailure",
        "KMSInternalException",
        "AWS.SimpleQueueService.ServiceUnavailable",
    }
)
"""Error codes AWS documents as "retry later" whatever their HTTP status."""

NOT_FOUND_CODES = frozenset(
    {
        "AWS.SimpleQueueService.NonExistentQueue",
        "QueueDoesNotExist",
        "NotFoundException",
        "NoSuchBucket",
        "NoSuchKey",
    }
)


class AwsUnavailable(TraceError):
    """An AWS call failed in a way a later retry may fix (throttling, 5xx, network)."""

    def __init__(self, operation: str, detail: str) -> None:
        super().__init__(f"{operation}: AWS unavailable ({detail})")
        self.operation = operation
        self.detail = detail


class AwsRejected(TraceError):
    """AWS refused the call for good (access denied, invalid request...)."""

    def __init__(self, operation: str, code: str, status: int | None) -> None:
        super().__init__(f"{operation}: refused by AWS ({code}, HTTP {status})")
        self.operation = operation
        self.code = code
        self.status = status


def error_code(exc: ClientError) -> str:
    """The AWS error code of ``exc`` (``Unknown`` when the answer had none)."""
    return str(exc.response.get("Error", {}).get("Code") or "Unknown")


def translate(operation: str, exc: Exception) -> TraceError:
    """The Trace error for a botocore failure of ``operation`` (see the module docstring)."""
    if isinstance(exc, ClientError):
        code = error_code(exc)
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in THROTTLING_CODES or (status is not None and status >= 500):
            return AwsUnavailable(operation, f"{code}, HTTP {status}")
        if code in NOT_FOUND_CODES:
            return NotFound(f"{operation}: not found ({code})")
        return AwsRejected(operation, code, status)
    if isinstance(exc, (ConnectionError, HTTPClientError)):
        return AwsUnavailable(operation, type(exc).__name__)
    return AwsRejected(operation, type(exc).__name__, None)


@contextlib.contextmanager
def translated(operation: str) -> Iterator[None]:
    """Raise botocore failures inside the block as Trace errors naming ``operation``."""
    try:
        yield
    except (ClientError, BotoCoreError) as exc:
        raise translate(operation, exc) from None
