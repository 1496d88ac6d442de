"""``trace-lite euterpe …`` (issue 16, "Commands"), on both engines: ``serve``
and ``worker`` as real processes carrying a job from ``POST /transcode`` to
``succeeded`` and stopping cleanly on SIGTERM; ``key create`` printing the
key once with the webhook secret; ``credentials``; ``rewrap`` moving sealed
credentials to a new KEK; and usage errors naming the option."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tests.test_e2e_http import _free_port
from trace_core.euterpe.api_keys import ApiKeys
from trace_core.euterpe.credentials import StorageCredentials, open_job_credentials
from trace_core.euterpe.jobs import InboxJobs
from trace_core.security.webhook_signing import derive_requester_secret
from trace_core.storage.sql import SqlRepository
from trace_lite.cli import main
from trace_lite.euterpe_runtime import WEBHOOK_KEY_FILE
from trace_lite.kek_ring import load_credential_vault

DEADLINE_SECONDS = 60.0


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_key_create_prints_the_key_once_and_the_webhook_secret(
    database_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "d"
    code, out, err = _run(
        [
            "euterpe",
            "key",
            "create",
            "--requester",
            "acme",
            "--label",
            "ci",
            "--db",
            database_url,
            "--data-dir",
            str(data),
        ],
        capsys,
    )
    assert code == 0, err
    issued = json.loads(out)
    assert issued["requester_id"] == "acme" and issued["api_key"].startswith("eut_")
    master = (data / WEBHOOK_KEY_FILE).read_bytes()
    assert issued["webhook_secret"] == derive_requester_secret(master, "acme").hex()
    assert "shown this once" in err and issued["api_key"] not in err

    async def authenticate() -> str:
        repo = SqlRepository(database_url)
        try:
            return await ApiKeys(repo).authenticate(issued["api_key"])
        finally:
            await repo.close()

    assert anyio.run(authenticate) == "acme"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["euterpe", "key", "create", "--requester", "a b"], "--requester"),
        (["euterpe", "rewrap", "--kek-id", "kek-2"], "--accept-kek"),
        (["euterpe", "rewrap", "--kek-id", "kek-2", "--accept-kek", "kek-9"], "kek-9.key"),
        (["euterpe", "serve", "--allowed-hosts", " , "], "--allowed-hosts"),
        (["euterpe", "credentials", "--read", "/tmp/x", "--write", "s3://bkt/o/"], "--read"),
        (
            [
                "euterpe",
                "credentials",
                "--read",
                "s3://bkt/i/",
                "--write",
                "s3://bkt/o/",
                "--hours",
                "13",
            ],
            "--hours",
        ),
    ],
)
def test_usage_errors_name_the_option(
    argv: list[str],
    message: str,
    database_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = ["--data-dir", str(tmp_path / "d")]
    if argv[1] != "credentials":
        data += ["--db", database_url]
    code, _, err = _run([*argv, *data], capsys)
    assert code == 2
    assert err.startswith("trace-lite: error:") and message in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["euterpe", "serve", "--port", "0"], "--port must be within 1..65535"),
        (["euterpe", "serve", "--retention-days", "0"], "--retention-days must be > 0"),
        (["euterpe", "worker", "--processor", "gpu"], "--processor"),
        (["euterpe", "serve", "--workers", "-1"], "--workers must be >= 0"),
    ],
)
def test_argument_errors_name_the_option(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_rewrap_moves_sealed_credentials_to_the_new_kek(
    database_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "d"
    old = load_credential_vault(data)  # kek-1, created on first use
    creds = StorageCredentials("AKID", "secret-value-for-rewrap", "token-value")

    async def enqueue() -> uuid.UUID:
        repo = SqlRepository(database_url)
        try:
            job_id = uuid.uuid4()
            sealed = old.seal(creds, job_id=job_id, requester_id="acme", credential_version=0)
            await InboxJobs(repo).enqueue(
                requester_id="acme", request={}, job_id=job_id, sealed=sealed
            )
            return job_id
        finally:
            await repo.close()

    job_id = anyio.run(enqueue)
    argv = ["euterpe", "rewrap", "--kek-id", "kek-2", "--accept-kek", "kek-1"]
    code, out, err = _run([*argv, "--db", database_url, "--data-dir", str(data)], capsys)
    assert code == 0, err
    report = json.loads(out)
    assert (report["active"], report["rewrapped"], report["remaining"]) == (
        "kek-2",
        1,
        {"kek-1": False},
    )
    assert "secret-value-for-rewrap" not in out + err

    async def opened() -> tuple[str, str]:
        repo = SqlRepository(database_url)
        new_only = load_credential_vault(data, active="kek-2")
        try:
            async with repo.read() as tx:
                stored = await tx.inbox_credentials.read(job_id)
            assert stored is not None and stored.sealed is not None
            _, value = await open_job_credentials(repo, new_only, job_id)
            return stored.sealed.kek_id, value.secret_access_key
        finally:
            await repo.close()

    assert anyio.run(opened) == ("kek-2", "secret-value-for-rewrap")
    # Again: nothing left to move.
    code, out, _ = _run([*argv, "--db", database_url, "--data-dir", str(data)], capsys)
    assert code == 0 and json.loads(out)["rewrapped"] == 0


def _start(argv: list[str], cwd: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "trace_lite.cli", *argv],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _until(what: str, check: Any, processes: list[subprocess.Popen[str]]) -> Any:
    deadline = time.monotonic() + DEADLINE_SECONDS
    while time.monotonic() < deadline:
        for process in processes:
            if process.poll() is not None:
                output = process.stdout.read() if process.stdout else ""
                pytest.fail(f"{process.args} exited {process.returncode} before {what}: {output}")
        found = check()
        if found:
            return found
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def test_serve_and_worker_processes_run_a_job_and_stop_on_sigterm(
    database_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "d"
    where = ["--db", database_url, "--data-dir", str(data)]
    code, out, err = _run(["euterpe", "key", "create", "--requester", "acme", *where], capsys)
    assert code == 0, err
    api_key = json.loads(out)["api_key"]
    code, out, err = _run(
        [
            "euterpe",
            "credentials",
            "--data-dir",
            str(data),
            "--read",
            "s3://media/in/",
            "--write",
            "s3://media/out/",
        ],
        capsys,
    )
    assert code == 0, err
    credentials = json.loads(out)
    source = data / "objects" / "media" / "in" / "clip.bin"
    source.parent.mkdir(parents=True)
    source.write_bytes(b"not really a video" * 100)

    port = _free_port()
    serve = _start(["euterpe", "serve", *where, "--port", str(port)], tmp_path)
    worker = _start(
        ["euterpe", "worker", *where, "--processor", "copy", "--concurrency", "1"], tmp_path
    )
    processes = [serve, worker]
    try:
        base = f"http://127.0.0.1:{port}"
        auth = {"Authorization": f"Bearer {api_key}"}

        def up() -> bool:
            try:
                return httpx.get(base + "/openapi.json").status_code == 200
            except httpx.TransportError:
                return False

        _until("the API to answer", up, processes)
        request = {
            "source": "s3://media/in/clip.bin",
            "output_prefix": "s3://media/out/job/",
            "presets": ["mp4-h264-360p"],
            "storage_credentials": credentials,
        }
        posted = httpx.post(
            base + "/transcode", json=request, headers={**auth, "Idempotency-Key": "one"}
        )
        assert posted.status_code == 202, posted.text
        status_url = base + posted.json()["status_url"]

        def succeeded() -> dict[str, Any] | None:
            document: dict[str, Any] = httpx.get(status_url, headers=auth).json()
            return document if document["status"] == "succeeded" else None

        document = _until("the job to succeed", succeeded, processes)
        [output] = document["outputs"]
        assert output["key"] == "s3://media/out/job/mp4-h264-360p.mp4"
        stored = data / "objects" / "media" / "out" / "job" / "mp4-h264-360p.mp4"
        assert stored.read_bytes() == source.read_bytes()
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        outputs = [process.communicate(timeout=30)[0] for process in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs
    for text in outputs:
        assert credentials["secret_access_key"] not in text
        assert credentials["session_token"] not in text
        assert api_key not in text
