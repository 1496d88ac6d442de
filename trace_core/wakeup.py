"""In-process wake-ups: "something was committed on channel X".

Waiters in any thread or event loop register an event; :meth:`WakeupHub.fire`
sets them all. A commit fires its channels locally; on Postgres a listener
thread also fires them for commits made by other processes (LISTEN/NOTIFY).
A wake-up is only a hint: the database stays the truth, and waiters always
poll after a bounded wait.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict

import anyio
import anyio.from_thread
import anyio.lowlevel

__all__ = ["Subscription", "WakeupHub"]


class _Waiter:
    __slots__ = ("event", "thread", "token")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.token = anyio.lowlevel.current_token()
        self.thread = threading.get_ident()


class WakeupHub:
    """Thread-safe fan-out of channel notifications to async waiters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: defaultdict[str, set[_Waiter]] = defaultdict(set)
        self._generation: defaultdict[str, int] = defaultdict(int)

    def subscribe(self, channel: str) -> Subscription:
        """A subscription that remembers what it has seen (no lost wake-ups)."""
        return Subscription(self, channel)

    def generation(self, channel: str) -> int:
        """How many times ``channel`` has fired."""
        with self._lock:
            return self._generation[channel]

    async def wait(self, channel: str, max_wait: float, *, after: int | None = None) -> bool:
        """Wait for ``channel`` to fire (or to have fired since generation
        ``after``); False after ``max_wait`` seconds."""
        waiter = _Waiter()
        with self._lock:
            if after is not None and self._generation[channel] > after:
                return True
            self._waiters[channel].add(waiter)
        try:
            with anyio.move_on_after(max_wait):
                await waiter.event.wait()
                return True
            return False
        finally:
            with self._lock:
                self._waiters[channel].discard(waiter)

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

    async def wait(self, max_wait: float) -> bool:
        """True if the channel fired since the last wait (or subscribing)."""
        fired = await self._hub.wait(self.channel, max_wait, after=self._seen)
        self._seen = self._hub.generation(self.channel)
        return fired
