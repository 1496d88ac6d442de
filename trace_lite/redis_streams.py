"""Redis Streams: the v1 worker contract's transport (worker-control-plane-v1.md).

:class:`RedisStreams` is a :class:`~trace_core.ports.StreamTransport` (and so
a :class:`~trace_core.ports.WakeupQueue`): the Dispatcher's outbox relay calls
:meth:`RedisStreams.send` for a task that became claimable, *after* the
database committed it (a crash between the two leaves the outbox row, which
the relay delivers again), and the control plane's claim route reads the
streams for its workers (:mod:`trace_core.api.streams`).

Layout, under ``prefix`` (default ``trace:``):

- ``<prefix>stream:<queue>``: one stream per worker queue; each message is
  ``{job_id, enqueue_id}``. Every stream has the consumer group ``group``,
  created idempotently (``XGROUP CREATE ... MKSTREAM``, ``BUSYGROUP``
  ignored), again whenever Redis answers ``NOGROUP`` (a restarted server
  without persistence, ``FLUSHALL``). Each worker is one consumer, named by
  its ``worker_id``.
- Consumers with nothing pending and idle past ``claim_idle_seconds`` are
  deleted during takeovers (a dead worker's name does not stay forever).
- ``<prefix>dlq``: dead-lettered jobs, ``{job_id, stream, message_id,
  reason}``, written together with the ``XACK`` of the message (``MULTI``).

Every ``XADD`` trims its stream with ``MAXLEN ~ maxlen``, so memory stays
bounded whatever happens to consumers; a pending message trimmed away reads
back without a body and is only acknowledged (the database fallback of the
claim route still finds its task).

A report's ack (:mod:`trace_core.api.report_acks`) calls
``between_commit_and_ack``, when set, between the database's commit and the
``XACK``: the fault point through which tests kill a control plane exactly
there (``trace-lite serve --fault-point between-commit-and-ack``, see
:mod:`trace_lite.fault_points`).

Redis is transport, never truth: a message may be duplicated or lost.
Connection failures become :class:`~trace_core.ports.StreamTransportUnavailable`,
on which claims fall back to the database.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from trace_core.errors import ConfigurationError
from trace_core.ports import StreamMessage, StreamTransportUnavailable

if TYPE_CHECKING:  # the HTTP layer is not imported by the transport
    from trace_core.api.report_acks import CommitAckHook

__all__ = ["DEFAULT_GROUP", "RedisStreams"]

DEFAULT_GROUP = "trace-workers"

_PENDING_BATCH = 64

T = TypeVar("T")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisStreams:
    """The stream transport on one Redis client (see the module docstring).

    ``claim_idle_seconds``: a message pending that long at another consumer
    is taken over (:meth:`take_over`); it should exceed the lease TTL, so a
    live worker's message is left alone while its lease can be renewed.
    ``takeover_interval_seconds`` spaces the ``XAUTOCLAIM`` sweeps of one
    process (they scan the pending lists). ``between_commit_and_ack``: the
    fault point of the module docstring (``None``: none).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        prefix: str = "trace:",
        group: str = DEFAULT_GROUP,
        maxlen: int = 100_000,
        claim_idle_seconds: float = 120.0,
        takeover_interval_seconds: float = 5.0,
        between_commit_and_ack: CommitAckHook | None = None,
    ) -> None:
        if maxlen < 1:
            raise ConfigurationError("RedisStreams.maxlen must be >= 1")
        if claim_idle_seconds < 0 or takeover_interval_seconds < 0:
            raise ConfigurationError(
                "RedisStreams.claim_idle_seconds and takeover_interval_seconds must be >= 0"
            )
        self.client = client
        self.prefix = prefix
        self.group = group
        self.maxlen = maxlen
        self.claim_idle_seconds = claim_idle_seconds
        self.takeover_interval_seconds = takeover_interval_seconds
        self.between_commit_and_ack = between_commit_and_ack
        self._groups: set[str] = set()
        self._last_takeover: dict[str, float] = {}

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisStreams:
        """A transport on a new client for ``url`` (``redis://host:port/db``)."""
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigurationError("redis url: must start with redis://, rediss:// or unix://")
        return cls(aioredis.Redis.from_url(url), **options)

    async def close(self) -> None:
        """Close the client's connections."""
        await self.client.aclose()

    def key(self, stream: str) -> str:
        """The Redis key of worker queue ``stream``."""
        return f"{self.prefix}stream:{stream}"

    @property
    def dlq_key(self) -> str:
        """The Redis key of the dead-letter stream."""
        return f"{self.prefix}dlq"

    async def _call(self, operation: Callable[[], Awaitable[T]]) -> T:
        """Run ``operation``; recreate the groups once on ``NOGROUP``; every
        other Redis failure becomes :class:`StreamTransportUnavailable`
        (whose message never holds the URL's password: redis-py names only
        host and port)."""
        for retry in (True, False):
            try:
                return await operation()
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                # The server may have restarted: its groups are gone with its data.
                self._groups.clear()
                raise StreamTransportUnavailable(f"redis: {exc}") from None
            except ResponseError as exc:
                if retry and str(exc).startswith("NOGROUP"):
                    self._groups.clear()
                    continue
                # Any other refusal (out of memory, a read-only replica): the
                # transport cannot serve; the database still can.
                raise StreamTransportUnavailable(f"redis: {exc}") from None
            except RedisError as exc:
                raise StreamTransportUnavailable(f"redis: {exc}") from None
        raise AssertionError("unreachable")  # pragma: no cover

    async def _ensure_groups(self, streams: Sequence[str]) -> None:
        for stream in streams:
            key = self.key(stream)
            if key in self._groups:
                continue
            try:
                # From id 0: messages added before the group existed are delivered too.
                await self.client.xgroup_create(key, self.group, id="0", mkstream=True)
            except ResponseError as exc:
                if not str(exc).startswith("BUSYGROUP"):
                    raise
            self._groups.add(key)

    async def send(self, queue: str, task_ids: Sequence[uuid.UUID]) -> None:
        """``XADD`` one ``{job_id, enqueue_id}`` per task to ``queue``'s stream
        (trimmed ``MAXLEN ~``), in one round trip."""
        if not task_ids:
            return

        async def add() -> None:
            await self._ensure_groups([queue])
            pipe = self.client.pipeline(transaction=False)
            for task_id in task_ids:
                fields = {"job_id": str(task_id), "enqueue_id": uuid.uuid4().hex}
                pipe.xadd(self.key(queue), fields, maxlen=self.maxlen, approximate=True)  # type: ignore[arg-type]
            await pipe.execute()

        await self._call(add)

    def _messages(self, stream: str, entries: Any) -> list[StreamMessage]:
        found: list[StreamMessage] = []
        for message_id, fields in entries or ():
            found.append(self._message(stream, _text(message_id), fields))
        return found

    @staticmethod
    def _message(stream: str, message_id: str, fields: Any) -> StreamMessage:
        body = {_text(k): _text(v) for k, v in (fields or {}).items()}
        try:
            job_id: uuid.UUID | None = uuid.UUID(body["job_id"])
        except (KeyError, ValueError):
            job_id = None  # unreadable or trimmed away: acknowledge only
        return StreamMessage(stream, message_id, job_id, body.get("enqueue_id"))

    def _by_key(self, streams: Sequence[str]) -> dict[str, str]:
        return {self.key(s): s for s in streams}

    async def read(
        self, consumer: str, streams: Sequence[str], *, wait: float
    ) -> list[StreamMessage]:
        """``XREADGROUP ... COUNT 1 [BLOCK ms] STREAMS ... >``: new messages,
        at most one per stream, in the order of ``streams``."""
        if not streams:
            return []
        names = self._by_key(streams)
        # BLOCK 0 would wait forever: no wait means no BLOCK.
        block = max(1, int(wait * 1000)) if wait > 0 else None

        async def read() -> Any:
            await self._ensure_groups(streams)
            return await self.client.xreadgroup(
                self.group, consumer, {k: ">" for k in names}, count=1, block=block
            )

        answer = await self._call(read)
        got: dict[str, list[StreamMessage]] = {}
        for key, entries in answer or ():
            stream = names[_text(key)]
            got[stream] = self._messages(stream, entries)
        return [m for s in streams for m in got.get(s, [])]

    async def pending(self, consumer: str, streams: Sequence[str]) -> list[StreamMessage]:
        """``XREADGROUP ... STREAMS ... 0``: ``consumer``'s own pending messages."""
        if not streams:
            return []
        names = self._by_key(streams)

        async def read() -> Any:
            await self._ensure_groups(streams)
            return await self.client.xreadgroup(
                self.group, consumer, {k: "0" for k in names}, count=_PENDING_BATCH
            )

        answer = await self._call(read)
        found: list[StreamMessage] = []
        for key, entries in answer or ():
            found.extend(self._messages(names[_text(key)], entries))
        return found

    async def take_over(self, consumer: str, streams: Sequence[str]) -> list[StreamMessage]:
        """``XAUTOCLAIM`` to ``consumer`` the messages idle longer than
        ``claim_idle_seconds`` (at most once per ``takeover_interval_seconds``
        per stream and process)."""
        now = time.monotonic()
        due = [
            s
            for s in streams
            if now - self._last_takeover.get(s, float("-inf")) >= self.takeover_interval_seconds
        ]
        found: list[StreamMessage] = []
        idle_ms = int(self.claim_idle_seconds * 1000)
        for stream in due:
            self._last_takeover[stream] = now

            async def claim(stream: str = stream) -> Any:
                await self._ensure_groups([stream])
                return await self.client.xautoclaim(
                    self.key(stream), self.group, consumer, idle_ms, "0-0", count=_PENDING_BATCH
                )

            answer = await self._call(claim)
            found.extend(self._messages(stream, answer[1] if answer else ()))
            await self._forget_idle_consumers(stream, consumer, idle_ms)
        return found

    async def _forget_idle_consumers(self, stream: str, consumer: str, idle_ms: int) -> None:
        """Delete the consumers of ``stream`` with nothing pending and idle
        longer than ``idle_ms`` (dead workers), so the group stays bounded
        too; a live one is recreated by its next read."""

        async def forget() -> None:
            consumers: Any = await self.client.xinfo_consumers(self.key(stream), self.group)
            for entry in consumers:
                name = _text(entry["name"])
                if name != consumer and entry["pending"] == 0 and entry["idle"] > idle_ms:
                    await self.client.xgroup_delconsumer(self.key(stream), self.group, name)

        await self._call(forget)

    async def ack(self, messages: Sequence[StreamMessage]) -> None:
        """``XACK`` every message (one round trip)."""
        if not messages:
            return
        if len(messages) == 1:
            # A report's own message: one command, without a pipeline's bookkeeping.
            [m] = messages

            async def ack_one() -> None:
                await self.client.xack(self.key(m.stream), self.group, m.message_id)

            await self._call(ack_one)
            return

        async def ack() -> None:
            pipe = self.client.pipeline(transaction=False)
            for m in messages:
                pipe.xack(self.key(m.stream), self.group, m.message_id)
            await pipe.execute()

        await self._call(ack)

    async def dead_letter(self, message: StreamMessage, reason: str) -> None:
        """``XADD`` the message to the dead-letter stream and ``XACK`` it, in one ``MULTI``."""

        async def move() -> None:
            pipe = self.client.pipeline(transaction=True)
            fields = {
                "job_id": str(message.job_id or ""),
                "stream": message.stream,
                "message_id": message.message_id,
                "reason": reason,
            }
            pipe.xadd(self.dlq_key, fields, maxlen=self.maxlen, approximate=True)  # type: ignore[arg-type]
            pipe.xack(self.key(message.stream), self.group, message.message_id)
            await pipe.execute()

        await self._call(move)

    async def pending_count(self, stream: str) -> int:
        """How many messages of ``stream`` are delivered and not acknowledged
        (for tests and operators)."""

        async def count() -> Any:
            await self._ensure_groups([stream])
            return await self.client.xpending(self.key(stream), self.group)

        answer = await self._call(count)
        return int(answer["pending"])
