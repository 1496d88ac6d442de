"""The :class:`~trace_core.ports.LambdaInvoker` port on AWS Lambda.

The Dispatcher's launcher invokes a ``runtime: lambda`` job's function with the
full task payload (``trace_core.dispatcher.payload``), asynchronously
(``InvocationType=Event``): ``invoke`` returns once Lambda accepted the event.

Lambda's own retries of asynchronous invocations must be off: the Dispatcher
owns attempts, leases and retries for every runtime, and a retry Lambda made on
its own would be one more wake-up for an attempt the Dispatcher already
retries. :meth:`LambdaTaskInvoker.check_functions` reads each function's
``GetFunctionEventInvokeConfig`` at start-up and refuses to start unless
``MaximumRetryAttempts`` is 0 (a function without that configuration retries
twice, Lambda's default, and is refused too).

boto3 is synchronous: every call runs in a worker thread on one client.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread
from botocore.exceptions import BotoCoreError, ClientError

from trace_aws.errors import AwsRequestFailed, aws_error, error_code
from trace_core.errors import ConfigurationError, InvalidInput, NotFound

if TYPE_CHECKING:
    from mypy_boto3_lambda import LambdaClient

__all__ = ["MAX_EVENT_PAYLOAD", "LambdaTaskInvoker", "call_lambda", "lambda_client"]

log = logging.getLogger(__name__)

MAX_EVENT_PAYLOAD = 256 * 1024
"""Bytes of an asynchronous invocation's payload the invoker sends by default
(256 KiB, Lambda's long-standing limit; raise ``max_payload_bytes`` where the
account's limit is higher)."""

T = TypeVar("T")


def lambda_client(region: str, endpoint_url: str | None = None) -> LambdaClient:
    """A Lambda client for ``region`` (explicit), at ``endpoint_url`` when given
    (a moto server, LocalStack). Clients are thread-safe: build one per adapter."""
    import boto3

    if not region:
        raise ConfigurationError("region: an AWS region is required (e.g. us-east-1)")
    return boto3.client("lambda", region_name=region, endpoint_url=endpoint_url or None)


async def call_lambda(operation: str, function: str, call: Callable[..., T], /, **kwargs: Any) -> T:
    """``call(**kwargs)`` in a worker thread, its failures translated
    (:mod:`trace_aws.errors`; a function that does not exist is :class:`NotFound`
    naming it). AWS's message text is dropped: it can echo request values."""

    def run() -> T:
        try:
            return call(**kwargs)
        except ClientError as exc:
            if error_code(exc) == "ResourceNotFoundException":
                raise NotFound(
                    f"lambda {operation}: function {function!r} does not exist"
                ) from None
            raise aws_error(f"lambda {operation} ({function})", exc) from None
        except BotoCoreError as exc:
            raise aws_error(f"lambda {operation} ({function})", exc) from None

    return await anyio.to_thread.run_sync(run)


class LambdaTaskInvoker:
    """Invokes functions asynchronously with the full task payload.

    ``qualifier`` (a version or alias, e.g. ``live``) is passed on every call
    when given, so the checked configuration is the one invoked. A payload over
    ``max_payload_bytes`` is refused before any request.
    """

    def __init__(
        self,
        client: LambdaClient,
        *,
        qualifier: str | None = None,
        max_payload_bytes: int = MAX_EVENT_PAYLOAD,
    ) -> None:
        if max_payload_bytes <= 0:
            raise ConfigurationError("LambdaTaskInvoker.max_payload_bytes must be > 0")
        self.client = client
        self.qualifier = qualifier
        self.max_payload_bytes = max_payload_bytes

    def _qualified(self) -> dict[str, str]:
        return {"Qualifier": self.qualifier} if self.qualifier else {}

    async def check_functions(self, functions: Iterable[str]) -> None:
        """Refuse to start unless every function's own retries are off.

        Raises :class:`ConfigurationError` naming the function when its
        ``MaximumRetryAttempts`` is not 0 or it has no event-invoke
        configuration (Lambda then retries twice), and :class:`NotFound` when
        the function does not exist.
        """
        for function in sorted(set(functions)):
            try:
                config = await call_lambda(
                    "GetFunctionEventInvokeConfig",
                    function,
                    self.client.get_function_event_invoke_config,
                    FunctionName=function,
                    **self._qualified(),
                )
            except NotFound:
                # Either the function or its event-invoke configuration is
                # missing (both are ResourceNotFoundException): tell which.
                await call_lambda(
                    "GetFunction",
                    function,
                    self.client.get_function,
                    FunctionName=function,
                    **self._qualified(),
                )
                raise ConfigurationError(
                    f"lambda function {function!r}: no event-invoke configuration, so Lambda "
                    "retries failed invocations twice; set MaximumRetryAttempts=0 "
                    "(put-function-event-invoke-config)"
                ) from None
            retries = config.get("MaximumRetryAttempts")
            if retries != 0:
                raise ConfigurationError(
                    f"lambda function {function!r}: MaximumRetryAttempts is {retries}, "
                    "must be 0 (the Dispatcher owns retries)"
                )

    async def invoke(self, function: str, payload: Mapping[str, Any]) -> None:
        """Start ``function`` with ``payload`` (``InvocationType=Event``); returns
        once Lambda accepted it. Failures raise (the launcher's outbox row is then
        retried): :class:`~trace_aws.errors.AwsUnavailable` to retry later,
        :class:`~trace_aws.errors.AwsRequestFailed`, :class:`NotFound`, or
        :class:`InvalidInput` for a payload over Lambda's limit."""
        body = json.dumps(payload, separators=(",", ":")).encode()
        if len(body) > self.max_payload_bytes:
            raise InvalidInput(
                "payload",
                f"{len(body)} bytes for task {payload.get('task_id')}, over the "
                f"{self.max_payload_bytes} bytes allowed for an asynchronous invocation",
            )
        answer = await call_lambda(
            "Invoke",
            function,
            self.client.invoke,
            FunctionName=function,
            InvocationType="Event",
            Payload=body,
            **self._qualified(),
        )
        status = answer.get("StatusCode")
        if status != 202:
            raise AwsRequestFailed(f"lambda Invoke ({function})", f"StatusCode {status}", status)
        log.debug("invoked %s for task %s", function, payload.get("task_id"))
