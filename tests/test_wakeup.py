"""In-process wake-ups: no lost fires, fires from other threads."""

from __future__ import annotations

import threading

import anyio
import anyio.lowlevel
import pytest

from trace_core.wakeup import WakeupHub

pytestmark = pytest.mark.anyio


async def test_a_fire_while_busy_is_not_lost() -> None:
    hub = WakeupHub()
    sub = hub.subscribe("c")
    hub.fire("c")  # the consumer is "busy": nobody is waiting right now
    with anyio.fail_after(5):
        assert await sub.wait(60)
    assert not await sub.wait(0.01)  # seen: the next wait times out


async def test_other_channels_do_not_wake() -> None:
    hub = WakeupHub()
    sub = hub.subscribe("a")
    hub.fire("b")
    assert not await sub.wait(0.01)


async def test_a_fire_from_another_thread_wakes_the_loop() -> None:
    hub = WakeupHub()
    sub = hub.subscribe("c")

    async def fire_later() -> None:
        await anyio.lowlevel.checkpoint()  # let the waiter register first
        thread = threading.Thread(target=hub.fire, args=("c",))
        thread.start()
        await anyio.to_thread.run_sync(thread.join)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(fire_later)
            assert await sub.wait(60)
