"""Inference replicas announced in the run's NATS key-value bucket (real nats-server):
an announcement is read back whole, withdrawn on a clean stop, expires when its replica
dies without withdrawing, and entries that are not announcements are skipped."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from treadle.services.bus import Bus
from treadle.services.discovery import Announcement, Announcer, announced, replica_key
from treadle.services.sections import NatsSection

pytestmark = pytest.mark.integration


def _run() -> str:
    return f"disc{time.time_ns() % 10**9}"


async def _until(cond, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not await cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)


def test_an_announcement_is_read_back_and_withdrawn_on_stop(nats_url: str) -> None:
    async def main() -> None:
        bus = await Bus.connect(NatsSection(url=nats_url), _run())
        try:
            assert await announced(bus) == []  # no bucket yet: nothing announced
            me = Announcement("http://10.0.0.7:8000", "10.0.0.7:50051", "policy", "node-a", 42)
            stop = asyncio.Event()
            task = asyncio.create_task(Announcer(bus, replica_key(8000, "node-a"), me).run(stop))

            async def listed() -> bool:
                return await announced(bus) == [me]

            await _until(listed)
            stop.set()
            await task

            async def gone() -> bool:
                return await announced(bus) == []

            await _until(gone, 2.0)  # deleted at once, not left to expire
        finally:
            await bus.close()

    asyncio.run(main())


def test_a_replica_that_dies_without_withdrawing_expires(nats_url: str) -> None:
    async def main() -> None:
        bus = await Bus.connect(NatsSection(url=nats_url), _run())
        try:
            dead = Announcement("http://127.0.0.1:9", "127.0.0.1:10", "policy")
            await Announcer(bus, "inference-dead-9", dead, ttl_s=1.0).put()  # and never again
            assert await announced(bus) == [dead]
            started = time.monotonic()

            async def expired() -> bool:
                return await announced(bus) == []

            await _until(expired, 10.0)
            assert time.monotonic() - started >= 0.5  # it expired; nothing deleted it
        finally:
            await bus.close()

    asyncio.run(main())


def test_entries_that_are_not_announcements_are_skipped(nats_url: str) -> None:
    async def main() -> None:
        bus = await Bus.connect(NatsSection(url=nats_url), _run())
        try:
            good = Announcement("https://gpu-3:8000", "gpu-3:50051", "policy")
            await Announcer(bus, "inference-gpu-3-8000", good).put()
            kv = await bus.js.key_value(bus.subjects.replicas_bucket)
            await kv.put("inference-junk", b"not json")
            await kv.put("inference-nourl", json.dumps({"grpc": "x:1"}).encode())
            await kv.put(
                "inference-file", json.dumps({"url": "file:///etc", "grpc": "x:1"}).encode()
            )
            assert await announced(bus) == [good]
        finally:
            await bus.close()

    asyncio.run(main())
