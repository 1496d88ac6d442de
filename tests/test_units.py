"""Pure units: lifecycles, retry policy, URLs, identity, clock, public API."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

import trace_core
from trace_core.clock import ManualClock
from trace_core.errors import ConfigurationError, InvalidTransition
from trace_core.identity import boot_id, worker_id
from trace_core.retry import Backoff, RetryClass, RetryPolicy
from trace_core.states import INBOX_LIFECYCLE, OUTBOX_LIFECYCLE, TASK_LIFECYCLE, Lifecycle
from trace_core.storage.url import parse_database_url

NOW = datetime(2026, 1, 1, tzinfo=UTC)


# --- lifecycles -------------------------------------------------------------


def test_inbox_table_is_exactly_the_contract() -> None:
    leased = ["claimed", "fetching", "processing", "uploading"]
    expected = {
        ("queued", "claimed"),
        ("claimed", "fetching"),
        ("fetching", "processing"),
        ("processing", "uploading"),
        ("uploading", "succeeded"),
        *((s, "queued") for s in leased),
        *((s, "failed") for s in leased),
        ("failed", "queued"),
        ("failed", "dead_letter"),
    }
    assert INBOX_LIFECYCLE.edges == expected


@pytest.mark.parametrize(
    ("lifecycle", "source", "target"),
    [
        (INBOX_LIFECYCLE, "queued", "processing"),
        (INBOX_LIFECYCLE, "succeeded", "queued"),
        (INBOX_LIFECYCLE, "dead_letter", "queued"),
        (INBOX_LIFECYCLE, "queued", "dead_letter"),
        (TASK_LIFECYCLE, "Completed", "Running"),
        (TASK_LIFECYCLE, "Queued", "Failed"),
        (TASK_LIFECYCLE, "Canceled", "Queued"),
        (OUTBOX_LIFECYCLE, "Done", "Pending"),
    ],
)
def test_transitions_outside_the_table_are_rejected(
    lifecycle: Lifecycle, source: str, target: str
) -> None:
    with pytest.raises(InvalidTransition, match=f"'{source}' -> '{target}'"):
        lifecycle.check(source, target, item_id="x")


def test_unknown_status_names_the_lifecycle() -> None:
    with pytest.raises(ValueError, match="task: unknown status 'Running!'"):
        TASK_LIFECYCLE.check("Queued", "Running!")


def test_terminal_statuses_have_no_way_out() -> None:
    for lifecycle in (TASK_LIFECYCLE, INBOX_LIFECYCLE, OUTBOX_LIFECYCLE):
        for src, _dst in lifecycle.edges:
            assert src not in lifecycle.terminal, (lifecycle.name, src)


def test_lifecycle_refuses_unknown_statuses_in_edges() -> None:
    with pytest.raises(ValueError, match="terminal"):
        Lifecycle.build("x", terminal={"nowhere"}, edges=[("a", "b")])


# --- retry ------------------------------------------------------------------


@given(st.integers(min_value=1, max_value=200), st.integers(min_value=0, max_value=2**32))
def test_backoff_stays_within_its_bounds(retry_number: int, seed: int) -> None:
    b = Backoff(base_seconds=1, factor=2, cap_seconds=300, jitter=0.5)
    delay = b.delay(retry_number, random.Random(seed)).total_seconds()
    ceiling = min(300, 2 ** (retry_number - 1))
    assert ceiling * 0.5 <= delay <= ceiling


def test_backoff_grows_exponentially_without_jitter() -> None:
    b = Backoff(base_seconds=1, factor=2, cap_seconds=10, jitter=0)
    assert [b.delay(n).total_seconds() for n in range(1, 6)] == [1, 2, 4, 8, 10]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"base_seconds": 0}, "base_seconds"),
        ({"factor": 0.5}, "factor"),
        ({"base_seconds": 5, "cap_seconds": 1}, "cap_seconds"),
        ({"jitter": 2}, "jitter"),
    ],
)
def test_backoff_settings_are_validated(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigurationError, match=field):
        Backoff(**kwargs)


@pytest.mark.parametrize(
    ("status", "klass"),
    [
        (423, RetryClass.RETRYABLE),
        (500, RetryClass.RETRYABLE),
        (502, RetryClass.RETRYABLE),
        (503, RetryClass.RETRYABLE),
        (504, RetryClass.RETRYABLE),
        (429, RetryClass.THROTTLED),
        (401, RetryClass.CREDENTIAL_REFRESH),
        (403, RetryClass.CREDENTIAL_REFRESH),
        (400, RetryClass.FATAL),
        (404, RetryClass.FATAL),
        (501, RetryClass.FATAL),
    ],
)
def test_retry_classes_of_the_contract(status: int, klass: RetryClass) -> None:
    assert RetryPolicy().classify(status) is klass


def test_retry_decisions() -> None:
    policy = RetryPolicy(
        normal=Backoff(base_seconds=1, cap_seconds=1, jitter=0),
        throttled=Backoff(base_seconds=30, cap_seconds=30, jitter=0),
        max_credential_refreshes=2,
    )
    d = policy.decide(RetryClass.RETRYABLE, attempt=1, max_attempts=3, now=NOW)
    assert d.retry and d.retry_at == NOW + timedelta(seconds=1)
    d = policy.decide(RetryClass.THROTTLED, attempt=1, max_attempts=3, now=NOW)
    assert d.retry_at == NOW + timedelta(seconds=30)
    assert not policy.decide(RetryClass.RETRYABLE, attempt=3, max_attempts=3, now=NOW).retry
    assert not policy.decide(RetryClass.FATAL, attempt=1, max_attempts=3, now=NOW).retry
    # Credential refreshes have their own budget, not the attempt budget.
    refresh = policy.decide(
        RetryClass.CREDENTIAL_REFRESH, attempt=3, max_attempts=3, now=NOW, credential_refreshes=1
    )
    assert refresh.retry
    assert not policy.decide(
        RetryClass.CREDENTIAL_REFRESH, attempt=1, max_attempts=3, now=NOW, credential_refreshes=2
    ).retry
    assert policy.classify(None) is RetryClass.RETRYABLE
    assert policy.classify(None, retryable=False) is RetryClass.FATAL


# --- URLs -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "engine", "driver"),
    [
        ("sqlite:///tmp/x.db", "sqlite", "sqlite+aiosqlite"),
        ("sqlite+aiosqlite:///tmp/x.db", "sqlite", "sqlite+aiosqlite"),
        ("sqlite+pysqlite:///tmp/x.db", "sqlite", "sqlite+aiosqlite"),
        ("postgresql://u:pw@h:5432/db", "postgres", "postgresql+psycopg"),
        ("postgres://u@h/db", "postgres", "postgresql+psycopg"),
        ("postgresql+psycopg://u@h/db", "postgres", "postgresql+psycopg"),
    ],
)
def test_database_urls_are_accepted(raw: str, engine: str, driver: str) -> None:
    url = parse_database_url(raw)
    assert url.engine == engine
    assert url.async_url.drivername == driver


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("mysql://u@h/db", "unsupported scheme"),
        ("postgresql+asyncpg://u@h/db", "driver 'asyncpg'"),
        ("sqlite://", "needs a file path"),
        ("sqlite:///:memory:", "needs a file path"),
        ("not a url", "not a URL"),
    ],
)
def test_bad_database_urls_say_why(raw: str, reason: str) -> None:
    with pytest.raises(ConfigurationError, match=reason):
        parse_database_url(raw)


def test_url_errors_never_show_the_password() -> None:
    with pytest.raises(ConfigurationError) as info:
        parse_database_url("postgresql+asyncpg://u:hunter2@h/db")
    assert "hunter2" not in str(info.value)


# --- identity and clock -----------------------------------------------------


def test_worker_identity_order() -> None:
    assert worker_id({"POD_NAME": "pod-1", "HOSTNAME": "host"}) == "pod-1"
    assert worker_id({"POD_NAME": " ", "HOSTNAME": "host"}) == "host"
    assert worker_id({}) == boot_id()
    assert boot_id().startswith("boot-")


def test_manual_clock() -> None:
    clock = ManualClock(NOW)
    assert clock.advance(5) == NOW + timedelta(seconds=5)
    with pytest.raises(ValueError):
        clock.advance(-1)
    with pytest.raises(ValueError):
        ManualClock(datetime(2026, 1, 1))


# --- public API -------------------------------------------------------------


EXPECTED_CORE_API = {
    "Backoff",
    "ClaimOutcome",
    "Clock",
    "ConfigurationError",
    "DatabaseUnavailable",
    "DuplicateItem",
    "FailOutcome",
    "Fence",
    "INBOX_JOBS",
    "INBOX_LIFECYCLE",
    "IdempotencyConflict",
    "IdempotencyInFlight",
    "IdempotencyStore",
    "InvalidTransition",
    "ItemState",
    "JOB_OUTBOX_EVENTS",
    "JOB_OUTBOX_LIFECYCLE",
    "Lease",
    "LeaseConfig",
    "LeaseQueue",
    "Lifecycle",
    "ManualClock",
    "NotClaimedReason",
    "NotFound",
    "OUTBOX",
    "OUTBOX_LIFECYCLE",
    "OutboxRelay",
    "PermanentFailure",
    "QUEUES",
    "QueueSpec",
    "ReclaimReport",
    "RelayConfig",
    "Replay",
    "RetryClass",
    "RetryDecision",
    "RetryPolicy",
    "StaleClaim",
    "StorageError",
    "SystemClock",
    "TASKS",
    "TASK_LIFECYCLE",
    "TaskQueue",
    "TraceError",
    "request_fingerprint",
    "worker_id",
}


def test_public_api_is_what_we_export() -> None:
    assert set(trace_core.__all__) == EXPECTED_CORE_API
    assert len(trace_core.__all__) == len(EXPECTED_CORE_API)
    for name in trace_core.__all__:
        assert hasattr(trace_core, name), name


def test_core_import_stays_light() -> None:
    import subprocess
    import sys

    code = (
        "import sys, trace_core; "
        "heavy = [m for m in ('pyspark', 'boto3', 'psycopg', 'trace_lite', 'trace_aws') "
        "if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_authoring_exports_what_an_operator_author_needs() -> None:
    import trace_core.authoring as authoring

    assert set(authoring.__all__) == {
        "CAPABILITY_TOKEN_ENV",
        "AcceptResult",
        "AttemptControl",
        "DatasetEvent",
        "OperatorError",
        "OperatorRegistry",
        "OperatorResult",
        "OperatorSpec",
        "SecretProvider",
        "StaticSecrets",
        "TaskContext",
        "TaskPayload",
        "declared_secrets",
        "parse_events",
    }
    for name in authoring.__all__:
        assert getattr(authoring, name) is not None


@pytest.mark.parametrize(
    "statement",
    [
        "import trace_core",
        "from trace_core.authoring import DatasetEvent, OperatorSpec, TaskContext",
        "import trace_core.worker.udf_child",
    ],
)
def test_the_author_api_and_the_udf_child_load_no_heavy_package(statement: str) -> None:
    import subprocess
    import sys

    heavy = ("sqlalchemy", "alembic", "fastapi", "pyspark", "boto3", "trace_lite", "trace_aws")
    code = f"import sys; {statement}; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_lazy_export_resolves_to_the_object_not_a_submodule() -> None:
    import subprocess
    import sys

    # trace_core.dag.deploy is both a submodule and the function the package exports.
    code = (
        "import trace_core.dag.deploy, trace_core.dag as dag, types; "
        "print(isinstance(dag.deploy, types.FunctionType))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_dispatcher_exports_resolve_and_stay_light() -> None:
    import subprocess
    import sys

    import trace_core.dispatcher as dispatcher

    assert len(set(dispatcher.__all__)) == len(dispatcher.__all__)
    for name in dispatcher.__all__:
        assert hasattr(dispatcher, name), name
    code = (
        "import sys, trace_core.dispatcher; "
        "print([m for m in ('pyspark', 'boto3', 'trace_lite', 'trace_aws') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
