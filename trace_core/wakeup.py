"""In-process wake-ups: "something was committed on channel X".

Waiters in any thread or event loop register an event; :meth:`WakeupHub.fire`
sets them all. A commit fires its channels locally; on Postgres a listener
thread also fires them for commits made by other processes (LISTEN/NOTIFY).
A wake-up is only a hint: the database stays the truth, and waiters always
poll after a bounded wait.

A waiter may also make an :class:`Offer`: "hand me new work directly". A
creator in this process then :meth:`~WakeupHub.take` takes the offer, writes the
work already claimed for it in its own transaction, and
:meth:`~WakeupHub.settle` settles it after the commit (the one-commit
hand-off of :meth:`trace_core.tasks.TaskQueue.claim_wait`). The hub only
keeps the book of offers; what is handed over is the caller's.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from typing import Any, Generic, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel

__all__ = ["Offer", "Subscription", "WakeupHub"]

T = TypeVar("T")


class _Waiter:
    __slots__ = ("event", "thread", "token")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.token = anyio.lowlevel.current_token()
        self.thread = threading.get_ident()


_IDLE, _WAITING, _TAKEN, _DELIVERED, _GONE = range(5)


class Offer(Generic[T]):
    """A waiter's offer to take up to ``limit`` items of work handed over directly.

    Lives in the hub's book while its waiter waits (:meth:`WakeupHub.wait`
    with ``offer=``). A creator that takes it (:meth:`~WakeupHub.take`) writes the
    work claimed for ``claimant`` (a lease of ``lease_seconds``) and
    settles it (:meth:`~WakeupHub.settle`) after its commit; the waiter then finds
    the work in :attr:`value`. Single use: make a new one for each wait.
    """

    __slots__ = ("_state", "_waiter", "claimant", "key", "lease_seconds", "limit", "value")

    def __init__(self, key: str, claimant: str, limit: int, lease_seconds: float) -> None:
        self.key = key
        """What the waiter waits for (a queue of one database)."""
        self.claimant = claimant
        self.limit = limit
        self.lease_seconds = lease_seconds
        self.value: T | None = None
        """The work handed over, once delivered."""
        self._state = _IDLE
        self._waiter: _Waiter | None = None


class WakeupHub:
    """Thread-safe fan-out of channel notifications to async waiters, and the
    book of waiters' offers (:class:`Offer`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: defaultdict[str, set[_Waiter]] = defaultdict(set)
        self._generation: defaultdict[str, int] = defaultdict(int)
        # Per key, the waiting offers in the order they came (a dict keeps it).
        self._offers: defaultdict[str, dict[Offer[Any], None]] = defaultdict(dict)

    def subscribe(self, channel: str) -> Subscription:
        """A subscription that remembers what it has seen (no lost wake-ups)."""
        return Subscription(self, channel)

    def generation(self, channel: str) -> int:
        """How many times ``channel`` has fired."""
        with self._lock:
            return self._generation[channel]

    async def wait(
        self,
        channel: str,
        max_wait: float,
        *,
        after: int | None = None,
        offer: Offer[T] | None = None,
    ) -> bool:
        """Wait for ``channel`` to fire (or to have fired since generation
        ``after``); False after ``max_wait`` seconds.

        With ``offer``, creators may hand work over meanwhile: the wait then
        ends with ``offer.value`` set. A hand-off under way when the wait
        would end (a fire, the time limit) is waited for, since its work is
        already claimed for this waiter; it takes one commit. Only a
        cancellation from outside abandons it: the work stays claimed and its
        lease runs out (the reaper's normal path).
        """
        waiter = listening = _Waiter()
        with self._lock:
            if after is not None and self._generation[channel] > after:
                return True
            self._waiters[channel].add(waiter)
            if offer is not None:
                offer._state, offer._waiter = _WAITING, waiter
                self._offers[offer.key][offer] = None
        fired = False
        try:
            with anyio.move_on_after(max_wait):
                await waiter.event.wait()
                fired = True
            while offer is not None:
                with self._lock:
                    if offer._state != _TAKEN:
                        break
                    waiter = offer._waiter = _Waiter()
                await waiter.event.wait()  # the creator's commit, then settle()
            return fired or (offer is not None and offer.value is not None)
        finally:
            with self._lock:
                self._waiters[channel].discard(listening)
                if offer is not None:
                    self._withdraw(offer)

    def _withdraw(self, offer: Offer[T]) -> None:
        """Take ``offer`` out of the book (the lock is held); one taken by a
        creator whose commit is still under way becomes ``gone``."""
        if offer._state == _TAKEN:
            offer._state = _GONE
        elif offer._state == _WAITING:
            offer._state = _IDLE
        book = self._offers.get(offer.key)
        if book is not None:
            book.pop(offer, None)
            if not book:
                del self._offers[offer.key]

    def waiting(self, key: str) -> int:
        """How many offers of ``key`` wait for a hand-off now."""
        with self._lock:
            return sum(1 for o in self._offers.get(key, ()) if o._state == _WAITING)

    def take(self, key: str, count: int) -> Offer[Any] | None:
        """The longest-waiting offer of ``key`` that takes ``count`` items,
        reserved for the caller (no other creator gets it) until
        :meth:`settle`; ``None`` if none waits."""
        with self._lock:
            for offer in self._offers.get(key, ()):
                if offer._state == _WAITING and offer.limit >= count:
                    offer._state = _TAKEN
                    return offer
        return None

    def settle(self, offer: Offer[T], value: T | None) -> bool:
        """End a :meth:`take`: deliver ``value`` (committed work claimed for
        the offer) or, with ``None``, put the offer back (nothing was handed
        over; its waiter goes on waiting, after one spurious wake-up). False
        if the waiter had gone meanwhile: ``value`` then belongs to nobody."""
        with self._lock:
            if offer._state == _GONE:
                return False
            if offer._state != _TAKEN:
                raise RuntimeError("settle() of an offer that was not taken")
            if value is None:
                offer._state = _WAITING
            else:
                offer._state, offer.value = _DELIVERED, value
            waiter = offer._waiter
        if waiter is not None:
            self._set(waiter)
        return True

    def fire(self, channel: str) -> None:
        """Wake every current waiter of ``channel``, from any thread."""
        with self._lock:
            self._generation[channel] += 1
            waiters = list(self._waiters.get(channel, ()))
        for waiter in waiters:
            self._set(waiter)

    @staticmethod
    def _set(waiter: _Waiter) -> None:
        if threading.get_ident() == waiter.thread:
            waiter.event.set()  # the waiter's own event loop thread
            return
        # RuntimeError: the waiter's loop has ended; nobody is left to wake.
        with contextlib.suppress(RuntimeError):
            anyio.from_thread.run_sync(waiter.event.set, token=waiter.token)


class Subscription:
    """Wake-ups of one channel for one consumer loop.

    A fire that happens while the consumer is busy (between two waits) is not
    lost: the next :meth:`wait` returns at once.
    """

    def __init__(self, hub: WakeupHub, channel: str) -> None:
        self._hub = hub
        self.channel = channel
        self._seen = hub.generation(channel)

    async def wait(self, max_wait: float, *, offer: Offer[T] | None = None) -> bool:
        """True if the channel fired since the last wait (or subscribing), or
        work was handed over to ``offer`` (see :meth:`WakeupHub.wait`)."""
        fired = await self._hub.wait(self.channel, max_wait, after=self._seen, offer=offer)
        self._seen = self._hub.generation(self.channel)
        return fired
