"""A Euterpe worker run as an OS process by ``tests/test_euterpe_worker_processes.py``.

``python -m tests.euterpe_worker_process DB_URL STORE_ROOT REPORT WORKER_ID``
runs an :class:`~trace_core.euterpe.worker.EuterpeWorker` with the no-op
processor on the lite store until it is killed. Keys come from the
environment (``EUTERPE_TEST_KEK``, ``EUTERPE_TEST_MINTER``, hex), so the
parent seals and mints what these workers open. Before each processing run
the worker appends ``job attempt lease_token claim_version`` to ``REPORT``
(flushed and synced: the parent SIGKILLs a worker right after reading it),
then pauses a moment so that the kill lands mid-job.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio

from trace_core.euterpe.copy_processor import CopyProcessor
from trace_core.euterpe.credentials import CredentialVault
from trace_core.euterpe.jobs import InboxJobs, JobsConfig
from trace_core.euterpe.presets import Preset
from trace_core.euterpe.processor import ProducedOutput
from trace_core.euterpe.worker import EuterpeWorker
from trace_core.euterpe.worker_config import WorkerConfig
from trace_core.euterpe.worker_job import WorkerParts
from trace_core.model import Lease
from trace_core.security.minting import LocalCredentialMinter
from trace_core.storage.sql import SqlRepository
from trace_lite.envelope import LocalKeyEncryption
from trace_lite.euterpe_storage import LiteTranscodeStorage
from trace_lite.object_store import LocalObjectStore

LEASE_SECONDS = 2.0
PAUSE_SECONDS = 0.3


class FenceKeepingJobs(InboxJobs):
    """The lifecycle, remembering each claim's fence for the report."""

    fences: dict[str, str]

    async def claim_batch(self, worker_id: str, limit: int) -> list[Lease]:
        leases = await super().claim_batch(worker_id, limit)
        for lease in leases:
            self.fences[str(lease.item_id)] = (
                f"{lease.item_id} {lease.attempt} {lease.lease_token} {lease.claim_version}"
            )
        return leases


class ReportingProcessor(CopyProcessor):
    """The no-op processor, announcing each run in the report file first."""

    def __init__(self, report: Path, fences: dict[str, str]) -> None:
        self.report = report
        self.fences = fences

    async def process(
        self, source: Path, presets: Sequence[Preset], output_dir: Path, stop: anyio.Event
    ) -> list[ProducedOutput]:
        job = output_dir.parent.name.split("-", 1)[1][:36]
        with self.report.open("a") as fh:
            fh.write(f"{self.fences.get(job, job)}\n")
            fh.flush()
            os.fsync(fh.fileno())
        await anyio.sleep(PAUSE_SECONDS)
        return await super().process(source, presets, output_dir, stop)


async def main(url: str, root: str, report: str, worker_id: str) -> None:
    repo = SqlRepository(url)
    fences: dict[str, str] = {}
    jobs = FenceKeepingJobs(repo, config=JobsConfig(lease_seconds=LEASE_SECONDS))
    jobs.fences = fences
    minter = LocalCredentialMinter(bytes.fromhex(os.environ["EUTERPE_TEST_MINTER"]))
    kek = LocalKeyEncryption(bytes.fromhex(os.environ["EUTERPE_TEST_KEK"]))
    parts = WorkerParts(
        jobs=jobs,
        vault=CredentialVault({"k1": kek}, active="k1"),
        storage=LiteTranscodeStorage(LocalObjectStore(root, minter)),
        processor=ReportingProcessor(Path(report), fences),
        config=WorkerConfig(
            poll_min_seconds=0.05, poll_max_seconds=0.1, heartbeat_seconds=0.4, batch_size=2
        ),
    )
    worker = EuterpeWorker(parts, worker_id=worker_id)
    try:
        await worker.run()
    finally:
        await repo.close()


if __name__ == "__main__":
    anyio.run(main, *sys.argv[1:5])
