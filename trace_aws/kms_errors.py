"""KMS failures as trace_core errors, each naming the operation and the key.

botocore raises its own types (``ClientError`` with an error code, the
connection errors, ``NoCredentialsError``); callers of the KMS adapters catch
only these three classes:

- :class:`KmsUnavailable`: retry later (throttling, KMS internal errors,
  timeouts, the endpoint unreachable);
- :class:`KmsKeyUnusable`: the key cannot do this now or ever without an
  operator (disabled, pending deletion, not found, access denied, wrong key
  usage or spec); a :class:`~trace_core.errors.ConfigurationError`;
- :class:`KmsRequestFailed`: anything else KMS refused;

and a plain :class:`~trace_core.errors.ConfigurationError` when the client
has no credentials at all.

Messages carry the operation, the key id and the AWS error code only: never
the AWS message text (it can echo request data), a plaintext, a data key, a
ciphertext or a credential.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError, NoCredentialsError
from botocore.exceptions import ConnectionError as BotoConnectionError

from trace_aws.errors import AwsRequestFailed, AwsUnavailable, error_code, is_transient
from trace_core.errors import ConfigurationError

__all__ = [
    "KmsKeyUnusable",
    "KmsRequestFailed",
    "KmsUnavailable",
    "kms_call",
]

# The key exists but is in a state (or has a usage) that refuses the operation.
_KEY_CODES = frozenset(
    {
        "DisabledException",
        "KMSInvalidStateException",
        "NotFoundException",
        "AccessDeniedException",
        "AccessDenied",
        "InvalidKeyUsageException",
        "KeyUnavailableException",
        "UnrecognizedClientException",
    }
)


class KmsUnavailable(AwsUnavailable):
    """KMS did not answer or asked us to slow down; the same call may succeed later."""

    def __init__(self, operation: str, key_id: str, code: str) -> None:
        super().__init__(f"KMS {operation} on key {key_id}", code)
        self.key_id = key_id


class KmsKeyUnusable(ConfigurationError):
    """The KMS key refuses the operation until an operator acts (state, policy, usage)."""

    def __init__(self, operation: str, key_id: str, code: str) -> None:
        super().__init__(
            f"KMS {operation} refused by key {key_id} ({code}): the key is disabled, "
            "pending deletion, missing, not allowed for this role, or of the wrong usage"
        )
        self.operation = operation
        self.key_id = key_id
        self.code = code


class KmsRequestFailed(AwsRequestFailed):
    """KMS refused the request for a reason not covered by the other two classes."""

    def __init__(self, operation: str, key_id: str, code: str) -> None:
        super().__init__(f"KMS {operation} on key {key_id}", code)
        self.key_id = key_id


@contextmanager
def kms_call(operation: str, key_id: str) -> Iterator[None]:
    """Translate the botocore errors raised inside the block into KMS errors.

    ``from None``: the botocore exception (whose text may quote the request)
    is not chained into tracebacks or logs.
    """
    try:
        yield
    except ClientError as exc:
        code = error_code(exc)
        if is_transient(exc):
            raise KmsUnavailable(operation, key_id, code) from None
        if code in _KEY_CODES:
            raise KmsKeyUnusable(operation, key_id, code) from None
        raise KmsRequestFailed(operation, key_id, code) from None
    except NoCredentialsError:
        raise ConfigurationError(
            f"KMS {operation} on key {key_id}: no AWS credentials found for the KMS client"
        ) from None
    except (BotoConnectionError, HTTPClientError) as exc:
        # EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError, a closed connection
        raise KmsUnavailable(operation, key_id, type(exc).__name__) from None
    except BotoCoreError as exc:
        raise KmsRequestFailed(operation, key_id, type(exc).__name__) from None
