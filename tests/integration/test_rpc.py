"""gRPC bootstrap: health, reflection, deadlines on every call, retries only where the
contract marks a method idempotent."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from treadle.proto.v1 import common_pb2, trainer_service_pb2, trainer_service_pb2_grpc
from treadle.services.rpc import (
    check_health,
    idempotent_methods,
    open_channel,
    service_config,
    start_server,
)

pytestmark = pytest.mark.integration

TRAINER = trainer_service_pb2.DESCRIPTOR.services_by_name["TrainerControl"]


class FlakyTrainer(trainer_service_pb2_grpc.TrainerControlServicer):
    """Fails the first `failures` calls of each method with UNAVAILABLE; GetStatus may sleep."""

    def __init__(self, failures: int = 0, delay_s: float = 0.0):
        self.failures = failures
        self.delay_s = delay_s
        self.calls: dict[str, int] = {}

    async def _maybe_fail(self, name: str, context: grpc.aio.ServicerContext) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        if self.calls[name] <= self.failures:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")

    async def GetStatus(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._maybe_fail("GetStatus", context)
        await asyncio.sleep(self.delay_s)
        return trainer_service_pb2.TrainerStatus(step=7)

    async def Checkpoint(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._maybe_fail("Checkpoint", context)
        return trainer_service_pb2.CheckpointResponse(step=7)


async def serve(servicer: FlakyTrainer) -> Any:
    return await start_server(
        "127.0.0.1",
        0,
        [(trainer_service_pb2_grpc.add_TrainerControlServicer_to_server, servicer, TRAINER)],
    )


def test_rpc_idempotency_comes_from_the_contract() -> None:
    assert idempotent_methods(TRAINER) == ["GetStatus", "Stop"]
    cfg = service_config([TRAINER])
    assert '"method": "Checkpoint"' not in cfg  # not idempotent: never retried
    assert '"method": "Stop"' in cfg
    assert cfg.count("retryPolicy") == 1
    assert "timeout" not in cfg  # would cap every call's own deadline


def test_rpc_health_follows_serving_state() -> None:
    async def main() -> None:
        server = await serve(FlakyTrainer())
        target = f"127.0.0.1:{server.port}"
        assert not await check_health(target)  # starts NOT_SERVING until the service is ready
        await server.set_serving(True)
        assert await check_health(target)
        assert await check_health(target, TRAINER.full_name)
        assert not await check_health(target, "no.such.Service")
        await server.stop(0)
        assert not await check_health(target, timeout_s=0.5)

    asyncio.run(main())


def test_rpc_reflection_lists_services() -> None:
    async def main() -> set[str]:
        server = await serve(FlakyTrainer())
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            names: set[str] = set()
            async for resp in stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            ):
                names |= {s.name for s in resp.list_services_response.service}
        await server.stop(0)
        return names

    assert {"treadle.proto.v1.TrainerControl", "grpc.health.v1.Health"} <= asyncio.run(main())


def test_rpc_calls_without_a_deadline_get_the_default() -> None:
    async def main() -> None:
        server = await serve(FlakyTrainer(delay_s=5.0))
        async with open_channel(
            f"127.0.0.1:{server.port}", [TRAINER], default_timeout_s=0.3
        ) as channel:
            stub = trainer_service_pb2_grpc.TrainerControlStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.GetStatus(common_pb2.GetStatusRequest())
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await server.stop(0)

    asyncio.run(main())


def test_rpc_a_call_s_own_deadline_is_not_cut_to_the_default() -> None:
    """A call that asks for more time than the default gets it (an UpdateWeights that
    drains busy replicas takes longer than a GetStatus): the default only fills in."""

    async def main() -> None:
        server = await serve(FlakyTrainer(delay_s=0.8))
        async with open_channel(
            f"127.0.0.1:{server.port}", [TRAINER], default_timeout_s=0.3
        ) as channel:
            stub = trainer_service_pb2_grpc.TrainerControlStub(channel)
            status = await stub.GetStatus(common_pb2.GetStatusRequest(), timeout=10)
            assert status.step == 7
        await server.stop(0)

    asyncio.run(main())


def test_rpc_retries_idempotent_methods_only() -> None:
    async def main() -> None:
        servicer = FlakyTrainer(failures=2)
        server = await serve(servicer)
        async with open_channel(f"127.0.0.1:{server.port}", [TRAINER]) as channel:
            stub = trainer_service_pb2_grpc.TrainerControlStub(channel)
            status = await stub.GetStatus(common_pb2.GetStatusRequest())
            assert status.step == 7
            assert servicer.calls["GetStatus"] == 3  # two UNAVAILABLE, then success
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Checkpoint(trainer_service_pb2.CheckpointRequest())
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert servicer.calls["Checkpoint"] == 1  # not idempotent: never retried
        await server.stop(0)

    asyncio.run(main())


def test_rpc_retries_are_bounded() -> None:
    async def main() -> None:
        servicer = FlakyTrainer(failures=100)
        server = await serve(servicer)
        async with open_channel(f"127.0.0.1:{server.port}", [TRAINER], max_attempts=3) as channel:
            stub = trainer_service_pb2_grpc.TrainerControlStub(channel)
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.GetStatus(common_pb2.GetStatusRequest())
        assert servicer.calls["GetStatus"] == 3
        await server.stop(0)

    asyncio.run(main())
