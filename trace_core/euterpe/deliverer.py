"""The webhook deliverer (euterpe-contract.md §8, §12, §13): posts job events, signed.

A deliverer leases ``job_outbox_events`` with the ownership protocol, at most
one event per job at a time and a job's events in ``sequence`` order
(``tx.webhook_delivery.claim_in_stage_order``), posts each stored body
(:func:`~trace_core.euterpe.webhook_body.webhook_body_bytes`), signed with
the secrets of the event's requester, and records the answer with a fenced
write: 2xx ``delivered``; retryable answers back to ``pending`` after a
backoff with jitter on the event's own ``attempts``; the rest, and the
exhausted, ``dead_letter`` (:func:`~.deliverer_config.webhook_retry_policy`).
While a post runs its lease is heartbeated; a deliverer that lost its lease
(it was too slow, and another reclaimed the event) abandons the post and
writes nothing.

Delivery is at least once: a deliverer killed between the receiver's 2xx and
its own ``delivered`` write leaves the event leased; once the lease expires
another deliverer posts it again (new timestamp, new nonce, same body and
``event_id``), and the receiver helper acknowledges the duplicate without
processing it twice (:mod:`trace_core.euterpe.receiver`).
"""

from __future__ import annotations

import contextlib
import logging
import random
import uuid
from collections.abc import Awaitable, Callable, Sequence

import anyio
import anyio.abc

from trace_core.clock import Clock, SystemClock
from trace_core.errors import DatabaseUnavailable, StaleClaim
from trace_core.euterpe.deliverer_config import (
    DelivererConfig,
    webhook_retry_policy,
)
from trace_core.euterpe.job_records import EVENTS_CHANNEL
from trace_core.euterpe.webhook_body import CONTENT_TYPE, webhook_body_bytes
from trace_core.euterpe.webhook_poster import PostResult, WebhookPoster
from trace_core.identity import worker_id as default_worker_id
from trace_core.leasing import LeaseConfig, LeaseQueue
from trace_core.model import JOB_OUTBOX_EVENTS, Lease
from trace_core.outage import LoopHealth, Sleep
from trace_core.retry import RetryClass, RetryPolicy
from trace_core.security.webhook_signing import WebhookSigner
from trace_core.storage.ports.webhook_delivery import WebhookTarget
from trace_core.storage.protocol import Repository

__all__ = ["DeliveryOutcome", "WebhookDeliverer"]

log = logging.getLogger(__name__)

_Wait = Callable[[float], Awaitable[object]]
"""A wait for at most some seconds (``Subscription.wait`` has this shape)."""


class DeliveryOutcome:
    """What became of one leased event (the names :meth:`WebhookDeliverer.run_once` counts)."""

    DELIVERED = "delivered"
    RETRYING = "retrying"
    DEAD_LETTERED = "dead_letter"
    LOST_LEASE = "lost_lease"
    """The lease was taken over meanwhile; nothing was written."""
    NO_WEBHOOK = "no_webhook"
    """The job has no ``status_webhook_url`` (a requester that polls): closed unsent."""


class WebhookDeliverer:
    """Claims webhook events and posts them; ``run`` until :meth:`stop`."""

    def __init__(
        self,
        repo: Repository,
        signer: WebhookSigner,
        poster: WebhookPoster,
        *,
        clock: Clock | None = None,
        config: DelivererConfig | None = None,
        retry: RetryPolicy | None = None,
        worker_id: str | None = None,
        rng: random.Random | None = None,
        sleep: Sleep | None = None,
    ) -> None:
        self.repo = repo
        self.signer = signer
        self.poster = poster
        self.config = config or DelivererConfig()
        self.clock = clock or SystemClock()
        self.worker_id = worker_id or default_worker_id()
        self._rng = rng or random.Random()
        self.retry = retry or webhook_retry_policy()
        self.leases = LeaseQueue(
            repo,
            JOB_OUTBOX_EVENTS,
            clock=self.clock,
            config=LeaseConfig(lease_seconds=self.config.lease_seconds),
            retry=self.retry,
            rng=self._rng,
        )
        self.health = LoopHealth("webhook deliverer", logger=log, sleep=sleep, rng=self._rng)
        self.rounds = 0
        """Rounds :meth:`run` has completed (for health checks and tests)."""
        self._wake = anyio.Event()
        self._stop = anyio.Event()
        self._stopped = anyio.Event()

    # --- one round ----------------------------------------------------------

    async def run_once(self) -> list[str]:
        """Reclaim expired leases, claim one batch in stage order and deliver it;
        the outcome of each event claimed (:class:`DeliveryOutcome` names)."""
        await self.leases.reclaim_expired()
        async with self.repo.statement() as tx:
            leases = await tx.webhook_delivery.claim_in_stage_order(
                worker_id=self.worker_id,
                lease_seconds=self.config.lease_seconds,
                now=self.clock.now(),
                limit=self.config.batch_size,
            )
        if not leases:
            return []
        async with self.repo.read() as tx:
            targets = await tx.webhook_delivery.targets([_event_id(lease) for lease in leases])
        outcomes: list[str] = []
        limiter = anyio.CapacityLimiter(self.config.concurrency)

        async def one(lease: Lease) -> None:
            async with limiter:
                outcomes.append(await self.deliver(lease, targets.get(_event_id(lease))))

        async with anyio.create_task_group() as tg:
            for lease in leases:
                tg.start_soon(one, lease)
        return outcomes

    async def deliver(self, lease: Lease, target: WebhookTarget | None) -> str:
        """Post one leased event and record the answer, fenced by its lease."""
        if target is None or target.url is None:
            # Webhooks are optional (§14): the requester reads the status instead.
            return await self._record(lease, PostResult(204), DeliveryOutcome.NO_WEBHOOK)
        body = webhook_body_bytes(lease.data["payload"])
        headers = self.signer.headers(
            target.requester_id,
            _event_id(lease),
            body,
            timestamp=int(self.clock.now().timestamp()),
        )
        headers["content-type"] = CONTENT_TYPE
        result = await self._post_while_heartbeating(lease, target.url, body, headers)
        if result is None:
            log.info("webhook event %s: lease lost during the post; abandoned", lease.item_id)
            return DeliveryOutcome.LOST_LEASE
        return await self._record(lease, result, DeliveryOutcome.DELIVERED)

    async def _post_while_heartbeating(
        self, lease: Lease, url: str, body: bytes, headers: dict[str, str]
    ) -> PostResult | None:
        """The post's answer, or ``None`` if the lease was lost while it ran."""
        result: PostResult | None = None
        lost = False
        async with anyio.create_task_group() as tg:

            async def heartbeat() -> None:
                nonlocal lost
                while True:
                    await anyio.sleep(self.config.heartbeat_seconds)
                    try:
                        await self.leases.heartbeat(lease.fence)
                    except StaleClaim:
                        lost = True
                        tg.cancel_scope.cancel()
                        return
                    except DatabaseUnavailable:
                        continue  # the lease may still hold; the fenced write decides

            async def post() -> None:
                nonlocal result
                try:
                    result = await self.poster.post(url, body, headers)
                except Exception as exc:
                    # A poster's own bug or an unforeseen transport error: a
                    # failed attempt like a timeout, not a crash of the round.
                    result = PostResult(None, f"poster raised {type(exc).__name__}")
                tg.cancel_scope.cancel()

            tg.start_soon(heartbeat)
            tg.start_soon(post)
        return None if lost else result

    async def _record(self, lease: Lease, result: PostResult, success: str) -> str:
        """Write the answer under the lease: delivered, retry later or dead letter."""
        try:
            if result.delivered:
                await self.leases.complete(lease.fence)
                return success
            retry_class = self.retry.classify(result.status, retryable=True)
            if retry_class is RetryClass.CREDENTIAL_REFRESH:
                retry_class = RetryClass.RETRYABLE  # see webhook_retry_policy
            error = f"HTTP {result.status}" if result.status is not None else str(result.error)
            outcome = await self.leases.fail(lease.fence, error, retry_class=retry_class)
        except StaleClaim:
            # Reclaimed meanwhile: the new holder posts again (a duplicate the
            # receiver acknowledges) and writes the outcome.
            return DeliveryOutcome.LOST_LEASE
        log.warning(
            "webhook event %s, delivery attempt %d: %s; %s",
            lease.item_id,
            lease.attempt,
            error,
            "retrying" if outcome.retrying else "dead-lettered",
        )
        return DeliveryOutcome.RETRYING if outcome.retrying else DeliveryOutcome.DEAD_LETTERED

    # --- the service --------------------------------------------------------

    def wake(self, event_ids: Sequence[uuid.UUID] = ()) -> None:
        """Poll at once (a local commit wrote events); safe to call any time.
        Fits the job lifecycle's ``on_commit`` hook, which passes the new
        events' ids (unused: the claim finds them, in order)."""
        self._wake.set()

    async def run(self) -> None:
        """Deliver until :meth:`stop`: a full batch is followed by the next round
        at once, otherwise the loop waits for a wake-up (:meth:`wake`, or a
        commit on :data:`EVENTS_CHANNEL`, from other processes too on Postgres)
        or a poll jittered within ``poll_min_seconds..poll_max_seconds``. A
        failed round (database down) backs off through :attr:`health`."""
        self.health.running = True
        try:
            wakeups = await self.repo.subscribe(EVENTS_CHANNEL)
            while not self._stop.is_set():
                try:
                    outcomes = await self.run_once()
                    self.rounds += 1
                    self.health.succeeded()
                except Exception as exc:
                    if self._stop.is_set():
                        break
                    await self._until_woken(self.health.failed(exc))
                    continue
                if len(outcomes) >= self.config.batch_size:
                    continue
                poll = self._rng.uniform(self.config.poll_min_seconds, self.config.poll_max_seconds)
                await self._until_woken(poll, wakeups.wait)
        finally:
            self.health.running = False
            self._stopped.set()

    async def _until_woken(self, seconds: float, *others: _Wait) -> None:
        """Wait ``seconds``, or less if woken or stopped meanwhile (a :meth:`wake`
        that came during the round just ended counts: the wait is skipped)."""
        if not self._wake.is_set():
            with anyio.move_on_after(seconds):
                async with anyio.create_task_group() as tg:

                    async def until(wait: _Wait) -> None:
                        if await wait(seconds):
                            tg.cancel_scope.cancel()

                    for wait in (self._wait_wake, self._wait_stop, *others):
                        tg.start_soon(until, wait)
        if self._wake.is_set():
            self._wake = anyio.Event()

    async def _wait_wake(self, _seconds: float) -> bool:
        await self._wake.wait()
        return True

    async def _wait_stop(self, _seconds: float) -> bool:
        await self._stop.wait()
        return True

    async def start(self, task_group: anyio.abc.TaskGroup) -> None:
        """Run :meth:`run` in ``task_group``."""
        task_group.start_soon(self.run)

    async def stop(self) -> None:
        """Stop claiming; the round in flight finishes; wait for the loop to end
        (at once if it is not running)."""
        self._stop.set()
        if self.health.running:
            await self._stopped.wait()

    async def aclose(self) -> None:
        """Close the poster's connections."""
        with contextlib.suppress(Exception):
            await self.poster.aclose()


def _event_id(lease: Lease) -> uuid.UUID:
    """The event id of a lease on ``job_outbox_events`` (whose ids are UUIDs)."""
    assert isinstance(lease.item_id, uuid.UUID)
    return lease.item_id
