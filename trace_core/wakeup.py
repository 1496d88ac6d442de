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

__all__ = ["WakeupHub"]


class _Waiter:
    __slots__ = ("event", "token")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.token = anyio.lowlevel.current_token()


class WakeupHub:
    """Thread-safe fan-out of channel notifications to async waiters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: defaultdict[str, set[_Waiter]] = defaultdict(set)

    async def wait(self, channel: str, max_wait: float) -> bool:
        """Wait for ``channel`` to fire; False after ``max_wait`` seconds."""
        waiter = _Waiter()
        with self._lock:
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
            waiters = list(self._waiters.get(channel, ()))
        for waiter in waiters:
            self._set(waiter)

    @staticmethod
    def _set(waiter: _Waiter) -> None:
        try:
            if anyio.lowlevel.current_token() is waiter.token:
                waiter.event.set()
                return
        except RuntimeError:
            pass  # not inside an event loop: we are on another thread
        # RuntimeError: the waiter's loop has ended; nobody is left to wake.
        with contextlib.suppress(RuntimeError):
            anyio.from_thread.run_sync(waiter.event.set, token=waiter.token)
