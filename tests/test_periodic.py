"""PeriodicService wake-ups: the next pass starts now, and a wake-up that
arrives while a pass runs is not lost. The interval is an hour, so only a
wake-up can start a second pass within the tests' bounded waits."""

from __future__ import annotations

import time

import anyio
import pytest

from tests.factories import wait_until
from trace_core.dispatcher.periodic import PeriodicService

pytestmark = pytest.mark.anyio

HOUR = 3600.0
BOUND = 30.0  # seconds; a wake-up takes milliseconds


class Passes(PeriodicService):
    """Counts its passes; ``hold`` (when set) keeps a pass running until released."""

    def __init__(self) -> None:
        super().__init__(HOUR)
        self.count = 0
        self.hold: anyio.Event | None = None

    async def run_once(self) -> None:
        self.count += 1
        if self.hold is not None:
            await self.hold.wait()


async def _passes(service: Passes, n: int, what: str) -> None:
    await wait_until(
        what, lambda: service.count >= n, time.monotonic() + BOUND, describe=lambda: service.count
    )


async def test_wake_starts_the_next_pass_now() -> None:
    service = Passes()
    async with anyio.create_task_group() as group:
        await service.start(group)
        await _passes(service, 1, "the first pass")
        service.wake()
        await _passes(service, 2, "a pass right after the wake-up")
        service.wake()
        await _passes(service, 3, "another one")
        await service.stop()
    assert service.count == 3


async def test_a_wake_up_during_a_pass_is_not_lost() -> None:
    service = Passes()
    service.hold = anyio.Event()
    async with anyio.create_task_group() as group:
        await service.start(group)
        await _passes(service, 1, "the first pass to start")
        service.wake()  # the pass is still running: it may have read stale state
        service.wake()  # several wake-ups during one pass make one more pass
        service.hold.set()
        await _passes(service, 2, "the pass the wake-up asked for")
        await service.stop()
    assert service.count == 2


async def test_wake_before_the_loop_starts_changes_nothing() -> None:
    service = Passes()
    service.wake()
    async with anyio.create_task_group() as group:
        await service.start(group)
        await _passes(service, 1, "the first pass")
        await service.stop()
    assert service.count == 1
