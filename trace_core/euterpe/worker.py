"""The Euterpe worker service: claims inbox jobs and runs them (issue 16, "Workers").

:class:`EuterpeWorker` is a service in the house shape: :meth:`run_once`
claims up to its free slots of queued jobs (at most ``batch_size``) and works
them to their end, concurrently (:class:`~trace_core.euterpe.worker_job.JobRun`
drives each through ``fetching -> processing -> uploading -> succeeded``);
:meth:`run` keeps every slot busy, claiming again as soon as a job ends
and polling with jitter when nothing was there;
:meth:`start` / :meth:`stop` run it in a task group. Stopping interrupts the
jobs in hand (their processors are stopped, ffmpeg killed) and hands them
back to ``queued`` without spending their attempt. The clock is the
lifecycle's (:class:`~trace_core.euterpe.jobs.InboxJobs`), injected; the
worker's id follows §2 (``POD_NAME`` -> ``HOSTNAME`` -> boot UUID) unless given.
"""

from __future__ import annotations

import logging
import random

import anyio
import anyio.abc

from trace_core.errors import ConfigurationError
from trace_core.euterpe.worker_job import JobOutcome, JobRun, WorkerParts
from trace_core.identity import worker_id as default_worker_id
from trace_core.outage import LoopHealth

__all__ = ["EuterpeWorker"]

_log = logging.getLogger(__name__)


class EuterpeWorker:
    """Claims and runs inbox jobs (see the module docstring)."""

    def __init__(
        self,
        parts: WorkerParts,
        *,
        worker_id: str | None = None,
        rng: random.Random | None = None,
    ) -> None:
        lease = parts.jobs.config.lease_seconds
        if parts.config.heartbeat_seconds >= lease:
            raise ConfigurationError(
                f"WorkerConfig.heartbeat_seconds must be shorter than the lease ({lease:g} s)"
            )
        self.parts = parts
        self.config = parts.config
        self.worker_id = worker_id or default_worker_id()
        self.rng = rng or random.Random()
        self.clock = parts.jobs.clock
        self.health = LoopHealth(type(self).__name__, logger=_log)
        self._slots = anyio.CapacityLimiter(self.config.concurrency)
        self._running: set[JobRun] = set()
        self._stop_requested = False
        self._wake_requested = False
        self._waiting: anyio.CancelScope | None = None
        self._stopped: anyio.Event | None = None

    def stopping(self) -> bool:
        """Whether :meth:`stop` was called (a call: it changes while the loop awaits)."""
        return self._stop_requested

    @property
    def active(self) -> int:
        """Jobs in hand right now."""
        return len(self._running)

    def _free(self) -> int:
        """Jobs one claim may take now: the free slots, at most a batch."""
        return max(0, min(self.config.batch_size, self.config.concurrency - len(self._running)))

    async def _claim(self) -> list[JobRun]:
        leases = await self.parts.jobs.claim_batch(self.worker_id, self._free())
        return [JobRun(self.parts, lease, slots=self._slots) for lease in leases]

    async def _work(self, run: JobRun, outcomes: list[JobOutcome] | None = None) -> None:
        self._running.add(run)
        try:
            if self._stop_requested:
                run.interrupt()
            outcome = await run.execute()
            if outcomes is not None:
                outcomes.append(outcome)
        finally:
            self._running.discard(run)
            self.wake()  # a slot is free: claim again now

    async def run_once(self) -> list[JobOutcome]:
        """Claim up to the free slots of jobs and work them to their end; how
        each ended (what tests call; :meth:`run` refills slots as they free)."""
        if self._stop_requested or self._free() == 0:
            return []
        outcomes: list[JobOutcome] = []
        async with anyio.create_task_group() as group:
            for run in await self._claim():
                group.start_soon(self._work, run, outcomes)
        return outcomes

    async def run(self) -> None:
        """Until :meth:`stop`: claim into every free slot and start the jobs;
        claim again as soon as a job ends, wait a jittered poll interval when
        nothing was there, back off after a failing claim."""
        self._stopped = anyio.Event()
        self.health.running = True
        try:
            async with anyio.create_task_group() as group:
                while not self.stopping():
                    # cleared before the claim: a job ending meanwhile is not missed
                    self._wake_requested = False
                    failure: Exception | None = None
                    runs: list[JobRun] = []
                    if self._free() > 0:
                        try:
                            runs = await self._claim()
                            self.health.succeeded()
                        except Exception as exc:
                            failure = exc
                    for run in runs:
                        group.start_soon(self._work, run)
                    if self.stopping():
                        break
                    if runs and self._free() > 0:
                        continue  # there may be more to claim
                    if self._wake_requested and self._free() > 0 and failure is None:
                        continue
                    with anyio.CancelScope() as self._waiting:
                        if failure is not None:
                            await self.health.backoff_after(failure)
                        elif self._free() == 0:
                            await anyio.sleep_forever()  # until a job ends (wake)
                        else:
                            wait = self.rng.uniform(
                                self.config.poll_min_seconds, self.config.poll_max_seconds
                            )
                            await anyio.sleep(wait)
                    self._waiting = None
        finally:
            self.health.running = False
            self._stopped.set()

    def wake(self) -> None:
        """Poll now instead of at the end of the current wait."""
        self._wake_requested = True
        if self._waiting is not None:
            self._waiting.cancel()

    async def start(self, task_group: anyio.abc.TaskGroup) -> None:
        """Run :meth:`run` in ``task_group``."""
        task_group.start_soon(self.run)

    async def stop(self) -> None:
        """Stop polling, interrupt the jobs in hand (handed back to
        ``queued``), and wait for the loop to end if it runs."""
        self._stop_requested = True
        for run in list(self._running):
            run.interrupt()
        self.wake()
        if self._stopped is not None:
            await self._stopped.wait()
