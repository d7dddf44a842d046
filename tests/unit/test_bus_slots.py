"""bus.Slots: a concurrency budget shared by consumers, handed out first-come first-served."""

from __future__ import annotations

import asyncio

from treadle.services.bus import Slots


def test_freed_slots_go_to_the_consumer_that_waited() -> None:
    async def main() -> list[str]:
        slots, stop, order = Slots(2), asyncio.Event(), []
        assert await slots.take(5, stop) == 2  # A takes everything
        waiting_b = asyncio.create_task(slots.take(1, stop))
        await asyncio.sleep(0)
        slots.give(2)  # A's fetch came back empty: it returns both slots ...
        order.append("A" if await slots.take(2, stop) else "A-none")  # ... and asks again
        order.append(f"B{await waiting_b}")
        stop.set()
        assert await slots.take(1, stop) == 0
        return order

    # B, which was waiting, got its slot; A got only what was left
    assert asyncio.run(main()) == ["A", "B1"]


def test_stop_releases_a_waiting_consumer() -> None:
    async def main() -> int:
        slots, stop = Slots(1), asyncio.Event()
        await slots.take(1, stop)
        waiting = asyncio.create_task(slots.take(1, stop))
        await asyncio.sleep(0)
        stop.set()
        got = await waiting
        slots.give(1)
        assert slots.free == 1
        return got

    assert asyncio.run(main()) == 0
