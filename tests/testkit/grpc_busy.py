"""A process busy with gRPC, as every Treadle service is (health and control servers,
OTLP export): a server and clients calling it without pause, for tests of what the
process forks meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc


@contextlib.asynccontextmanager
async def grpc_busy(callers: int = 8) -> AsyncIterator[None]:
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")

    async def call() -> None:
        while True:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await channel.unary_unary("/nothing/Here")(b"", timeout=0.01)

    tasks = [asyncio.create_task(call()) for _ in range(callers)]
    try:
        yield
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await channel.close()
        await server.stop(0)
