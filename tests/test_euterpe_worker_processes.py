"""Concurrency parity (euterpe-contract.md §13) with real worker processes:
three OS processes run the Euterpe worker (no-op processor, lite store) on
one SQLite file and on one Postgres; one is SIGKILLed mid-job. Every job
succeeds exactly once in the ledger (its ``uploading -> succeeded`` history
rows), claims are exclusive (no claim_version granted twice), the killed
worker's lease is reclaimed with a new claim_version, and its stale fence
is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import anyio
import pytest

from tests.euterpe_worker_fixtures import BUCKET, REQUESTER, SOURCE
from tests.euterpe_worker_process import LEASE_SECONDS
from tests.factories import wait_until
from trace_core.errors import StaleClaim
from trace_core.euterpe.credentials import CredentialVault, StorageCredentials
from trace_core.euterpe.job_maintenance import InboxMaintenance
from trace_core.euterpe.jobs import InboxJobs, JobsConfig
from trace_core.model import Fence
from trace_core.retry import Backoff, RetryPolicy
from trace_core.security.minting import LocalCredentialMinter
from trace_core.security.scopes import S3Prefix, Scope
from trace_core.storage.sql import SqlRepository
from trace_lite.envelope import LocalKeyEncryption
from trace_lite.object_store import LocalObjectStore

pytestmark = pytest.mark.anyio

JOBS = 10
WORKERS = 3
BOUND = 90.0


async def test_worker_processes_succeed_each_job_once_despite_a_sigkill(
    database_url: str, repo: SqlRepository, tmp_path: Path
) -> None:
    kek, minter_key = os.urandom(32), os.urandom(32)
    minter = LocalCredentialMinter(minter_key)
    root = tmp_path / "store"
    store = LocalObjectStore(root, minter)
    admin = await minter.mint(
        Scope(write=(S3Prefix.parse(f"s3://{BUCKET}/in/"),)),
        session_name="admin",
        duration_seconds=3600,
    )
    store.handle(admin).put(SOURCE, b"source bytes " * 50)
    vault = CredentialVault({"k1": LocalKeyEncryption(kek)}, active="k1")
    jobs = InboxJobs(
        repo,
        config=JobsConfig(lease_seconds=LEASE_SECONDS, max_attempts=5),
        retry=RetryPolicy(normal=Backoff(base_seconds=0.05, cap_seconds=0.05, jitter=0.0)),
    )
    ids = []
    for _ in range(JOBS):
        job_id = uuid.uuid4()
        prefix = f"s3://{BUCKET}/out/{job_id}/"
        minted = await minter.mint(
            Scope(read=(S3Prefix.parse(f"s3://{BUCKET}/in/"),), write=(S3Prefix.parse(prefix),)),
            session_name="job",
            duration_seconds=3600,
        )
        creds = StorageCredentials(
            minted.access_key_id, minted.secret_access_key, minted.session_token
        )
        sealed = vault.seal(creds, job_id=job_id, requester_id=REQUESTER, credential_version=0)
        request = {"source": SOURCE, "output_prefix": prefix, "presets": ["mp4-h264-360p"]}
        ids.append(
            await jobs.enqueue(
                requester_id=REQUESTER, request=request, job_id=job_id, sealed=sealed
            )
        )

    environ = {
        **os.environ,
        "EUTERPE_TEST_KEK": kek.hex(),
        "EUTERPE_TEST_MINTER": minter_key.hex(),
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
    }
    reports = [tmp_path / f"report-{i}.txt" for i in range(WORKERS)]
    procs = [
        await anyio.open_process(
            [
                sys.executable,
                "-m",
                "tests.euterpe_worker_process",
                database_url,
                str(root),
                str(reports[i]),
                f"proc-{i}",
            ],
            env=environ,
            stdin=subprocess.DEVNULL,
            stdout=None,
            stderr=None,
        )
        for i in range(WORKERS)
    ]
    maintenance = InboxMaintenance(jobs)
    try:
        deadline = time.monotonic() + BOUND
        await wait_until(
            "worker 0 processing a job",
            lambda: reports[0].exists() and reports[0].read_text().strip() != "",
            deadline,
            describe=lambda: [p.returncode for p in procs],
        )
        procs[0].send_signal(signal.SIGKILL)
        with anyio.fail_after(10):
            await procs[0].wait()
        job_text, attempt, token, version = reports[0].read_text().split("\n")[-2].split()
        killed = Fence(uuid.UUID(job_text), int(attempt), uuid.UUID(token), int(version))

        async def all_done() -> bool:
            await maintenance.reclaim_expired()
            await maintenance.requeue_due()
            statuses = [(await jobs.status(i)).status for i in ids]
            return all(s == "succeeded" for s in statuses)

        async def describe() -> str:
            return str(Counter([(await jobs.status(i)).status for i in ids]))

        await wait_until("every job succeeded", all_done, deadline, describe=describe)
    finally:
        with anyio.CancelScope(shield=True), anyio.fail_after(20):
            for proc in procs:
                if proc.returncode is None:
                    proc.terminate()
            for proc in procs:
                await proc.wait()

    for job_id in ids:
        status = await jobs.status(job_id)
        steps = [(h.from_status, h.to_status) for h in status.history]
        assert steps.count(("uploading", "succeeded")) == 1, steps  # once in the ledger
        claims = [h.claim_version for h in status.history if h.to_status == "claimed"]
        assert len(claims) == len(set(claims)), claims  # no claim granted twice
    # the killed worker's claim was reclaimed and a later claim finished the job
    after = await jobs.status(killed.item_id)  # type: ignore[arg-type]
    assert after.error is None and after.status == "succeeded"
    reasons = [h.reason for h in after.history]
    assert "lease_expired" in reasons
    final_claim = max(h.claim_version for h in after.history)
    assert final_claim > (killed.claim_version or 0)
    with pytest.raises(StaleClaim):  # the dead worker's fence writes nothing
        await jobs.advance(killed, "processing")
    assert (await jobs.status(killed.item_id)).history == after.history  # type: ignore[arg-type]
