"""AWS failures as Trace errors: retryable ones apart from the rest.

Every adapter of this package calls AWS through boto3 and lets no botocore
type escape: :func:`aws_error` turns a ``ClientError`` or a connection
failure into :class:`AwsUnavailable` (retry later: throttling, a 5xx, no
connection) or :class:`AwsRequestFailed` (retrying the same request will not
help: access denied, a missing resource, an invalid parameter). Messages name
the operation and AWS's error code, never a parameter value, so no secret,
token or credential can reach a message or a log.
"""

from __future__ import annotations

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    ReadTimeoutError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)

from trace_core.errors import TraceError

__all__ = ["AwsRequestFailed", "AwsUnavailable", "aws_error", "error_code", "is_transient"]

# Codes AWS documents as throttling or transient; any 5xx is transient too.
_TRANSIENT_CODES = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "RequestLimitExceeded",
        "SlowDown",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "InternalFailure",
        "ServiceUnavailable",
        "IDPCommunicationError",
        # KMS's own: its request-rate limit, internal errors, a dependency timing out
        "LimitExceededException",
        "KMSInternalException",
        "DependencyTimeoutException",
        "ServiceUnavailableException",
    }
)


class AwsUnavailable(TraceError):
    """A retryable AWS failure (throttled, a 5xx, unreachable): try again later."""

    def __init__(self, operation: str, code: str) -> None:
        super().__init__(f"AWS {operation} failed transiently ({code}); retry later")
        self.operation = operation
        self.code = code


class AwsRequestFailed(TraceError):
    """AWS refused the request; repeating it unchanged will fail again."""

    def __init__(self, operation: str, code: str, status: int | None = None) -> None:
        where = f", HTTP {status}" if status is not None else ""
        super().__init__(f"AWS {operation} was refused ({code}{where})")
        self.operation = operation
        self.code = code
        self.status = status


def error_code(exc: ClientError) -> str:
    """AWS's error code of ``exc`` (``"Unknown"`` if the response has none)."""
    code = exc.response.get("Error", {}).get("Code")
    return str(code) if code else "Unknown"


def _status(exc: ClientError) -> int | None:
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status if isinstance(status, int) else None


def is_transient(exc: ClientError) -> bool:
    """Whether AWS says to try ``exc``'s request again later (throttled, a 5xx)."""
    status = _status(exc)
    return error_code(exc) in _TRANSIENT_CODES or (status is not None and status >= 500)


def aws_error(operation: str, exc: ClientError | BotoCoreError) -> TraceError:
    """The Trace error for ``exc`` raised by AWS ``operation`` (raise it ``from None``).

    Only the error code and HTTP status are kept: AWS's own message can echo
    request values, so it is deliberately dropped.
    """
    if isinstance(exc, ClientError):
        code, status = error_code(exc), _status(exc)
        if is_transient(exc):
            return AwsUnavailable(operation, code)
        return AwsRequestFailed(operation, code, status)
    if isinstance(
        exc, EndpointConnectionError | ConnectTimeoutError | ReadTimeoutError | BotoConnectionError
    ):
        return AwsUnavailable(operation, type(exc).__name__)
    # Anything else botocore raises (no credentials, a bad parameter) is not
    # fixed by waiting.
    return AwsRequestFailed(operation, type(exc).__name__)
