"""A cancel that a library drops (Python 3.11's wait_for, when the awaited result arrives
with the cancel) still stops the orchestrator's loop at its next turn."""

from __future__ import annotations

import asyncio

import pytest

from treadle.orchestrator.loop import _honour_lost_cancel


def test_a_dropped_cancel_is_honoured_at_the_next_check() -> None:
    turns: list[int] = []

    async def loop() -> None:
        for turn in range(100):
            _honour_lost_cancel()
            turns.append(turn)
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                pass  # what the racing wait_for does: the cancel is gone

    async def main() -> None:
        task = asyncio.create_task(loop())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert 0 < len(turns) < 100  # stopped right after the dropped cancel, not at the end


def test_no_cancel_no_effect() -> None:
    async def main() -> None:
        _honour_lost_cancel()

    asyncio.run(main())
