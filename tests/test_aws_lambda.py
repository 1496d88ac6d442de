"""The Lambda runtime: :mod:`trace_aws.lambda_invoker` and :mod:`trace_aws.lambda_handler`.

moto keeps a function's configuration (so the start-up check of its retries
runs on moto) but cannot run a function without Docker: ``Invoke`` is
answered by botocore's ``Stubber``, which records the request the invoker
made. The handler is called in-process against a real Dispatcher's HTTP app
(``/internal/*`` through an ASGI transport) on SQLite, with the payload the
Dispatcher's launcher actually sent.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import uuid
import zipfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import pytest
from botocore.stub import Stubber
from moto import mock_aws

import trace_aws.lambda_handler
from tests.test_aws_sqs import aws_env
from tests.test_udf_isolation import serving
from tests.test_worker_wrapper import DAG as WRAPPER_DAG
from tests.test_worker_wrapper import DEPLOYED, Platform, Ticker, wait_for, wrapper_for
from trace_aws.errors import AwsRequestFailed, AwsUnavailable
from trace_aws.lambda_handler import (
    EnvironmentSecrets,
    LambdaHandlerSettings,
    handler,
    parse_invocation,
    run_invocation,
    worker_id_for,
)
from trace_aws.lambda_invoker import MAX_EVENT_PAYLOAD, LambdaTaskInvoker, lambda_client
from trace_core.api import create_app
from trace_core.authoring.context import OperatorResult, TaskContext
from trace_core.authoring.operators import OperatorRegistry, OperatorSpec, load_registry
from trace_core.clock import ManualClock
from trace_core.dag import parse_dag
from trace_core.dispatcher.inprocess import InProcessWakeupQueue
from trace_core.dispatcher.service import Dispatcher
from trace_core.errors import ConfigurationError, InvalidInput, NotFound
from trace_core.storage.sql import SqlRepository
from trace_core.worker import HttpControlPlaneClient, WorkerWrapper

if TYPE_CHECKING:
    from mypy_boto3_lambda import LambdaClient

pytestmark = pytest.mark.anyio

__all__ = ["aws_env"]  # a fixture, imported to be reused

REGION = "us-east-1"
TOKEN = "lambda-test-internal-token-0123456789"
BASE = "http://trace.test"
FUNCTION = "trace-follow"  # the lambda runtime's target for operator "follow"

# The wrapper suite's DAG with its source job on the Lambda runtime.
DAG = WRAPPER_DAG.replace("runtime: ecs_udf", "runtime: lambda", 1)
assert "runtime: lambda" in DAG


# --- the invoker: start-up check on moto ----------------------------------------------


@pytest.fixture
def lam(aws_env: None) -> Iterator[LambdaClient]:
    import boto3

    with mock_aws():
        iam = boto3.client("iam", region_name=REGION)
        role = iam.create_role(
            RoleName="trace-fn",
            AssumeRolePolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": []}),
        )["Role"]["Arn"]
        client = lambda_client(REGION)
        code = io.BytesIO()
        with zipfile.ZipFile(code, "w") as z:
            z.writestr("handler.py", "def handler(event, context):\n    return None\n")
        for name in (FUNCTION, "trace-retrying", "trace-unconfigured"):
            client.create_function(
                FunctionName=name,
                Runtime="python3.11",
                Role=role,
                Handler="trace_aws.lambda_handler.handler",
                Code={"ZipFile": code.getvalue()},
            )
        client.put_function_event_invoke_config(FunctionName=FUNCTION, MaximumRetryAttempts=0)
        client.put_function_event_invoke_config(
            FunctionName="trace-retrying", MaximumRetryAttempts=2
        )
        yield client


async def test_a_function_with_retries_off_passes_the_start_up_check(lam: LambdaClient) -> None:
    await LambdaTaskInvoker(lam).check_functions([FUNCTION, FUNCTION])


async def test_a_function_that_retries_is_refused_naming_it(lam: LambdaClient) -> None:
    with pytest.raises(ConfigurationError, match=r"'trace-retrying'.*MaximumRetryAttempts is 2"):
        await LambdaTaskInvoker(lam).check_functions([FUNCTION, "trace-retrying"])


async def test_a_function_without_an_event_invoke_config_is_refused(lam: LambdaClient) -> None:
    # Lambda then retries twice by default.
    with pytest.raises(ConfigurationError, match=r"'trace-unconfigured'.*no event-invoke"):
        await LambdaTaskInvoker(lam).check_functions(["trace-unconfigured"])


async def test_a_missing_function_is_not_found_naming_it(lam: LambdaClient) -> None:
    with pytest.raises(NotFound, match="'trace-nope' does not exist"):
        await LambdaTaskInvoker(lam).check_functions(["trace-nope"])


def test_the_region_is_required() -> None:
    with pytest.raises(ConfigurationError, match="region"):
        lambda_client("")


# --- the invoker: Invoke through the Stubber (moto would need Docker) ------------------


@pytest.fixture
def stubbed(aws_env: None) -> Iterator[tuple[LambdaClient, Stubber]]:
    client = lambda_client(REGION)
    with Stubber(client) as stub:
        yield client, stub


async def test_invoke_sends_an_event_invocation_with_the_payload(
    stubbed: tuple[LambdaClient, Stubber],
) -> None:
    client, stub = stubbed
    payload = {"task_id": str(uuid.UUID(int=1)), "attempt": 0, "operator": "follow"}
    body = json.dumps(payload, separators=(",", ":")).encode()
    expected = {"FunctionName": FUNCTION, "InvocationType": "Event", "Payload": body}
    stub.add_response("invoke", {"StatusCode": 202}, expected)
    stub.add_response("invoke", {"StatusCode": 202}, {**expected, "Qualifier": "live"})
    await LambdaTaskInvoker(client).invoke(FUNCTION, payload)
    await LambdaTaskInvoker(client, qualifier="live").invoke(FUNCTION, payload)
    stub.assert_no_pending_responses()


async def test_invoke_failures_are_trace_errors_without_aws_text(
    stubbed: tuple[LambdaClient, Stubber],
) -> None:
    client, stub = stubbed
    secret_text = "echoed-request-value-SECRET"
    stub.add_client_error("invoke", "TooManyRequestsException", secret_text, 429)
    stub.add_client_error("invoke", "AccessDeniedException", secret_text, 403)
    stub.add_client_error("invoke", "ResourceNotFoundException", secret_text, 404)
    stub.add_response("invoke", {"StatusCode": 200})
    invoker = LambdaTaskInvoker(client)
    payload = {"task_id": str(uuid.UUID(int=2))}
    errors: list[Exception] = []
    for kind in (AwsUnavailable, AwsRequestFailed, NotFound, AwsRequestFailed):
        with pytest.raises(kind) as caught:
            await invoker.invoke(FUNCTION, payload)
        errors.append(caught.value)
    assert all(secret_text not in str(e) for e in errors)
    assert "TooManyRequestsException" in str(errors[0]) and FUNCTION in str(errors[0])
    assert "StatusCode 200" in str(errors[3])


async def test_a_payload_over_lambdas_limit_is_refused_before_any_request(
    stubbed: tuple[LambdaClient, Stubber],
) -> None:
    client, _ = stubbed  # no response queued: a request would fail the Stubber
    payload = {"task_id": "t", "config": {"x": "a" * MAX_EVENT_PAYLOAD}}
    with pytest.raises(InvalidInput, match="payload"):
        await LambdaTaskInvoker(client).invoke(FUNCTION, payload)
    with pytest.raises(InvalidInput, match="over the 100 bytes"):
        await LambdaTaskInvoker(client, max_payload_bytes=100).invoke(FUNCTION, {"x": "a" * 100})
    with pytest.raises(ConfigurationError, match="max_payload_bytes"):
        LambdaTaskInvoker(client, max_payload_bytes=0)


# --- the handler against a real Dispatcher over HTTP ------------------------------------


@pytest.fixture
def engine() -> str:
    return "sqlite"  # the handler's fencing is the Dispatcher's, tested on both engines


@dataclass
class LambdaPlatform:
    """A Dispatcher whose ``runtime: lambda`` tasks are invoked through the
    stubbed Lambda client, and its HTTP app for the handler."""

    platform: Platform
    http: httpx.AsyncClient
    stub: Stubber
    sent: list[dict[str, Any]] = field(default_factory=list)

    def wrapper(self, follow: Any, **kwargs: Any) -> Any:
        client = HttpControlPlaneClient(BASE, TOKEN, http=self.http)
        return lambda worker_id: wrapper_for(
            self.platform, follow, client=client, worker_id=worker_id, **kwargs
        )

    async def trigger(self, key: str = "run-1") -> dict[str, Any]:
        """A manual run of the lambda job; the launcher's Invoke payload."""
        self.stub.add_response("invoke", {"StatusCode": 202})
        await self.platform.trigger(key)
        await self.platform.dispatcher.run_once()
        return self.sent[-1]


@pytest.fixture
async def lp(
    repo: SqlRepository, clock: ManualClock, aws_env: None
) -> AsyncIterator[LambdaPlatform]:
    client = lambda_client(REGION)
    sent: list[dict[str, Any]] = []

    def record(params: Any, **_: Any) -> None:
        assert params["InvocationType"] == "Event"
        sent.append({"function": params["FunctionName"], **json.loads(params["Payload"])})

    client.meta.events.register("provide-client-params.lambda.Invoke", record)
    wakeups = InProcessWakeupQueue()
    dispatcher = Dispatcher(
        repo, operators=DEPLOYED, clock=clock, wakeups=wakeups, lambdas=LambdaTaskInvoker(client)
    )
    deployed = await dispatcher.deploy(parse_dag(DAG, operators=DEPLOYED.names()))
    platform = Platform(dispatcher, deployed, clock, wakeups)
    app = create_app(dispatcher, internal_token=TOKEN)
    with Stubber(client) as stub:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as http:
            yield LambdaPlatform(platform, http, stub, sent)


async def test_the_launcher_invokes_the_function_and_the_handler_completes_the_task(
    lp: LambdaPlatform,
) -> None:
    ran: list[tuple[int, str]] = []

    async def follow(ctx: TaskContext) -> OperatorResult:
        ran.append((ctx.attempt, ctx.secrets["API_KEY"]))
        await ctx.emit([lp.platform.partition(0, 9)])
        return OperatorResult(events=[lp.platform.partition(10, 19)], outputs=[{"rows": 20}])

    event = await lp.trigger()
    # The full task payload of the contract, sent to the runtime's function.
    assert event["function"] == FUNCTION
    assert {"task_id", "attempt", "job", "operator", "config", "inputs", "outputs"} <= set(event)
    assert event["operator"] == "follow" and event["job"]["dag_name"] == "worker"
    assert event["job"]["name"] == "follow" and event["config"]["n"] == 2
    worker = worker_id_for(FUNCTION, "req-1")
    got = await run_invocation(event, worker, lp.wrapper(follow))
    task_id = uuid.UUID(event["task_id"])
    assert got == {"task_id": str(task_id), "outcome": "completed"}
    assert ran == [(1, "k-123")]
    row = await lp.platform.task(task_id)
    assert (row["status"], row["attempt"], row["outputs"]) == ("Completed", 1, [{"rows": 20}])
    assert await lp.platform.events_of(task_id) == [("0-9", 1), ("10-19", 1)]


async def test_a_duplicate_invocation_runs_nothing_and_a_late_one_finds_it_completed(
    lp: LambdaPlatform,
) -> None:
    started, release = anyio.Event(), anyio.Event()
    runs: list[str] = []

    async def follow(ctx: TaskContext) -> OperatorResult:
        runs.append(ctx.task_id.hex)
        started.set()
        await release.wait()
        return OperatorResult(events=[lp.platform.partition(0, 9)])

    event = await lp.trigger()
    factory = lp.wrapper(follow)
    outcomes: dict[str, str] = {}
    async with anyio.create_task_group() as group:

        async def first() -> None:
            got = await run_invocation(event, worker_id_for(FUNCTION, "req-1"), factory)
            outcomes["first"] = got["outcome"]

        group.start_soon(first)
        await wait_for(started)
        # Lambda delivered the same event twice: the second claim is refused.
        got = await run_invocation(dict(event), worker_id_for(FUNCTION, "req-2"), factory)
        outcomes["duplicate"] = got["outcome"]
        release.set()
    late = await run_invocation(event, worker_id_for(FUNCTION, "req-3"), factory)
    assert outcomes == {"first": "completed", "duplicate": "AlreadyRunning"}
    assert late["outcome"] == "Completed" and len(runs) == 1
    row = await lp.platform.task(uuid.UUID(event["task_id"]))
    assert (row["status"], row["attempt"]) == ("Completed", 1)


async def test_an_invocation_whose_lease_was_reclaimed_is_stale_and_writes_nothing(
    lp: LambdaPlatform,
) -> None:
    started, release = anyio.Event(), anyio.Event()
    cancelled: list[bool] = []
    ticker = Ticker()

    async def follow(ctx: TaskContext) -> OperatorResult:
        await ctx.emit([lp.platform.partition(0, 9)])  # attempt 1 is current
        started.set()
        try:
            await release.wait()
        except anyio.get_cancelled_exc_class():
            cancelled.append(True)
            raise
        return OperatorResult(events=[lp.platform.partition(10, 19)])

    event = await lp.trigger()
    task_id = uuid.UUID(event["task_id"])
    factory = lp.wrapper(follow, sleep=ticker.sleep)
    outcome: list[str] = []
    try:
        async with anyio.create_task_group() as group:

            async def run() -> None:
                got = await run_invocation(event, worker_id_for(FUNCTION, "req-1"), factory)
                outcome.append(got["outcome"])

            group.start_soon(run)
            await wait_for(started)
            # The invocation outlived its heartbeat timeout: the reaper retried the
            # task and attempt 2 was claimed elsewhere.
            second = await lp.platform.reclaim(task_id, worker_id_for(FUNCTION, "req-9"))
            ticker.tick()  # the late invocation's next heartbeat is refused
    finally:
        ticker.close()
    assert outcome == ["stale"] and cancelled == [True]
    row = await lp.platform.task(task_id)
    assert second.lease is not None
    assert (row["status"], row["attempt"], row["lease_token"]) == (
        "Running",
        2,
        second.lease.lease_token,
    )
    assert await lp.platform.events_of(task_id) == [("0-9", 1)]
    # A late copy of the original event claims nothing either: attempt 2 holds the lease.
    again = await run_invocation(event, worker_id_for(FUNCTION, "req-4"), lp.wrapper(follow))
    assert again["outcome"] == "AlreadyRunning"


@pytest.mark.parametrize(
    ("event", "field_name", "reason"),
    [
        ([], "event", "not a JSON object"),
        ({}, "event.task_id", "missing"),
        ({"task_id": 7}, "event.task_id", "not a string"),
        ({"task_id": "nope"}, "event.task_id", "not a UUID"),
    ],
    ids=["list", "missing", "number", "not-uuid"],
)
def test_a_malformed_event_names_the_field(event: Any, field_name: str, reason: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        parse_invocation(event)
    assert field_name in str(caught.value) and reason in str(caught.value)


async def test_a_malformed_event_claims_nothing() -> None:
    def refuse(worker_id: str) -> WorkerWrapper:
        raise AssertionError("no wrapper is built for a malformed event")

    with pytest.raises(InvalidInput):
        await run_invocation({"task_id": "x"}, "w", refuse)


GOOD_ENV = {
    "TRACE_API_URL": "https://trace.internal",
    "TRACE_INTERNAL_TOKEN": TOKEN,
    "TRACE_OPERATORS": "tests.test_worker_wrapper:DEPLOYED",
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"TRACE_API_URL": ""}, "TRACE_API_URL: required"),
        ({"TRACE_INTERNAL_TOKEN": " "}, "TRACE_INTERNAL_TOKEN: required"),
        ({"TRACE_OPERATORS": ""}, "TRACE_OPERATORS: required"),
        ({"TRACE_API_URL": "trace.internal"}, "TRACE_API_URL: must be an http"),
        ({"TRACE_LAMBDA_TIMEOUT_SECONDS": "soon"}, "TRACE_LAMBDA_TIMEOUT_SECONDS: not a number"),
        ({"TRACE_LAMBDA_TIMEOUT_SECONDS": "0"}, "TRACE_LAMBDA_TIMEOUT_SECONDS: must be > 0"),
    ],
    ids=["no-url", "no-token", "no-operators", "bad-url", "bad-timeout", "zero-timeout"],
)
def test_settings_errors_name_the_variable(change: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message) as caught:
        LambdaHandlerSettings.from_env({**GOOD_ENV, **change})
    assert TOKEN not in str(caught.value)


def test_settings_are_read_and_the_token_is_not_in_the_repr() -> None:
    env = {**GOOD_ENV, "TRACE_LAMBDA_TIMEOUT_SECONDS": "30"}
    settings = LambdaHandlerSettings.from_env(env)
    assert (settings.api_url, settings.timeout_seconds) == ("https://trace.internal", 30.0)
    assert TOKEN not in repr(settings)
    assert load_registry(settings.operators, "TRACE_OPERATORS").names() == DEPLOYED.names()


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ("tests.test_worker_wrapper", "expected 'module:attribute'"),
        ("tests.no_such_module:x", "No module named"),
        ("tests.test_worker_wrapper:DAG", "is not an OperatorRegistry"),
    ],
    ids=["no-attribute", "no-module", "not-a-registry"],
)
def test_a_bad_operators_reference_is_a_configuration_error(reference: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message) as caught:
        load_registry(reference, "TRACE_OPERATORS")
    assert str(caught.value).startswith(f"TRACE_OPERATORS {reference!r}")


def test_the_entry_point_refuses_to_run_without_its_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in GOOD_ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigurationError, match="TRACE_API_URL"):
        handler({"task_id": str(uuid.UUID(int=3))}, None)


def test_secrets_come_from_the_environment_but_never_platform_variables() -> None:
    env = {"API_KEY": "k", "AWS_SECRET_ACCESS_KEY": "role-key", "TRACE_INTERNAL_TOKEN": TOKEN}
    secrets = EnvironmentSecrets(env)
    names = ["API_KEY", "AWS_SECRET_ACCESS_KEY", "TRACE_INTERNAL_TOKEN", "ABSENT"]
    assert secrets.secrets_for(names, {}) == {"API_KEY": "k"}
    assert "k" not in repr(secrets).replace("Secrets", "")


def _entry_follow(ctx: TaskContext) -> OperatorResult:
    """The operator the entry-point test's function runs (synchronous, in a thread)."""
    return OperatorResult(outputs=[{"key": ctx.secrets["API_KEY"], "attempt": ctx.attempt}])


ENTRY_OPERATORS = OperatorRegistry(
    [OperatorSpec("follow", _entry_follow, source=True), OperatorSpec("double", _entry_follow)]
)


@dataclass
class FakeContext:
    """The two attributes of Lambda's context object the handler reads."""

    function_name: str = FUNCTION
    aws_request_id: str = "req-entry"


async def test_the_entry_point_runs_the_invocation_against_the_api_over_loopback(
    lp: LambdaPlatform, monkeypatch: pytest.MonkeyPatch
) -> None:
    event = await lp.trigger()
    app = create_app(lp.platform.dispatcher, internal_token=TOKEN)
    monkeypatch.setattr(trace_aws.lambda_handler, "_registry", None)
    monkeypatch.setenv("TRACE_INTERNAL_TOKEN", TOKEN)
    monkeypatch.setenv("TRACE_OPERATORS", "tests.test_aws_lambda:ENTRY_OPERATORS")
    monkeypatch.setenv("API_KEY", "k-env")
    async with serving(app) as url:
        monkeypatch.setenv("TRACE_API_URL", url)
        # Lambda calls the handler synchronously; it runs its own event loop.
        got = await anyio.to_thread.run_sync(handler, event, FakeContext())
    task_id = uuid.UUID(event["task_id"])
    assert got == {"task_id": str(task_id), "outcome": "completed"}
    row = await lp.platform.task(task_id)
    assert row["status"] == "Completed"
    assert row["outputs"] == [{"key": "k-env", "attempt": 1}]
    assert row["worker_id"] == f"lambda:{FUNCTION}:req-entry"


def test_the_handler_loads_no_database_code() -> None:
    """The function's image needs no state-database driver and no control-plane code."""
    probe = (
        "import sys, trace_aws.lambda_handler\n"
        "bad = ('sqlalchemy', 'alembic', 'asyncpg', 'psycopg', 'aiosqlite', 'trace_lite',\n"
        "       'trace_core.storage', 'trace_core.dispatcher', 'trace_core.api')\n"
        "print(sorted(m for m in sys.modules if m.startswith(bad)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]", done.stdout
