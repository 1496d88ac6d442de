"""The outbox relay: performs side effects recorded by committed transactions.

It claims outbox rows with the same lease protocol as tasks, runs the
handler registered for each row's ``kind`` (with bounded concurrency), marks
successes done with a fenced statement, and retries failures with
backoff and jitter until their attempts run out (then ``Failed``, the dead
letter). It wakes at once after a local commit on the outbox channel (and,
on Postgres, after a commit in another process, through LISTEN/NOTIFY), and
otherwise polls at a jittered interval (euterpe-contract.md §12 defaults).

Handlers must be idempotent: delivery is at-least-once (a relay that dies
after the side effect and before marking the row done repeats it).

The relay outlives a database outage (:meth:`OutboxRelay.run`): a round whose
reclaim, claim or completion fails is not the end of the loop, which backs
off with jitter (:class:`~trace_core.outage.LoopHealth`, logging the outage
once) and carries on by itself when the database is back; rows whose
completion could not be written are kept and marked done then.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import anyio

from trace_core.clock import Clock, SystemClock
from trace_core.errors import ConfigurationError, DatabaseUnavailable, StaleClaim
from trace_core.identity import worker_id as default_worker_id
from trace_core.leasing import LeaseConfig, LeaseQueue
from trace_core.model import OUTBOX, Lease
from trace_core.outage import LoopHealth, Sleep
from trace_core.retry import RetryClass, RetryPolicy
from trace_core.storage.protocol import NewOutboxRow, Repository, Transaction

__all__ = [
    "OUTBOX_CHANNEL",
    "Deferred",
    "OutboxHandler",
    "OutboxRelay",
    "PermanentFailure",
    "RelayConfig",
    "write_outbox",
]

log = logging.getLogger(__name__)

OUTBOX_CHANNEL = "trace_outbox"

OutboxHandler = Callable[[Mapping[str, Any]], Awaitable[None]]
"""Performs one side effect from a row's payload; raises to request a retry."""


class PermanentFailure(Exception):
    """Raised by a handler for an error no retry can fix: dead-letter at once."""


class Deferred(Exception):
    """Raised by a handler that cannot act yet (e.g. its target is paused):
    the row goes back to ``Pending`` for ``delay_seconds`` without counting
    as a failure."""

    def __init__(self, delay_seconds: float, reason: str) -> None:
        super().__init__(reason)
        self.delay_seconds = delay_seconds


@dataclass(frozen=True)
class RelayConfig:
    """Relay settings; defaults from euterpe-contract.md §12."""

    batch_size: int = 10
    poll_min_seconds: float = 0.5
    poll_max_seconds: float = 1.5
    concurrency: int = 5
    lease_seconds: float = 60.0

    def __post_init__(self) -> None:
        if not 1 <= self.batch_size <= 1000:
            raise ConfigurationError("RelayConfig.batch_size must be within 1..1000")
        if not 0 < self.poll_min_seconds <= self.poll_max_seconds:
            raise ConfigurationError(
                "RelayConfig.poll_min_seconds must be > 0 and <= poll_max_seconds"
            )
        if self.concurrency < 1:
            raise ConfigurationError("RelayConfig.concurrency must be >= 1")
        if self.lease_seconds <= 0:
            raise ConfigurationError("RelayConfig.lease_seconds must be > 0")


async def write_outbox(tx: Transaction, rows: Sequence[NewOutboxRow], now: Any) -> list[int]:
    """Insert outbox rows in ``tx`` and wake relays once it commits."""
    ids = await tx.insert_outbox(rows, now=now)
    if ids:
        tx.notify(OUTBOX_CHANNEL)
    return ids


class OutboxRelay:
    """Drains the outbox: claim, handle, mark done / retry / dead-letter."""

    def __init__(
        self,
        repo: Repository,
        handlers: Mapping[str, OutboxHandler],
        *,
        clock: Clock | None = None,
        config: RelayConfig | None = None,
        retry: RetryPolicy | None = None,
        worker_id: str | None = None,
        rng: random.Random | None = None,
        sleep: Sleep | None = None,
    ) -> None:
        self.repo = repo
        self.handlers = dict(handlers)
        self.config = config or RelayConfig()
        self.worker_id = worker_id or default_worker_id()
        self._rng = rng or random.Random()
        self.leases = LeaseQueue(
            repo,
            OUTBOX,
            clock=clock or SystemClock(),
            config=LeaseConfig(lease_seconds=self.config.lease_seconds),
            retry=retry,
            rng=self._rng,
        )
        self.health = LoopHealth("outbox relay", logger=log, sleep=sleep, rng=self._rng)
        """The loop's failure streak; ``sleep`` paces its backoff (tests inject one)."""
        self._stop = anyio.Event()
        self._stopped = anyio.Event()
        self._waiting = anyio.CancelScope()

    async def run_once(self) -> int:
        """Reclaim expired rows, then claim and handle one batch; rows handled."""
        await self.leases.reclaim_expired()
        leases = await self.leases.claim_batch(self.worker_id, self.config.batch_size)
        if not leases:
            return 0
        done: list[Lease] = []
        limiter = anyio.CapacityLimiter(self.config.concurrency)

        async def handle(lease: Lease) -> None:
            async with limiter:
                if await self._handle(lease):
                    done.append(lease)

        async with anyio.create_task_group() as tg:
            for lease in leases:
                tg.start_soon(handle, lease)
        if done:
            await self.leases.complete_many([lease.fence for lease in done])
        return len(leases)

    async def _handle(self, lease: Lease) -> bool:
        kind = str(lease.data["kind"])
        handler = self.handlers.get(kind)
        try:
            if handler is None:
                raise PermanentFailure(f"no handler registered for outbox kind {kind!r}")
            await handler(lease.data["payload"])
            return True
        except Deferred as deferral:
            later = self.leases.clock.now() + timedelta(seconds=deferral.delay_seconds)
            with contextlib.suppress(StaleClaim):  # reclaimed meanwhile: not ours to requeue
                await self.leases.requeue(lease.fence, reason=str(deferral), available_at=later)
            return False
        except Exception as exc:
            retry_class = (
                RetryClass.FATAL if isinstance(exc, PermanentFailure) else RetryClass.RETRYABLE
            )
            error = f"{type(exc).__name__}: {exc}"
            try:
                outcome = await self.leases.fail(lease.fence, error, retry_class=retry_class)
            except StaleClaim:
                return False  # reclaimed meanwhile: another relay owns the row now
            log.warning(
                "outbox row %s (%s) failed on attempt %d: %s; %s",
                lease.item_id,
                kind,
                lease.attempt,
                type(exc).__name__,
                "retrying" if outcome.retrying else "dead-lettered",
            )
            return False

    async def run(self) -> None:
        """Drain until :meth:`stop`, refilling the batch as rows finish.

        Up to ``batch_size`` rows are claimed at a time, ``concurrency`` of
        them handled at once (euterpe-contract.md §12). Unlike a loop of
        :meth:`run_once`, which handles a whole batch before it claims again,
        the loop tops the batch up as soon as a row finishes: rows that come
        in one at a time (an accept request each) are handled side by side
        instead of one after the other, and one slow row never holds up the
        others. Finished rows are marked done together, one statement per
        wake of the loop. With the batch full it waits for a row to finish;
        with nothing to claim, for a wake-up, a finished row or the jittered
        poll. Expired leases are reclaimed at most once per ``poll_min_seconds``.

        A failed round (the database is down) backs off with jitter through
        :attr:`health` and tries again; the loop ends on :meth:`stop` only.
        """
        limiter = anyio.CapacityLimiter(self.config.concurrency)
        claimed = 0
        done: list[Lease] = []
        stranded: list[Lease] = []
        finished = anyio.Event()
        next_reclaim = 0.0

        async def process(lease: Lease) -> None:
            nonlocal claimed
            try:
                async with limiter:
                    if await self._handle(lease):
                        done.append(lease)
            except DatabaseUnavailable as exc:
                # Neither handled nor its failure written: the row is still
                # ours (leased), so it is handled again as soon as a round
                # succeeds, rather than after its whole lease. The loop's own
                # next round reports the outage.
                log.debug("outbox row %s: %s; handled again once it is back", lease.item_id, exc)
                stranded.append(lease)
            finally:
                claimed -= 1
                finished.set()

        async def flush() -> None:
            if done:
                # Removed only once written: rows finished during the await
                # are appended behind, and a failed write keeps them all.
                count = len(done)
                await self.leases.complete_many([lease.fence for lease in done[:count]])
                del done[:count]

        self.health.running = True
        try:
            wakeups = await self.repo.subscribe(OUTBOX_CHANNEL)
            async with anyio.create_task_group() as tg:
                while not self._stop.is_set():
                    finished = anyio.Event()
                    try:
                        await flush()
                        want = self.config.batch_size - claimed
                        if want > 0:
                            # Expired leases are rare: look for them once per
                            # shortest poll, not before every top-up.
                            if anyio.current_time() >= next_reclaim:
                                await self.leases.reclaim_expired()
                                next_reclaim = anyio.current_time() + self.config.poll_min_seconds
                            leases = await self.leases.claim_batch(self.worker_id, want)
                            full = len(leases) == want
                            # The database answers again: retry what the
                            # outage cut off (their leases are still ours).
                            leases.extend(stranded)
                            stranded.clear()
                            for lease in leases:
                                claimed += 1
                                tg.start_soon(process, lease)
                            self.health.succeeded()
                            if full or self._stop.is_set():
                                continue
                        else:
                            self.health.succeeded()
                    except Exception as exc:
                        # An outage (or a bug) ends this round, never the loop
                        # nor the rows in flight, which finish meanwhile.
                        if self._stop.is_set():
                            break
                        with anyio.CancelScope() as self._waiting:
                            await self.health.backoff_after(exc)
                        continue
                    poll = self._rng.uniform(
                        self.config.poll_min_seconds, self.config.poll_max_seconds
                    )
                    with anyio.CancelScope() as self._waiting:
                        if want > 0:
                            await _first_of(functools.partial(wakeups.wait, poll), finished.wait)
                        else:
                            await finished.wait()
            with contextlib.suppress(DatabaseUnavailable):
                # Stopping during an outage: these rows are reclaimed later.
                await flush()
        finally:
            self.health.running = False
            self._stopped.set()

    async def start(self, task_group: anyio.abc.TaskGroup) -> None:
        """Run :meth:`run` in ``task_group``."""
        task_group.start_soon(self.run)

    async def stop(self) -> None:
        """Ask the loop to stop claiming, finish the rows in flight and exit; wait for it."""
        self._stop.set()
        self._waiting.cancel()
        await self._stopped.wait()


async def _first_of(*waits: Callable[[], Awaitable[Any]]) -> None:
    """Return as soon as one of ``waits`` has returned (the others are cancelled)."""
    async with anyio.create_task_group() as tg:

        async def one(wait: Callable[[], Awaitable[Any]]) -> None:
            await wait()
            tg.cancel_scope.cancel()

        for wait in waits:
            tg.start_soon(one, wait)
