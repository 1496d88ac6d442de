"""Untrusted operators in a child process, on both engines: the child runs
without the wrapper's credentials and cannot call ``/internal/*``; it emits
and completes through the wrapper; it is killed on a stale lease or a
timeout; its failures are reported."""

from __future__ import annotations

import hashlib
import os
import socket
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tests import udf_operators
from tests.test_worker_wrapper import (
    DAG,
    DEPLOYED,
    FlakyClient,
    Platform,
    Ticker,
    deploy_platform,
    wait_for,
)
from trace_core.api import create_app
from trace_core.authoring.context import CAPABILITY_TOKEN_ENV, StaticSecrets, declared_secrets
from trace_core.authoring.events import AcceptResult
from trace_core.authoring.operators import OperatorRegistry, OperatorSpec
from trace_core.clock import ManualClock
from trace_core.dag import parse_dag
from trace_core.dispatcher.inprocess import InProcessWakeupQueue
from trace_core.dispatcher.inprocess_client import InProcessClient
from trace_core.dispatcher.service import Dispatcher
from trace_core.errors import ConfigurationError
from trace_core.storage.sql import SqlRepository
from trace_core.worker import (
    ClaimResult,
    ControlPlaneClient,
    HttpControlPlaneClient,
    UdfConfig,
    UdfOperator,
    WorkerWrapper,
    child_environment,
)

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[1]
UDF = UdfConfig(pythonpath=[str(ROOT)])
TOKEN = "udf-isolation-internal-token-0123456789"
CAPABILITY = "capability-token-for-this-attempt"
SECRETS = {"API_KEY": "k-123", "OTHER_SECRET": "undeclared-must-not-leak"}


def _sha256(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def _dag(**config: str) -> str:
    """The shared DAG with ``config`` added to ``follow``'s (paths, URLs)."""
    extra = "".join(f', {k}: "{v}"' for k, v in config.items())
    return DAG.replace(
        "config: { n: 2, secrets: [API_KEY] }", f"config: {{ n: 2, secrets: [API_KEY]{extra} }}"
    )


def _udf_wrapper(
    platform: Platform, function: str, *, client: ControlPlaneClient | None = None, **kwargs: Any
) -> WorkerWrapper:
    kwargs.setdefault("sleep", _no_heartbeat)
    return WorkerWrapper(
        client or InProcessClient(platform.control),
        OperatorRegistry([OperatorSpec("follow", UdfOperator(f"tests.udf_operators:{function}"))]),
        worker_id="udf-worker",
        secrets=SECRETS,
        udf=UDF,
        clock=platform.clock,
        **kwargs,
    )


async def _no_heartbeat(seconds: float) -> None:
    await anyio.sleep_forever()


@pytest.fixture
def ticker() -> Iterator[Ticker]:
    ticks = Ticker()
    yield ticks
    ticks.close()


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """The app on a loopback port, in this event loop; its base URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)  # connections queue here until the server accepts them
    config = uvicorn.Config(
        app, lifespan="off", log_config=None, access_log=False, ws="none", http="h11"
    )
    server = uvicorn.Server(config)
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(server.serve, [sock])
            try:
                yield f"http://127.0.0.1:{sock.getsockname()[1]}"
            finally:
                server.should_exit = True
    finally:
        sock.close()


class Issuing(HttpControlPlaneClient):
    """The Dispatcher as it will be: the claimed payload carries a capability token."""

    async def claim(self, task_id: uuid.UUID, worker_id: str) -> ClaimResult:
        claimed = await super().claim(task_id, worker_id)
        if claimed.task is None:
            return claimed
        return replace(claimed, task={**claimed.task, "capability_token": CAPABILITY})


# --- the boundary ------------------------------------------------------------------


async def test_a_udf_child_has_no_platform_credentials_and_cannot_call_internal(
    repo: SqlRepository,
    clock: ManualClock,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The wrapper's own environment holds the platform's credentials...
    monkeypatch.setenv("TRACE_INTERNAL_TOKEN", TOKEN)
    monkeypatch.setenv("TRACE_DATABASE_URL", database_url)
    monkeypatch.setenv("OTHER_SECRET", SECRETS["OTHER_SECRET"])

    async def scoped(payload: Mapping[str, Any]) -> Mapping[str, str]:
        return {"AWS_ACCESS_KEY_ID": f"scoped-to-{payload['task_id']}"}

    wakeups = InProcessWakeupQueue()
    dispatcher = Dispatcher(repo, operators=DEPLOYED, clock=clock, wakeups=wakeups)
    app = create_app(dispatcher, internal_token=os.environ["TRACE_INTERNAL_TOKEN"])
    async with serving(app) as url:
        deployed = await dispatcher.deploy(
            parse_dag(_dag(probe_url=url), operators=DEPLOYED.names())
        )
        platform = Platform(dispatcher, deployed, clock, wakeups)
        # ...and talks to the Dispatcher over real HTTP with them.
        async with Issuing(url, os.environ["TRACE_INTERNAL_TOKEN"]) as client:
            wrapper = _udf_wrapper(platform, "probe", client=client, credentials=scoped)
            task_id = await platform.trigger()
            assert await wrapper.handle_wakeup(task_id) == "completed"
            # The probe's requests were well-formed: with the token they get through.
            async with httpx.AsyncClient(base_url=url) as control:
                fetched = await control.get(
                    "/internal/task-fetch",
                    params={"task_id": str(task_id)},
                    headers={"Authorization": f"Bearer {TOKEN}"},
                )
                assert fetched.status_code == 200

    row = await platform.task(task_id)
    (found,) = row["outputs"]
    inherited = {k for k in ("PATH", "HOME", "LANG") if k in os.environ}
    assert set(found["env"]) == inherited | {
        "PYTHONPATH",
        CAPABILITY_TOKEN_ENV,
        "API_KEY",
        "AWS_ACCESS_KEY_ID",
    }
    assert found["internal_token"] is None and found["database_url"] is None
    assert found["undeclared_secret"] is None
    assert found["api_key_sha256"] == _sha256("k-123") == found["api_key_via_context"]
    assert found["capability_token_sha256"] == _sha256(CAPABILITY)
    assert TOKEN not in " ".join(found["argv"]) and database_url not in " ".join(found["argv"])
    assert found["tried"] >= 6
    assert found["statuses"] == [401]  # /internal/* refused whatever it presented
    assert found["pid"] != os.getpid() and found["cwd"] != os.getcwd()
    assert not await anyio.Path(found["cwd"]).exists()  # the scratch directory is gone


def test_the_child_environment_is_built_from_an_allow_list() -> None:
    base = {
        "PATH": "/usr/bin",
        "HOME": "/home/w",
        "LANG": "C.UTF-8",
        "PYTHONPATH": "/app",
        "TRACE_INTERNAL_TOKEN": TOKEN,
        "TRACE_DATABASE_URL": "postgresql://trace@db/trace",
        "AWS_SECRET_ACCESS_KEY": "the wrapper's own",
        "LD_PRELOAD": "/evil.so",
    }
    env = child_environment(
        capability_token="cap",
        secrets={"API_KEY": "k"},
        credentials={"AWS_SESSION_TOKEN": "scoped"},
        pythonpath=None,
        base=base,
    )
    assert env == {
        "PATH": "/usr/bin",
        "HOME": "/home/w",
        "LANG": "C.UTF-8",
        "PYTHONPATH": "/app",
        CAPABILITY_TOKEN_ENV: "cap",
        "API_KEY": "k",
        "AWS_SESSION_TOKEN": "scoped",
    }
    for name in ("TRACE_INTERNAL_TOKEN", "TRACE_DATABASE_URL", "LD_PRELOAD", "PYTHONPATH", "low"):
        with pytest.raises(ConfigurationError):
            declared_secrets({"secrets": [name]})
    with pytest.raises(ConfigurationError, match="set twice"):
        child_environment(
            capability_token=None,
            secrets={"API_KEY": "k"},
            credentials={"API_KEY": "c"},
            pythonpath=[],
            base=base,
        )
    with pytest.raises(ConfigurationError):
        UdfOperator("no_function_here")
    assert "k-123" not in repr(StaticSecrets(SECRETS))


# --- running in the child ------------------------------------------------------------


@pytest.fixture
async def platform(repo: SqlRepository, clock: ManualClock, tmp_path: Path) -> Platform:
    return await deploy_platform(repo, clock, _dag(pid_file=str(tmp_path / "udf.pid")))


async def test_a_udf_emits_and_completes_through_the_wrapper(platform: Platform) -> None:
    wrapper = _udf_wrapper(platform, "relay")
    task_id = await platform.trigger()
    assert await wrapper.handle_wakeup(task_id) == "completed"
    row = await platform.task(task_id)
    (out,) = row["outputs"]
    assert out["pid"] != os.getpid() and out["new"] == 1 and out["directive"] == "run"
    assert out["undeclared"] is None
    assert await platform.events_of(task_id) == [("0-9", 1), ("10-19", 1)]
    await platform.dispatcher.run_once()
    assert len(await platform.tasks_of("double")) == 2


async def test_an_operator_named_untrusted_runs_in_the_child(platform: Platform) -> None:
    wrapper = WorkerWrapper(
        InProcessClient(platform.control),
        OperatorRegistry([OperatorSpec("follow", udf_operators.async_relay)]),
        worker_id="w",
        secrets=SECRETS,
        untrusted={"follow"},
        udf=UDF,
        sleep=_no_heartbeat,
    )
    task_id = await platform.trigger()
    assert await wrapper.handle_wakeup(task_id) == "completed"
    (out,) = (await platform.task(task_id))["outputs"]
    assert out["pid"] != os.getpid()


@pytest.mark.parametrize(
    ("function", "message", "retrying"),
    [
        ("refuse", "UDF tests.udf_operators:refuse: _BadInput: row 7 is malformed", False),
        ("crash", "UDF tests.udf_operators:crash exited (3) without a result: dying words", True),
        ("bad_emit", "is not an output of the producing task's job", False),
    ],
)
async def test_udf_failures_are_reported(
    platform: Platform, function: str, message: str, retrying: bool
) -> None:
    wrapper = _udf_wrapper(platform, function)
    task_id = await platform.trigger()
    assert await wrapper.handle_wakeup(task_id) == "failed"
    row = await platform.task(task_id)
    assert message in row["error_message"]
    assert (row["next_retry_at"] is not None) is retrying
    assert await platform.events_of(task_id) == []


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


class SpyClient(FlakyClient):
    """Passes every call through; says when an emit was accepted."""

    def __init__(self, inner: ControlPlaneClient) -> None:
        super().__init__(inner, {})
        self.emitted = anyio.Event()

    async def emit(self, task_id: uuid.UUID, attempt: int, events: Any) -> AcceptResult:
        accepted = await super().emit(task_id, attempt, events)
        self.emitted.set()
        return accepted


async def test_a_stale_lease_kills_the_child(
    platform: Platform, ticker: Ticker, tmp_path: Path
) -> None:
    spy = SpyClient(InProcessClient(platform.control))
    wrapper = _udf_wrapper(platform, "linger", client=spy, sleep=ticker.sleep)
    task_id = await platform.trigger()
    outcome: list[str] = []
    async with anyio.create_task_group() as group:

        async def run() -> None:
            outcome.append(await wrapper.handle_wakeup(task_id))

        group.start_soon(run)
        await wait_for(spy.emitted)  # the child runs
        await platform.dispatcher.tasks.cancel([task_id])
        ticker.tick()  # the heartbeat is refused: kill
    assert outcome == ["stale"]
    assert _gone(int((tmp_path / "udf.pid").read_text()))
    assert (await platform.task(task_id))["status"] == "Canceled"
    assert await platform.events_of(task_id) == [("0-9", 1)]


async def test_a_udf_over_its_time_limit_is_killed(platform: Platform, tmp_path: Path) -> None:
    wrapper = _udf_wrapper(platform, "hang", timeout_seconds=4.0)
    task_id = await platform.trigger()
    assert await wrapper.handle_wakeup(task_id) == "failed"
    row = await platform.task(task_id)
    assert row["error_message"] == "timed out after 4.0s" and row["next_retry_at"] is not None
    pid_file = tmp_path / "udf.pid"
    if pid_file.exists():  # the child got as far as running the UDF
        assert _gone(int(pid_file.read_text()))
