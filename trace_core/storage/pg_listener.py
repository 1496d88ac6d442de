"""LISTEN/NOTIFY for wake-ups across processes (Postgres only).

A daemon thread holds one autocommit psycopg connection, LISTENs on the
channels asked for, and fires the :class:`~trace_core.wakeup.WakeupHub` for
each notification. It reconnects after a failure, for as long as the
repository lives: the first failure of an outage is logged, later attempts
are not, and they are spaced by the jittered backoff of
:class:`~trace_core.outage.LoopHealth`; the reconnection is logged once too.
While it is down, waiters still wake on their bounded poll interval, so a
lost notification costs latency, never correctness.
"""

from __future__ import annotations

import logging
import threading

import psycopg
from psycopg import sql

from trace_core.outage import LoopHealth
from trace_core.storage.url import DatabaseURL
from trace_core.wakeup import WakeupHub

__all__ = ["PgListener"]

log = logging.getLogger(__name__)

_POLL_SECONDS = 0.5
"""How often the thread checks for new channels or a stop request."""


class PgListener:
    """One listening connection per repository, shared by all its waiters."""

    def __init__(self, url: DatabaseURL, hub: WakeupHub) -> None:
        self._conninfo = url.conninfo()
        self._hub = hub
        self._wanted: set[str] = set()
        self._active: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._changed = threading.Event()
        self.health = LoopHealth("wake-up listener", logger=log, unavailable=(psycopg.Error,))
        """The listener's connection state (its thread updates it)."""
        self._thread = threading.Thread(target=self._run, name="trace-pg-listener", daemon=True)
        self._thread.start()

    def listen(self, channel: str) -> threading.Event:
        """Make sure ``channel`` is listened to (idempotent).

        The returned event is set once ``LISTEN`` is in effect.
        """
        with self._lock:
            active = self._active.setdefault(channel, threading.Event())
            if channel in self._wanted:
                return active
            self._wanted.add(channel)
        self._changed.set()
        return active

    def stop(self) -> None:
        """Stop the thread and close its connection."""
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        self.health.running = True
        try:
            while not self._stop.is_set():
                try:
                    self._serve()
                except Exception as exc:
                    # Anything, not only the driver's errors: the thread is the
                    # only listener of the process and must not end but on stop().
                    self._stop.wait(self.health.failed(exc))
        finally:
            self.health.running = False

    def _serve(self) -> None:
        with psycopg.connect(self._conninfo, autocommit=True) as conn:
            self.health.succeeded()
            listening: set[str] = set()
            with self._lock:
                for event in self._active.values():
                    event.clear()  # a new connection listens anew
            while not self._stop.is_set():
                with self._lock:
                    missing = self._wanted - listening
                for channel in sorted(missing):
                    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                    listening.add(channel)
                    with self._lock:
                        self._active[channel].set()
                    # Anything committed before LISTEN took effect was not
                    # heard: wake waiters so they poll once.
                    self._hub.fire(channel)
                self._changed.clear()
                for note in conn.notifies(timeout=_POLL_SECONDS, stop_after=64):
                    self._hub.fire(note.channel)
