"""Timing probes of ``python -m benchmarks.euterpe``: the real Euterpe parts, measured.

Each probe wraps or extends a real part and only adds a stopwatch or a
counter around the real call: :class:`TimedJobs` is the job lifecycle
(:class:`~trace_core.euterpe.jobs.InboxJobs`) timing its claims and state
writes and counting how jobs end; :class:`TimedStorage` the object access
(fetch: size + download; upload); :class:`TimedProcessor` the processor
call; :class:`CountingPoster` the webhook poster, counting 2xx answers.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio

from trace_core.euterpe.credentials import StorageCredentials
from trace_core.euterpe.events import NormalizedError
from trace_core.euterpe.jobs import InboxJobs
from trace_core.euterpe.presets import Preset
from trace_core.euterpe.processor import Processor, ProducedOutput
from trace_core.euterpe.storage_access import StorageHandle, TranscodeStorage
from trace_core.euterpe.webhook_poster import PostResult, WebhookPoster
from trace_core.leasing import FailOutcome
from trace_core.model import Fence, Lease

__all__ = ["CountingPoster", "Stopwatch", "TimedJobs", "TimedProcessor", "TimedStorage"]


class Stopwatch:
    """Seconds spent per step name, summed over calls."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: defaultdict[str, int] = defaultdict(int)

    def add(self, step: str, began: float) -> None:
        """Charge the time since ``began`` (``time.perf_counter()``) to ``step``."""
        self.seconds[step] += time.perf_counter() - began
        self.calls[step] += 1

    def ms(self, step: str) -> float:
        """Milliseconds charged to ``step`` so far."""
        return round(self.seconds.get(step, 0.0) * 1000, 2)


class TimedJobs(InboxJobs):
    """The job lifecycle with a stopwatch on the worker's writes, and a count
    of how jobs end: ``finished`` is set once ``expect``'s number of jobs
    succeeded, or at the first failure or hand-back (the run then fails loudly)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.watch = Stopwatch()
        self.succeeded = 0
        self.failures: list[str] = []
        self.last_success = 0.0
        """``time.perf_counter()`` at the commit of the last success."""
        self._expected = 0
        self.finished = anyio.Event()

    def expect(self, jobs: int) -> None:
        """Count ``jobs`` successes from now on."""
        self.succeeded, self.failures, self._expected = 0, [], jobs
        self.finished = anyio.Event()

    async def claim_batch(self, worker_id: str, limit: int) -> list[Lease]:
        """Timed as ``claim`` (empty rounds included)."""
        began = time.perf_counter()
        try:
            return await super().claim_batch(worker_id, limit)
        finally:
            self.watch.add("claim", began)

    async def advance(self, fence: Fence, stage: str) -> None:
        """Timed as ``state_writes``."""
        began = time.perf_counter()
        try:
            await super().advance(fence, stage)
        finally:
            self.watch.add("state_writes", began)

    async def heartbeat(self, fence: Fence) -> datetime:
        """Timed as ``heartbeat``."""
        began = time.perf_counter()
        try:
            return await super().heartbeat(fence)
        finally:
            self.watch.add("heartbeat", began)

    async def succeed(self, fence: Fence, outputs: Sequence[Mapping[str, Any]]) -> None:
        """Timed as ``state_writes``; counted."""
        began = time.perf_counter()
        try:
            await super().succeed(fence, outputs)
        finally:
            self.watch.add("state_writes", began)
        self.succeeded += 1
        self.last_success = time.perf_counter()
        if self.succeeded >= self._expected:
            self.finished.set()

    async def fail(
        self, fence: Fence, error: NormalizedError, *, http_status: int | None = None
    ) -> FailOutcome:
        """A failure ends the measurement: the benchmark expects none."""
        self.failures.append(f"job {fence.item_id}: {error.code}: {error.message}")
        self.finished.set()
        return await super().fail(fence, error, http_status=http_status)

    async def release(
        self, fence: Fence, *, reason: str, available_at: datetime | None = None
    ) -> None:
        """Counted as a failure unless the measurement already ended (the
        worker stopping hands back what it holds)."""
        if not self.finished.is_set():
            self.failures.append(f"job {fence.item_id} handed back: {reason}")
            self.finished.set()
        await super().release(fence, reason=reason, available_at=available_at)


class _TimedHandle:
    def __init__(self, inner: StorageHandle, watch: Stopwatch) -> None:
        self.inner, self.watch = inner, watch

    async def size(self, uri: str) -> int:
        began = time.perf_counter()
        try:
            return await self.inner.size(uri)
        finally:
            self.watch.add("fetch", began)

    async def download(self, uri: str, path: Path, max_bytes: int) -> int:
        began = time.perf_counter()
        try:
            return await self.inner.download(uri, path, max_bytes)
        finally:
            self.watch.add("fetch", began)

    async def upload(self, path: Path, uri: str) -> None:
        began = time.perf_counter()
        try:
            await self.inner.upload(path, uri)
        finally:
            self.watch.add("upload", began)


class TimedStorage:
    """:class:`TranscodeStorage` whose handles time ``fetch`` (size + download) and ``upload``."""

    def __init__(self, inner: TranscodeStorage, watch: Stopwatch) -> None:
        self.inner, self.watch = inner, watch

    def open(self, credentials: StorageCredentials) -> StorageHandle:
        """The inner storage's handle, timed."""
        return _TimedHandle(self.inner.open(credentials), self.watch)


class TimedProcessor:
    """:class:`Processor` timing each call of the inner one as ``processor``."""

    def __init__(self, inner: Processor, watch: Stopwatch) -> None:
        self.inner, self.watch = inner, watch

    async def process(
        self, source: Path, presets: Sequence[Preset], output_dir: Path, stop: anyio.Event
    ) -> list[ProducedOutput]:
        """The inner processor's outputs."""
        began = time.perf_counter()
        try:
            return await self.inner.process(source, presets, output_dir, stop)
        finally:
            self.watch.add("processor", began)


class CountingPoster:
    """:class:`WebhookPoster` counting the 2xx answers of the inner one;
    ``enough`` is set once ``expect``'s number arrived."""

    def __init__(self, inner: WebhookPoster) -> None:
        self.inner = inner
        self.delivered = 0
        self.other: list[str] = []
        """Answers that were not 2xx (the benchmark expects none)."""
        self._expected = 0
        self.enough = anyio.Event()

    def expect(self, deliveries: int) -> None:
        """Count ``deliveries`` 2xx answers from now on."""
        self.delivered, self.other, self._expected = 0, [], deliveries
        self.enough = anyio.Event()

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> PostResult:
        """The inner poster's answer, counted."""
        result = await self.inner.post(url, body, headers)
        if result.delivered:
            self.delivered += 1
            if self.delivered >= self._expected:
                self.enough.set()
        else:
            self.other.append(str(result.status if result.status is not None else result.error))
            self.enough.set()
        return result

    async def aclose(self) -> None:
        """Close the inner poster."""
        await self.inner.aclose()
